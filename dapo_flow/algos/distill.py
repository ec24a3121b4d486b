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

:func:`topk_forward_kl` is the other direction, as a loss with gradient: GKD's forward KL
KL(pi_teacher || pi_student) on the student's own samples (Agarwal et al. 2024, lambda = 1,
beta = 0 of TRL's ``generalized_jsd_loss``), summed over the teacher's top-K tokens at each
position instead of the whole vocabulary, so a row carries K ids and logprobs per token, not a
vocabulary's worth.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dapo_flow.algos.errors import AlgoError
from dapo_flow.algos.masked import _as_bool, _check_pair


def topk_forward_kl(student_logp: Tensor, teacher_logp: Tensor, mask: Tensor) -> Tensor:
    """Per token, the forward KL from the teacher restricted to its top-K tokens,

        sum_k p_T(k) (log p_T(k) - log p_S(k)),  p_T(k) = exp(teacher_logp[..., k]),

    with the teacher's probabilities NOT renormalised over the K tokens: each term is exactly
    the full-vocabulary forward KL's term for that token (GKD, Agarwal et al. 2024,
    arXiv:2306.13649, eq. 1 with D = KL(p_T || p_S); TRL's ``generalized_jsd_loss`` with
    beta = 0 sums the same terms over the whole vocabulary), so with K = vocab it is the full
    forward KL, and with K < vocab the teacher's left-out mass (the tail) simply gets no term
    (nothing is up-weighted, unlike renormalising, which scales the top-K by 1 / their mass).
    Its gradient in the student is -sum_k p_T(k) grad log p_S(k): a cross-entropy on the
    teacher's top-K, weighted by the teacher. The value is therefore not bounded below by 0
    for K < vocab. 0 at mask-0 positions (padding, tool tokens), whatever they hold.

    ``student_logp``: the student's log-probabilities at the teacher's top-K ids (with
    gradient); ``teacher_logp``: the teacher's at the same ids (no gradient flows into it).
    Shape: student_logp, teacher_logp (batch, resp_len, K), mask (batch, resp_len)
    -> (batch, resp_len), float32.
    """
    if student_logp.shape != teacher_logp.shape or student_logp.dim() != 3:
        raise AlgoError(f"student_logp {tuple(student_logp.shape)} and teacher_logp {tuple(teacher_logp.shape)} "
                        "must both be (batch, resp_len, K)")
    if tuple(mask.shape) != tuple(student_logp.shape[:2]):
        raise AlgoError(f"mask {tuple(mask.shape)} must be (batch, resp_len) = {tuple(student_logp.shape[:2])}")
    valid = _as_bool(mask)
    teacher = teacher_logp.detach().float()
    if not (torch.isfinite(teacher) | ~valid[..., None]).all():  # no boolean indexing: no device sync for a shape
        raise AlgoError("teacher_logp contains NaN or inf at valid tokens")
    # padding may hold anything: zero it before exp and the products, so no NaN reaches the gradient
    teacher = torch.where(valid[..., None], teacher, teacher.new_zeros(()))
    student = torch.where(valid[..., None], student_logp.float(), student_logp.new_zeros((), dtype=torch.float32))
    fkl = (teacher.exp() * (teacher - student)).sum(-1)
    return torch.where(valid, fkl, fkl.new_zeros(()))


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
