"""The router's part of a mixture-of-experts model's training pass: the load-balancing loss term
and the expert metrics.

A training operator whose model has routers (:func:`~dapo_flow.models.moe.routing_of`) runs its
gradient forward inside :meth:`RouterTerm.recording`, then asks :meth:`RouterTerm.loss` for the
term to add to its loss: ``coef`` times the mean over the mini-batch's sequences of each
sequence's balance loss (:func:`~dapo_flow.algos.moe.sequence_balance_loss`), this micro-batch's
share of it, so micro-batches and a group's workers add up to the mini-batch's value. The same
pass tallies each expert's top-k assignments and the router's entropy; :meth:`RouterTerm.metrics`
turns the step's tally into the group's metrics. HF's MoE blocks are dropless (no capacity
factor): no token is ever dropped, so there is no dropped-token count to report.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from dapo_flow.algos.moe import load_fractions, router_entropy_sum, routing_counts, sequence_balance_loss
from dapo_flow.models.moe import ReplayTally, Routing, router_logits_recorded, token_rows
from dapo_flow.training.parallel import Parallelism


def router_metric_names(num_experts: int) -> tuple[str, ...]:
    """What :meth:`RouterTerm.metrics` reports for a model of ``num_experts`` experts."""
    return ("moe/aux_loss", "moe/router_entropy", "moe/load_max",
            *(f"moe/load_expert_{e}" for e in range(num_experts)))


class RouterTerm:
    """One RL step's router loss and tally (a new one per step)."""

    def __init__(self, routing: Routing, coef: float):
        self.routing, self.coef = routing, coef
        self.seen: list[torch.Tensor] = []
        self.counts = torch.zeros(routing.num_experts, dtype=torch.float64)  # top-k assignments per expert
        self.entropy = 0.0  # summed over routed (token, layer) pairs
        self.routed = 0.0  # routed (token, layer) pairs
        self.aux = 0.0  # the sequences' balance losses, summed over every pass
        self.sequences = 0  # sequence passes (a row trained in two epochs counts twice)
        self.replay = ReplayTally()  # routing replay: the routers' agreement with the rollout's choices

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Record the routers' logits of the forward run in the block (the previous pass's dropped)."""
        with router_logits_recorded(self.routing) as seen:
            yield
        self.seen = seen[: len(self.routing.routers)]  # a checkpointed backward would record again

    def loss(self, prompts: list[list[int]], responses: list[list[int]], *, packed: bool, n_seqs: int
             ) -> torch.Tensor | None:
        """The term to add to the micro-batch's loss (None when ``coef`` is 0: nothing to train),
        and the step's tally updated from the recorded pass over these rows."""
        logits = self.seen
        rows = token_rows(prompts, responses, packed).to(logits[0].device)
        counts, prob_sums, tokens = routing_counts(logits, rows, len(prompts), self.routing.top_k)
        balance = sequence_balance_loss(counts, prob_sums, tokens).sum()  # (): summed over the rows
        with torch.no_grad():
            self.counts += counts.sum(0).double().cpu()
            self.entropy += float(router_entropy_sum(logits, rows))
            self.routed += float(tokens.sum())
            self.aux += float(balance)
            self.sequences += len(prompts)
        self.seen = []
        return self.coef * balance / n_seqs if self.coef > 0 else None  # this micro-batch's share

    def metrics(self, parallel: Parallelism) -> dict[str, float]:
        """The step's router metrics over the whole group: ``moe/aux_loss`` (the balance loss,
        mean over sequences; reported also when it is not trained on), ``moe/router_entropy``
        (nats, mean over routed tokens and layers), ``moe/load_expert_e`` (expert e's share of
        the top-k assignments) and ``moe/load_max`` (the largest share times E: 1 = balanced); under
        routing replay also ``moe/routing_agreement``, the share of the rollout's (token, layer, k)
        choices the routers would make themselves (over every pass of the step). The balance loss
        counts the routers' own top-k, not the replayed one: it balances the router, which replay
        does not change."""
        totals = parallel.sum([*self.counts.tolist(), self.entropy, self.routed, self.aux, self.sequences,
                               self.replay.agreed, self.replay.recorded])
        num_experts = self.routing.num_experts
        loads = load_fractions(torch.tensor(totals[:num_experts]))
        entropy, routed, aux, sequences, agreed, recorded = totals[num_experts:]
        out = {"moe/aux_loss": aux / max(sequences, 1.0), "moe/router_entropy": entropy / max(routed, 1.0),
               "moe/load_max": float(loads.max()) * num_experts}
        out.update({f"moe/load_expert_{e}": float(share) for e, share in enumerate(loads)})
        if recorded:  # routing replay: of the rollout's (token, layer, k) choices, the share the routers make too
            out["moe/routing_agreement"] = agreed / recorded
        return out
