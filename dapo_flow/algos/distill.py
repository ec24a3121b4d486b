"""On-policy distillation: a frozen teacher's logprobs of the student's own samples as a
per-token advantage.

Thinking Machines, "On-Policy Distillation" (Lu et al., 2025): the student samples x, the
teacher scores each sampled token, and the per-token advantage is the negative reverse-KL
estimate on that token,

    A_t = -(log pi_student(x_t | x_<t) - log pi_teacher(x_t | x_<t)),

trained with the importance-sampled policy-gradient loss (no discount: each token's own term).
Its expectation over the student's sampling is -KL(pi_student || pi_teacher) per token, so
ascending it minimises the reverse KL, mode-seeking, on the states the student itself visits
(GKD, Agarwal et al. 2024, arXiv:2306.13649, with lambda = 1 and the reverse-KL divergence).
RL + distillation adds it, weighted, to an outcome advantage. Without gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dapo_flow.algos.errors import AlgoError
from dapo_flow.algos.masked import _as_bool, _check_pair


def distill_advantages(student_logp: Tensor, teacher_logp: Tensor, mask: Tensor,
                       clip: float | None = None) -> Tensor:
    """Per-token distillation advantage teacher_logp - student_logp (the negative per-token
    reverse-KL estimate, Thinking Machines 2025); 0 at mask-0 positions (padding, tool tokens).
    ``clip``: each advantage clamped to [-clip, clip], so a token the teacher all but rules out
    (logprob -19 from a sharp teacher) weighs as much as one it merely disfavours, not 19x an
    outcome advantage: the step size a sharp teacher allows is then the RL step's.

    ``student_logp`` are the student's logprobs of its sampled tokens at sampling time (the
    `old_logp` column), ``teacher_logp`` the teacher's of the same tokens.
    Shape: student_logp, teacher_logp, mask (batch, resp_len) -> (batch, resp_len), float32.
    """
    _check_pair(student_logp, teacher_logp, "student_logp", "teacher_logp")
    _check_pair(student_logp, mask, "student_logp", "mask")
    with torch.no_grad():
        valid = _as_bool(mask)
        diff = teacher_logp.detach().float() - student_logp.detach().float()
        if not torch.isfinite(diff[valid]).all():
            raise AlgoError("student_logp or teacher_logp contain NaN or inf at valid tokens")
        if clip is not None:
            diff = diff.clamp(-clip, clip)
        return torch.where(valid, diff, diff.new_zeros(()))


def reverse_kl_per_token(student_logp: Tensor, teacher_logp: Tensor, mask: Tensor) -> float:
    """Mean over valid tokens of log pi_student - log pi_teacher on the student's samples: the
    k1 estimate of KL(pi_student || pi_teacher) per token (0 when no token is valid).
    Shape: (batch, resp_len) each -> scalar."""
    valid = _as_bool(mask)
    n = int(valid.sum())
    return float(-distill_advantages(student_logp, teacher_logp, valid).sum() / n) if n else 0.0
