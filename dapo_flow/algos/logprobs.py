"""Token logprobs and entropy from logits (the trainer's and the update's one implementation)."""

from __future__ import annotations

import torch
from torch import Tensor

from dapo_flow.algos.errors import AlgoError

_LOGSUMEXP_CHUNK = 1 << 24  # elements per logsumexp chunk: bounds the exp() temporary to 64 MiB


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Categorical entropy, verl_F.entropy_from_logits: logsumexp(z) - sum(softmax(z) * z).
    Shape: (..., vocab) -> (...)."""
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - torch.sum(probs * logits, dim=-1)


def logprobs_from_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """log softmax(logits)[label] as gather minus logsumexp, never materialising log_softmax.

    logsumexp runs in row chunks (its exp temporary stays <= 64 MiB) and in float32 for
    bf16/fp16 logits (verl falls back to log_softmax there for stability); the result is then
    float32. Shape: logits (..., vocab), labels (...) int -> (...).
    """
    if labels.shape != logits.shape[:-1]:
        raise AlgoError(f"labels shape {tuple(labels.shape)} != logits shape[:-1] {tuple(logits.shape[:-1])}")
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    acc = logits.dtype if logits.dtype in (torch.float32, torch.float64) else torch.float32
    picked = flat.gather(-1, labels.reshape(-1, 1).long()).squeeze(-1).to(acc)
    rows = max(1, _LOGSUMEXP_CHUNK // max(vocab, 1))
    if flat.shape[0] <= rows:
        lse = torch.logsumexp(flat.to(acc), dim=-1)
    else:
        lse = torch.cat([torch.logsumexp(c.to(acc), dim=-1) for c in flat.split(rows)])
    return (picked - lse).reshape(labels.shape)


