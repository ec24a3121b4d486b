"""logprob: recompute per-token logprobs of the responses with the actor or a frozen ref.

verl recomputes the old logprobs with the trainer's weights instead of trusting the
rollout engine's, so importance ratios start at exactly 1 on the first mini-batch.
Logits are divided by the sampling temperature first, as in verl.

`source: rollout` skips the forward pass and takes the generator's own sampled-token
logprobs (`rollout_logp`) as the old ones, as verl's rollout-correction bypass mode does.
When the generator is the trained policy itself (backend hf) those were computed by the same
weights at the same temperature, so they equal the recomputation up to float rounding (1e-6
in float32) and the pass (a fifth of the main job's step) is saved; with a separate engine
(vLLM) the update's importance ratio then also corrects the engine/trainer mismatch.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Literal

import numpy as np
import pyarrow as pa
from pydantic import BaseModel, Field, model_validator

from dapo_flow.core import columns as C
from dapo_flow.data.arrow_utils import padded_to_ragged, response_mask, token_lists, with_columns
from dapo_flow.core.contract import OpContext, PARAMS_CONFIG


class Params(BaseModel):
    model_config = PARAMS_CONFIG

    role: Literal["actor", "ref", "teacher"] = "actor"
    """`actor` writes old_logp (+ entropy); `ref` writes ref_logp for KL; `teacher` writes
    teacher_logp, a frozen teacher model's logprobs of the sampled tokens (on-policy distillation:
    the `advantage` node's distill_coef)."""
    temperature: float = Field(1.0, gt=0.0, le=10.0)
    """Divide logits by this before log-softmax; set it to generate's temperature."""
    micro_batch_size: int = Field(64, ge=1, le=65536)
    """Rows per forward pass."""
    with_entropy: bool = True
    """Actor only: also emit per-token entropy (logged as a metric); not with source rollout."""
    source: Literal["recompute", "rollout"] = "recompute"
    """Actor only. `recompute`: a forward pass of the trainer (verl's default). `rollout`: the
    generator's sampled-token logprobs are the old logprobs, no forward pass (exact up to float
    rounding when the generator is the trained policy, backend hf; see the module docstring)."""

    @model_validator(mode="after")
    def _rollout_source_is_the_actors(self) -> "Params":
        if self.source == "rollout" and self.role != "actor":
            raise ValueError("source rollout takes the generator's logprobs, which are the actor's, "
                             f"not a {self.role} model's: use source: recompute for role {self.role}")
        return self


_OUTPUT = {"actor": C.OLD_LOGP, "ref": C.REF_LOGP, "teacher": C.TEACHER_LOGP}  # the column each role writes


class Logprob:
    """Adds per-token logprobs of the response tokens."""

    Params = Params
    CARDINALITY = "map"
    NEEDS_MODEL = True
    ROLE = "logprob"

    @classmethod
    def forward_rows(cls, params: Params) -> int:
        return params.micro_batch_size

    @classmethod
    def uses_model(cls, params: Params) -> bool:
        """`source: rollout` copies the generator's column: no model, so the node runs in the
        driver (no round trip of the batch to the model's workers and back)."""
        return params.source != "rollout"

    @classmethod
    def upstream_problems(cls, params: Params, generator_id: str, generator_params) -> list:
        from dapo_flow.models.sampling import temperature_problems

        return temperature_problems(params.temperature, generator_id, generator_params.temperature)

    @classmethod
    def requires(cls, params: Params) -> dict[str, pa.DataType]:
        if params.source == "rollout":
            return C.typed(C.PROMPT_IDS, C.RESPONSE_IDS, C.ROLLOUT_LOGP)
        return C.typed(C.PROMPT_IDS, C.RESPONSE_IDS)

    @classmethod
    def produces(cls, params: Params) -> dict[str, pa.DataType]:
        if params.role != "actor":
            return C.typed(_OUTPUT[params.role])
        if params.with_entropy and params.source == "recompute":
            return C.typed(C.OLD_LOGP, C.ENTROPY)
        return C.typed(C.OLD_LOGP)

    def __init__(self, params: Params, ctx: OpContext):
        self.params = params
        self.ctx = ctx
        self._metrics: dict[str, float] = {}

    def __call__(self, batch: pa.Table) -> pa.Table:
        p = self.params
        if p.source == "rollout":  # the generator's logprobs, computed with these weights
            return with_columns(batch, {C.OLD_LOGP: batch.column(C.ROLLOUT_LOGP)})
        entropy_wanted = p.role == "actor" and p.with_entropy
        policy = self.ctx.model.policy
        # a reference on a LoRA-trained model reads its base: the adapters off, no second copy
        with policy.base_weights() if p.role == "ref" else nullcontext():
            logp, entropy, mask = policy.response_logprobs(
                token_lists(batch.column(C.PROMPT_IDS)),
                token_lists(batch.column(C.RESPONSE_IDS)),
                temperature=p.temperature,
                micro_batch_size=p.micro_batch_size,
                with_entropy=entropy_wanted,
            )
        lengths = mask.sum(dim=1).numpy()
        out = {_OUTPUT[p.role]: _ragged(logp, lengths)}
        if entropy_wanted:
            out[C.ENTROPY] = _ragged(entropy, lengths)
            valid = mask.numpy() & response_mask(batch, lengths, mask.shape[1])  # the model's tokens, not a tool's
            self._metrics = {"actor/entropy": float(entropy.numpy()[valid].mean()) if valid.any() else 0.0}
        return with_columns(batch, out)

    def last_metrics(self) -> dict[str, float]:
        return dict(self._metrics)


def _ragged(values, lengths: np.ndarray) -> pa.ListArray:
    return padded_to_ragged(values.float().numpy(), lengths, C.TOKEN_FLOATS)
