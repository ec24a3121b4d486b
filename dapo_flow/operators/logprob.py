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

With routing replay (the model's ``train.routing_replay``, rows carrying ``routed_experts``) an
actor's recomputation routes every token to the experts the rollout chose (R3), and reports
``rollout/routing_agreement`` (the share of those choices the trainer's router makes itself) and the
logprob mismatch with the rollout, ``rollout/logp_mismatch`` (mean |old_logp - rollout_logp|,
replayed) and ``rollout/logp_mismatch_unreplayed`` (the same of a second forward that routes on its
own: what replay removed; `replay_metrics: false` saves that forward). Without replay
``rollout/logp_mismatch`` is reported whenever the rows carry ``rollout_logp``.

A teacher's node with ``top_k: K`` also writes, per response position, the teacher's K most
likely token ids and their logprobs (``teacher_topk_ids``, ``teacher_topk_logp``): what the
`update` node's ``distill_topk_coef`` trains the student towards (the forward KL on the
teacher's top-K, GKD; algos/distill.py), from the same forward pass.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Literal

import numpy as np
import pyarrow as pa
from pydantic import BaseModel, Field, model_validator

from dapo_flow.core import columns as C
from dapo_flow.data.arrow_utils import (padded_to_ragged, ragged_to_padded, response_mask, routes_from_arrow,
                                        token_lists, topk_to_ragged, with_columns)
from dapo_flow.core.contract import OpContext, PARAMS_CONFIG
from dapo_flow.errors import ModelError


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
    replay_metrics: bool = True
    """Actor recomputation under routing replay: also run the forward without replay, to report
    the logprob mismatch replay removes (``rollout/logp_mismatch_unreplayed``; one more forward)."""
    top_k: int = Field(0, ge=0, le=4096)
    """Teacher only: also write the teacher's top_k most likely token ids and their logprobs at
    every response position (teacher_topk_ids, teacher_topk_logp), for the `update` node's
    distill_topk_coef (forward KL on the teacher's top-K). 0: off."""

    @model_validator(mode="after")
    def _rollout_source_is_the_actors(self) -> "Params":
        if self.source == "rollout" and self.role != "actor":
            raise ValueError("source rollout takes the generator's logprobs, which are the actor's, "
                             f"not a {self.role} model's: use source: recompute for role {self.role}")
        if self.top_k and self.role != "teacher":
            raise ValueError(f"top_k writes a teacher's top-K logprobs (distillation), but role is {self.role}: "
                             "set role: teacher on the teacher's node, or remove top_k")
        return self


_OUTPUT = {"actor": C.OLD_LOGP, "ref": C.REF_LOGP, "teacher": C.TEACHER_LOGP}  # the column each role writes


class Logprob:
    """Adds per-token logprobs of the response tokens."""

    Params = Params
    CARDINALITY = "map"
    NEEDS_MODEL = True
    ROLE = "logprob"
    SCOPE = "row"  # each row's logprobs are its own (source rollout: a copy, run on any share)
    PARAM_EXAMPLES = ({"role": "teacher", "top_k": 8},)  # validate's hint for the top-K columns

    @classmethod
    def forward_rows(cls, params: Params) -> int:
        return params.micro_batch_size

    @classmethod
    def logprob_role(cls, params: Params) -> str:
        return params.role

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
            topk = (C.TEACHER_TOPK_IDS, C.TEACHER_TOPK_LOGP) if params.top_k else ()
            return C.typed(_OUTPUT[params.role], *topk)
        if params.with_entropy and params.source == "recompute":
            return C.typed(C.OLD_LOGP, C.ENTROPY)
        return C.typed(C.OLD_LOGP)

    def __init__(self, params: Params, ctx: OpContext):
        self.params = params
        self.ctx = ctx
        self._metrics: dict[str, float] = {}
        model = ctx.model
        if model is not None and model.policy is None and params.source == "recompute" and params.temperature != 1.0:
            # served by its engine alone (Plan.engine_scored): told before the first step, not at it
            raise ModelError(f"logprob '{ctx.node_id}': model '{model.name}' is scored by its {model.spec.backend} "
                             f"engine, whose prompt logprobs are at temperature 1, not {params.temperature:g}: set "
                             f"temperature: 1.0 on this node, or backend: hf on model '{model.name}'")

    def __call__(self, batch: pa.Table) -> pa.Table:
        p = self.params
        if p.source == "rollout":  # the generator's logprobs, computed with these weights
            return with_columns(batch, {C.OLD_LOGP: batch.column(C.ROLLOUT_LOGP)})
        from dapo_flow.models.moe import ReplayTally

        entropy_wanted = p.role == "actor" and p.with_entropy
        policy = self.ctx.model.policy
        prompts, responses = token_lists(batch.column(C.PROMPT_IDS)), token_lists(batch.column(C.RESPONSE_IDS))
        # a teacher's top-1 always (distill/teacher_agreement), its top-K columns when asked
        top_k = max(p.top_k, 1) if p.role == "teacher" else p.top_k
        if policy is None:  # a frozen model served by its engine alone (Plan.engine_scored): no torch copy
            logp, entropy, mask, *topk = self.ctx.model.generator.score(prompts, responses, temperature=p.temperature,
                                                                        top_k=top_k)
            routes = tally = None
        else:
            routes, tally = self._routes(batch, policy), ReplayTally()
            # a reference on a LoRA-trained model reads its base: the adapters off, no second copy
            with policy.base_weights() if p.role == "ref" else nullcontext():
                logp, entropy, mask, *topk = policy.response_logprobs(
                    prompts, responses, temperature=p.temperature, micro_batch_size=p.micro_batch_size,
                    with_entropy=entropy_wanted, **({"routes": routes, "tally": tally} if routes is not None else {}),
                    **({"top_k": top_k} if top_k else {}))
        lengths = mask.sum(dim=1).numpy()
        out = self._columns(logp, lengths, topk if p.top_k else [])
        self._metrics = {}
        if entropy_wanted or p.role == "teacher":  # over the model's tokens, not a tool's
            valid = mask.numpy() & response_mask(batch, lengths, mask.shape[1])
        if entropy_wanted:
            out[C.ENTROPY] = _ragged(entropy, lengths)
            self._metrics = {"actor/entropy": float(entropy.numpy()[valid].mean()) if valid.any() else 0.0}
        if p.role == "teacher":
            self._metrics = {"distill/teacher_agreement": _top1_agreement(topk[0][0], responses, valid)}
        if p.role == "actor" and C.ROLLOUT_LOGP in batch.column_names:
            self._metrics.update(self._mismatch(batch, logp, mask, routes, tally, prompts, responses, policy))
        return with_columns(batch, out)

    def _columns(self, logp, lengths: np.ndarray, topk: list) -> dict:
        """The role's logprob column, and the teacher's top-K ones when asked (``topk``: [(ids,
        logp)] of (B, R, K) each, or []). Shape: logp (B, R), lengths (B,)."""
        out = {_OUTPUT[self.params.role]: _ragged(logp, lengths)}
        if topk:  # (B, R, K) each: the teacher's top-K of every response position
            ids, top_logp = topk[0]
            out[C.TEACHER_TOPK_IDS] = topk_to_ragged(ids.int().numpy(), lengths, C.TOKEN_TOPK_IDS)
            out[C.TEACHER_TOPK_LOGP] = topk_to_ragged(top_logp.float().numpy(), lengths, C.TOKEN_TOPK_FLOATS)
        return out

    def _routes(self, batch: pa.Table, policy) -> list | None:
        """The rollout's expert choices to replay: an actor's recomputation on a model trained
        with routing replay, whose rows carry them; else None."""
        spec = getattr(self.ctx.model, "spec", None)
        if (self.params.role != "actor" or spec is None or not spec.train.routing_replay
                or C.ROUTED_EXPERTS not in batch.column_names or policy.routing is None):
            return None
        routing = policy.routing
        return routes_from_arrow(batch.column(C.ROUTED_EXPERTS), len(routing.routers), routing.top_k)

    def _mismatch(self, batch: pa.Table, logp, mask, routes, tally, prompts, responses, policy) -> dict[str, float]:
        """Mean |old_logp - rollout_logp| over the response tokens; under replay also the routers'
        agreement with the rollout and (``replay_metrics``) the mismatch of an unreplayed forward."""
        import torch

        from dapo_flow.algos.moe import logprob_mismatch_sum

        rollout = torch.from_numpy(ragged_to_padded(batch.column(C.ROLLOUT_LOGP), dtype=np.float32)[0])
        width = min(rollout.shape[1], logp.shape[1])
        m = mask[:, :width]
        count = max(float(m.sum()), 1.0)

        def mean_gap(values) -> float:
            return float(logprob_mismatch_sum(values[:, :width], rollout[:, :width], m)) / count

        metrics = {"rollout/logp_mismatch": mean_gap(logp)}
        if routes is not None:
            metrics["rollout/routing_agreement"] = tally.agreement
            if self.params.replay_metrics:
                own = policy.response_logprobs(prompts, responses, temperature=self.params.temperature,
                                               micro_batch_size=self.params.micro_batch_size)[0]
                metrics["rollout/logp_mismatch_unreplayed"] = mean_gap(own)
        return metrics

    def last_metrics(self) -> dict[str, float]:
        return dict(self._metrics)


def _ragged(values, lengths: np.ndarray) -> pa.ListArray:
    return padded_to_ragged(values.float().numpy(), lengths, C.TOKEN_FLOATS)


def _top1_agreement(top_ids, responses: list[list[int]], valid: np.ndarray) -> float:
    """The share of the sampled tokens (the student's, at ``valid`` positions) that are the
    teacher's most likely token there (0 without any). Shape: top_ids (B, R, K), valid (B, R)."""
    top1 = top_ids[..., 0].numpy()
    sampled = np.zeros_like(top1)
    for i, r in enumerate(responses):
        sampled[i, :len(r)] = r
    return float((top1 == sampled)[valid].mean()) if valid.any() else 0.0
