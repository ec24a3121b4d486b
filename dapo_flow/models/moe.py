"""A mixture-of-experts model's routers: which modules they are, their logits in a forward, and
where each sequence's tokens sit among them.

Hugging Face's Qwen2/Qwen3-MoE return router logits only through ``output_router_logits``,
which changes the forward's outputs (and, with labels, the loss). Hooks on the router modules
read them from any forward instead, unchanged: the padded one, the packed one and the chunked
output head alike, also with the model sharded by FSDP2 (the hooks sit on the layers' own
submodules, inside the sharded units' forwards).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

from dapo_flow.errors import ModelError


@dataclass(frozen=True)
class Routing:
    """A model's routing: experts per layer, experts per token, and its router modules (layer order)."""

    num_experts: int
    top_k: int
    routers: tuple[torch.nn.Module, ...]
    norm_topk_prob: bool = True  # the k gate weights renormalised to sum to 1 (Qwen3-MoE's config)


def routing_of(model: torch.nn.Module) -> Routing | None:
    """The model's routers: the ``gate`` of every block that also holds ``experts`` (HF's sparse
    MoE blocks), in layer order; None for a dense model."""
    routers = tuple(module.gate for module in model.modules()
                    if hasattr(module, "experts") and isinstance(getattr(module, "gate", None), torch.nn.Module))
    if not routers:
        return None
    config = model.config
    return Routing(num_experts=int(config.num_experts), top_k=int(config.num_experts_per_tok), routers=routers,
                   norm_topk_prob=bool(getattr(config, "norm_topk_prob", True)))


@contextmanager
def router_logits_recorded(routing: Routing) -> Iterator[list[torch.Tensor]]:
    """Inside the block, every router's logits are appended to the yielded list as its forward
    runs (with their autograd graph: a loss on them trains the routers). Shape: each (T, E),
    T = the forward's flat token positions (batch x length)."""
    # HF 5.x routers return (logits, top-k weights, top-k indices); older ones a Linear's logits
    with _router_outputs(routing, lambda out: out[0] if isinstance(out, tuple) else out, []) as seen:
        yield seen


@contextmanager
def _router_outputs(routing: Routing, pick, seen: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """Inside the block, ``pick(output)`` of every router's forward appended to ``seen``."""
    handles = [router.register_forward_hook(lambda _module, _inputs, output: seen.append(pick(output)))
               for router in routing.routers]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def token_rows(prompt_ids: list[list[int]], response_ids: list[list[int]], packed: bool) -> torch.Tensor:
    """The row of each flat token position of a forward over these rows, -1 at padding, in the
    layout :meth:`HFPolicy.pack` makes (prompts left-padded, responses right-padded to at least
    one column) or, ``packed``, the one :func:`~dapo_flow.models.packing.pack_rows` makes.
    Shape: (T,) long."""
    return token_slots(prompt_ids, response_ids, packed)[0]


def token_slots(prompt_ids: list[list[int]], response_ids: list[list[int]], packed: bool
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Of each flat token position of a forward over these rows (the layouts of :func:`token_rows`):
    its row (-1 at padding) and its index in that row's prompt + response tokens (-1 at padding).
    Shape: -> rows (T,) long, offsets (T,) long."""
    from dapo_flow.models.packing import first_fit_bins

    lengths = [len(p) + len(r) for p, r in zip(prompt_ids, response_ids, strict=True)]
    if packed:
        capacity = max(lengths, default=1)
        bins = first_fit_bins(lengths, capacity)
        rows = torch.full((len(bins), capacity), -1, dtype=torch.long)
        offsets = torch.full_like(rows, -1)
        for b, members in enumerate(bins):
            at = 0
            for i in members:
                rows[b, at:at + lengths[i]] = i
                offsets[b, at:at + lengths[i]] = torch.arange(lengths[i])
                at += lengths[i]
        return rows.reshape(-1), offsets.reshape(-1)
    width_p = max(map(len, prompt_ids), default=0)
    width_r = max(1, max(map(len, response_ids), default=1))
    rows = torch.full((len(prompt_ids), width_p + width_r), -1, dtype=torch.long)
    offsets = torch.full_like(rows, -1)
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        rows[i, width_p - len(p):width_p + len(r)] = i
        offsets[i, width_p - len(p):width_p + len(r)] = torch.arange(len(p) + len(r))
    return rows.reshape(-1), offsets.reshape(-1)


# --- routing replay (R3) ------------------------------------------------------------------------


def flat_choices(routes: list[torch.Tensor], prompt_ids: list[list[int]], response_ids: list[list[int]],
                 packed: bool) -> torch.Tensor:
    """Each row's recorded expert choices (its prompt + response tokens', -1 where none was
    recorded) laid out as a forward over these rows sees its tokens (:func:`token_slots`), -1 at
    padding. A row may hold fewer records than tokens (the rest count as unrecorded).
    Shape: routes b x (n_i, L, k) long -> (T, L, k) long."""
    rows, offsets = token_slots(prompt_ids, response_ids, packed)
    layers, k = routes[0].shape[1:]
    flat = torch.full((rows.shape[0], layers, k), -1, dtype=torch.long)
    for i, route in enumerate(routes):
        at = torch.nonzero((rows == i) & (offsets < route.shape[0])).squeeze(1)  # (n,)
        flat[at] = route[offsets[at]].long()
    return flat


@contextmanager
def routing_recorded(routing: Routing, into: list[torch.Tensor] | None = None) -> Iterator[list[torch.Tensor]]:
    """Inside the block, every router's top-k expert indices are appended to the yielded list
    (``into``, or a new one) as its forward runs (layer order within a forward). Shape: each (T, k) long."""
    with _router_outputs(routing, lambda out: _router_output(out)[2].detach(),
                         into if into is not None else []) as seen:
        yield seen


@dataclass
class ReplayTally:
    """What a replayed forward's routers would have chosen themselves: of the recorded (token,
    layer, k) choices, how many their own top-k also holds (:func:`routing_agreement_counts`)."""

    agreed: float = 0.0
    recorded: float = 0.0

    @property
    def agreement(self) -> float:
        return self.agreed / self.recorded if self.recorded else 1.0


@contextmanager
def routing_replayed(routing: Routing, choices: torch.Tensor, tally: ReplayTally | None = None
                     ) -> Iterator[ReplayTally]:
    """Inside the block, one forward over ``choices``' tokens routes each token to its recorded
    experts (:func:`~dapo_flow.algos.moe.replayed_choices`) with gate weights recomputed from the
    router's current logits (:func:`~dapo_flow.algos.moe.replayed_gate_weights`, so gradients
    reach the router), and tallies the agreement of the router's own choices into the yielded
    :class:`ReplayTally` (once per layer and block). Not under gradient checkpointing: its
    backward recomputes the layers after the block is over (validate refuses the two). Shape: choices (T, L, k) long, -1 where a token keeps its own."""
    from dapo_flow.algos.moe import replayed_choices, replayed_gate_weights, routing_agreement_counts

    tally = tally if tally is not None else ReplayTally()
    tallied = [False] * len(routing.routers)

    def hook_of(layer: int, norm: bool):
        def replay(_module, _inputs, output):
            logits, _, own = _router_output(output)
            recorded = choices[:, layer].to(own.device)  # a no-op from the engine (hf moved them once)
            if recorded.shape != own.shape:
                raise ModelError(f"routing replay: the forward routes {tuple(own.shape)} (tokens, k) at layer "
                                 f"{layer} but {tuple(recorded.shape)} were recorded for it")
            if not tallied[layer]:
                agreed, total = routing_agreement_counts(own, recorded)
                tally.agreed, tally.recorded = tally.agreed + float(agreed), tally.recorded + float(total)
                tallied[layer] = True
            chosen = replayed_choices(own, recorded)
            return logits, replayed_gate_weights(logits, chosen, norm), chosen
        return replay

    # the router's own setting (HF's routers keep the config's norm_topk_prob), else the config's
    handles = [router.register_forward_hook(hook_of(i, bool(getattr(router, "norm_topk_prob", routing.norm_topk_prob))))
               for i, router in enumerate(routing.routers)]
    try:
        yield tally
    finally:
        for handle in handles:
            handle.remove()


def _router_output(output) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits (T, E), top-k weights (T, k), top-k indices (T, k)) of a router's forward: HF 5.x's
    top-k routers return them; an older router (a bare Linear's logits) cannot be replayed."""
    if not (isinstance(output, tuple) and len(output) == 3):
        raise ModelError("routing replay needs a top-k router that returns (logits, weights, indices), "
                         "as transformers 5's Qwen2/Qwen3-MoE routers do; this model's router returns "
                         f"{type(output).__name__}: set train.routing_replay: false")
    return output


class RouteLog:
    """The expert choices of one rollout batch's tokens, written as its forwards run
    (:func:`routing_recorded` feeds :attr:`seen`): the prefill of the left-padded prompts (fanned
    out to their ``n`` samples), each decode step's one fed token per sample, and a prefill
    recomputed over prompt + response so far after a weight change (which overwrites what the
    older weights chose). Both the prompt's and the response's choices are kept: the training
    forward runs over the whole sequence, and every response token attends to the prompt's keys
    and values, which past the first layer depend on how the prompt's tokens were routed."""

    def __init__(self, routing: Routing, n: int, max_tokens: int):
        self.routing, self.n, self.max_tokens = routing, n, max_tokens
        self.seen: list[torch.Tensor] = []
        # (S, P + max_tokens, L, k) int16, -1: not recorded; int16, not long: a large MoE's
        # record (48 layers x top-8) is then 768 bytes a token, on the rollout's device
        self.buf: torch.Tensor | None = None

    def write(self, rows: int, start: int) -> None:
        """The forward just run (its routers' choices in :attr:`seen`) fed ``rows`` rows of equal
        width from column ``start`` on: the sample rows, or (the first forward, the prefill) the
        prompt rows, fanned out to their n samples each."""
        layers = len(self.routing.routers)
        if len(self.seen) != layers:
            raise ModelError(f"routing replay: {len(self.seen)} router calls recorded in one forward "
                             f"of a model of {layers} MoE layers")
        choices = torch.stack(self.seen, dim=1)  # (T, L, k), T = rows x fed columns
        self.seen.clear()
        block = choices.reshape(rows, -1, layers, self.routing.top_k)  # (rows, fed, L, k)
        if self.buf is None:  # the prompts' prefill: P columns of each prompt's n sample rows
            self.buf = torch.full((rows * self.n, block.shape[1] + self.max_tokens, layers, self.routing.top_k),
                                  -1, dtype=torch.int16, device=choices.device)
        if rows != self.buf.shape[0]:
            block = block.repeat_interleave(self.buf.shape[0] // rows, 0)
        self.buf[:, start:start + block.shape[1]] = block.to(torch.int16)

    def rows(self, prompts: list[list[int]], lengths: list[int]) -> list:
        """Each sample's choices for its own prompt + response tokens (the prompt's ``n`` samples
        in a row). Shape: -> S x (len(prompt) + length, L, k) int16 numpy."""
        import numpy as np

        width = self.buf.shape[1] - self.max_tokens
        host = self.buf.cpu().numpy()
        return [host[s, width - len(prompts[s // self.n]):width + n] for s, n in enumerate(lengths)]
