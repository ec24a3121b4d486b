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
