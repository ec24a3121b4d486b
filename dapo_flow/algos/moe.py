"""Mixture-of-experts router math: the load-balancing loss per sequence, expert loads, router entropy.

The load-balancing loss is Switch Transformer's (Fedus et al. 2021, eqs. 4-6) as Hugging Face's
``load_balancing_loss_func`` computes it for Qwen2/Qwen3-MoE: with f_e the fraction of top-k
assignments that go to expert e and P_e the mean router probability of e, both pooled over the
layers, ``E * sum_e f_e * P_e`` (k at perfect balance, k * E when one expert gets everything).
HF pools f and P over the whole batch; here they are pooled over each sequence's tokens and the
sequences' losses are averaged (the "sequence-wise" balance loss of DeepSeek-V3, eq. 17-20):
a sum over rows, so micro-batches and a training group's workers add their shares up to the
mini-batch's value exactly, as every other term of the policy loss does.
"""

from __future__ import annotations

import torch
from torch import Tensor


def routing_counts(router_logits: list[Tensor], rows: Tensor, num_rows: int, top_k: int
                   ) -> tuple[Tensor, Tensor, Tensor]:
    """Per row, pooled over the layers: how many top-k assignments went to each expert, the sum
    of the router probabilities of each expert, and how many (token, layer) pairs were routed.
    ``rows``: the row of each flat token position, -1 at padding (not counted).
    Shape: router_logits L x (T, E); rows (T,) long -> counts (b, E), prob_sums (b, E), tokens (b,)."""
    num_experts = router_logits[0].shape[-1]
    real = rows >= 0
    where = rows[real]
    counts = router_logits[0].new_zeros(num_rows, num_experts, dtype=torch.float32)
    prob_sums = torch.zeros_like(counts)
    for logits in router_logits:
        probs = torch.softmax(logits[real].float(), dim=-1)  # (N, E)
        picked = torch.zeros_like(probs).scatter_(1, torch.topk(probs, top_k, dim=-1).indices, 1.0)
        counts = counts.index_add(0, where, picked)
        prob_sums = prob_sums.index_add(0, where, probs)
    tokens = torch.bincount(where, minlength=num_rows).to(counts) * len(router_logits)
    return counts, prob_sums, tokens


def sequence_balance_loss(counts: Tensor, prob_sums: Tensor, tokens: Tensor) -> Tensor:
    """Each row's load-balancing loss ``E * sum_e f_e * P_e`` (f_e = counts / tokens, P_e =
    prob_sums / tokens: HF's value for that row alone); 0 for a row with no tokens. Gradient
    through P only (f is a count, as in HF). Shape: (b, E), (b, E), (b,) -> (b,)."""
    num_experts = counts.shape[-1]
    per_token = tokens.clamp(min=1.0)[:, None]
    return num_experts * ((counts / per_token) * (prob_sums / per_token)).sum(-1)


def router_entropy_sum(router_logits: list[Tensor], rows: Tensor) -> Tensor:
    """The summed entropy (nats) of the router's distribution over the real tokens of every layer
    (divide by the routed (token, layer) count for the mean). Shape: L x (T, E), (T,) -> ()."""
    real = rows >= 0
    total = router_logits[0].new_zeros((), dtype=torch.float32)
    for logits in router_logits:
        logp = torch.log_softmax(logits[real].float(), dim=-1)
        total = total - (logp.exp() * logp).sum()
    return total


def load_fractions(counts: Tensor) -> Tensor:
    """Each expert's share of all top-k assignments (sums to 1; 1/E each at perfect balance).
    Shape: (..., E) summed over the leading dims -> (E,)."""
    per_expert = counts.reshape(-1, counts.shape[-1]).sum(0)
    return per_expert / per_expert.sum().clamp(min=1.0)


# --- routing replay (R3) ------------------------------------------------------------------------
# The rollout records each token's top-k experts per layer; the training forward routes every
# token to the recorded experts instead of its own top-k, so a token meets the experts that
# produced its sampled logprob. -1 in a recorded choice means "not recorded" (a padding position,
# the last sampled token, which no forward of the rollout ever fed): that token keeps its own.


def replayed_choices(own: Tensor, recorded: Tensor) -> Tensor:
    """The experts each token is sent to: the recorded ones where a token has a record (its row
    holds no -1), its own top-k elsewhere. Shape: own (T, k) long, recorded (T, k) long -> (T, k)."""
    has_record = (recorded >= 0).all(-1, keepdim=True)  # (T, 1): a record is all k experts or none
    return torch.where(has_record, recorded, own)


def replayed_gate_weights(router_logits: Tensor, choices: Tensor, norm_topk_prob: bool) -> Tensor:
    """The gate weights of ``choices`` as the model's router computes its own top-k's: softmax of
    the logits (float32), the chosen experts' probabilities, renormalised to sum to 1 when the
    config says so (``norm_topk_prob``), in the logits' dtype. A differentiable function of the
    logits, so the policy loss still trains the router through the weights. Replaying a token's
    own top-k gives its own weights bit for bit (the same ops on the same values, in top-k order).
    Shape: router_logits (T, E), choices (T, k) long -> (T, k)."""
    probs = torch.softmax(router_logits, dtype=torch.float, dim=-1)
    weights = probs.gather(-1, choices)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype)


def routing_agreement_counts(own: Tensor, recorded: Tensor) -> tuple[Tensor, Tensor]:
    """How many of the recorded (token, k) choices the router's own top-k also makes (as sets per
    token: the order within the top-k changes no output), and how many recorded choices there
    are; tokens without a record count in neither. Shape: own (T, k), recorded (T, k) -> (), ()."""
    has_record = (recorded >= 0).all(-1)  # (T,)
    rec, mine = recorded[has_record], own[has_record]  # (N, k)
    matched = (rec[:, :, None] == mine[:, None, :]).any(-1)  # (N, k): recorded expert among own top-k
    return matched.sum(), torch.tensor(rec.numel(), device=own.device)


def logprob_mismatch_sum(a: Tensor, b: Tensor, mask: Tensor) -> Tensor:
    """Sum of |a - b| over the masked tokens (divide by ``mask.sum()`` for the mean): how far the
    trainer's logprobs of the sampled tokens are from the rollout's. Shape: (b, R) x3 -> ()."""
    return ((a.float() - b.float()).abs() * mask).sum()
