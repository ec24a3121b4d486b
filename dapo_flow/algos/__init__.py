"""Pure math of DAPO / GRPO, one module per concept; this package re-exports the public API
(``from dapo_flow import algos; algos.policy_loss(...)``):

- :mod:`~dapo_flow.algos.groups`: group ids -> dense codes, segment reductions, dynamic
  sampling's keep mask;
- :mod:`~dapo_flow.algos.advantages`: the estimator table :data:`ESTIMATORS`, per-sequence and
  token-level advantages (REINFORCE++);
- :mod:`~dapo_flow.algos.losses`: the clipped policy loss and loss aggregation;
- :mod:`~dapo_flow.algos.policy_losses`: the policy-loss family :data:`POLICY_LOSSES`
  (vanilla, gspo, cispo, gpg);
- :mod:`~dapo_flow.algos.value`: GAE, the clipped value loss, ReMax advantages;
- :mod:`~dapo_flow.algos.distill`: on-policy distillation's per-token advantage (the negative
  reverse KL to a teacher on the student's samples) and the forward KL on the teacher's top-K;
- :mod:`~dapo_flow.algos.kl`: KL estimators, KL in the reward, the adaptive coefficient;
- :mod:`~dapo_flow.algos.rollout_correction`: importance-sampling weights (TIS, IcePop) and
  rejection masks (k1/k2/k3, per token or sequence) for the rollout/trainer mismatch;
- :mod:`~dapo_flow.algos.logprobs`, :mod:`~dapo_flow.algos.masked`, :mod:`~dapo_flow.algos.shaping`,
  :mod:`~dapo_flow.algos.metrics`: token logprobs / entropy, masked statistics, overlong
  shaping, pass@k.

Semantics follow verl 0.9 (`verl/trainer/ppo/core_algos.py`, `verl/utils/torch_functional.py`,
`verl/workers/reward_manager/dapo.py`) to float32 precision, values and gradients (docs/semantics.md).
Deliberate improvements over verl:

- a group of >= 2 sequences whose scores are all exactly equal gets advantage exactly 0
  (verl's float32 group mean can be one ulp off and then yields noise of |adv| ~ 0.05);
- NaN/inf at masked positions never reaches a value or a gradient (``torch.where``, not ``x * mask``);
- bad input raises :class:`AlgoError` with the valid choices, instead of NaN or a bare assert.

Group statistics never loop over rows or groups in Python: ids are factorized once into dense
integer codes (:func:`factorize`), then every per-group quantity is a segment reduction
(``np.bincount``) on the small per-sequence vector. Only torch, numpy and polars are used
here: no Ray, Arrow or MLflow. (The fused numba kernels for token-level GRPO live with their
benchmark, benchmarks/token_kernels.py: no training path needs them, since `update` broadcasts
per-sequence advantages as a view.)
"""

from dapo_flow.algos.advantages import (
    ESTIMATORS,
    GRPO_EPS,
    SEQUENCE_ESTIMATORS,
    TOKEN_ESTIMATORS,
    Estimator,
    outcome_advantages,
    reinforce_pp_advantages,
    sequence_advantages,
)
from dapo_flow.algos.distill import distill_advantages, reverse_kl_per_token, topk_forward_kl
from dapo_flow.algos.errors import AlgoError
from dapo_flow.algos.groups import GroupIds, Groups, Segments, factorize, fill_from_group, keep_groups
from dapo_flow.algos.kl import KL_BASE_KINDS, KL_KINDS, adaptive_kl_coef, kl_in_reward, kl_penalty
from dapo_flow.algos.logprobs import entropy_from_logits, logprobs_from_logits, lowest_token_probability, vocab_logprobs
from dapo_flow.algos.losses import LOSS_AGG_MODES, agg_loss, policy_loss
from dapo_flow.algos.masked import masked_mean, masked_whiten
from dapo_flow.algos.metrics import pass_at_k
from dapo_flow.algos.policy_losses import POLICY_LOSSES
from dapo_flow.algos.rollout_correction import (
    ROLLOUT_IS_LEVELS,
    ROLLOUT_RS_OPTIONS,
    rollout_correction_weights,
    rollout_rejection_mask,
)
from dapo_flow.algos.shaping import overlong_penalty
from dapo_flow.algos.value import gae, remax_advantages, value_loss

__all__ = [
    "AlgoError", "ESTIMATORS", "Estimator", "GRPO_EPS", "GroupIds", "Groups", "Segments", "KL_BASE_KINDS", "KL_KINDS",
    "LOSS_AGG_MODES", "POLICY_LOSSES", "SEQUENCE_ESTIMATORS", "TOKEN_ESTIMATORS", "adaptive_kl_coef", "agg_loss",
    "distill_advantages", "entropy_from_logits", "factorize", "fill_from_group", "gae", "keep_groups", "kl_in_reward", "kl_penalty", "logprobs_from_logits",
    "lowest_token_probability", "masked_mean", "masked_whiten", "outcome_advantages", "overlong_penalty", "pass_at_k",
    "policy_loss", "ROLLOUT_IS_LEVELS", "ROLLOUT_RS_OPTIONS", "rollout_correction_weights", "rollout_rejection_mask",
    "reinforce_pp_advantages", "remax_advantages", "reverse_kl_per_token", "sequence_advantages", "topk_forward_kl",
    "value_loss", "vocab_logprobs",
]
