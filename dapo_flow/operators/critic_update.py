"""critic-update: trains a PPO critic (a value model) to regress the returns, with verl's
clipped value loss.

loss = 0.5 * agg(max((V - R)^2, (clip(V, V_old - clip, V_old + clip) - R)^2)) over the response
tokens (``algos.value_loss``; verl ``compute_value_loss`` / ``dp_critic.update_critic``): V the
critic's new values, V_old the `values` column the batch was scored with, R the `returns` (GAE:
advantages + values). The critic's own AdamW, warm-up, epochs, mini-batches, micro-batches and
grad clip (a trainer of :mod:`dapo_flow.training`, as `update` has); checkpointed and resumed
with its model like the policy. Emits one row of ``critic/*`` metrics.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch
from pydantic import Field

from dapo_flow import algos
from dapo_flow.data.arrow_utils import ragged_to_padded, response_mask, token_lists
from dapo_flow.core import columns as C
from dapo_flow.core.contract import OpContext, TrainSizing
from dapo_flow.models.devices import host_floats
from dapo_flow.training import OptimizerParams, make_trainer
from dapo_flow.operators.update import metrics_row, step_rows

METRICS = (
    "critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm", "critic/lr",
    "critic/skipped_minibatches", "critic/skipped_steps", "critic/skipped_steps_total",
)


class Params(OptimizerParams):
    lr: float = Field(1e-5, gt=0.0, le=1.0)
    """AdamW learning rate (verl's critic default: 1e-5)."""
    clip: float = Field(0.5, ge=0.0)
    """Value clip: a new value counts at most this far from the old one where that loses less
    (verl's critic.cliprange_value, 0.5)."""


# each worker's share of the group's statistics: summed over the group
GROUP_SUMMED = ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean")


class CriticUpdate:
    """Trains the node's value model on the batch's returns (:class:`ValueLoss`, the node's
    trainer around it); emits one row of metrics."""

    Params = Params
    CARDINALITY = "sink"
    NEEDS_MODEL = True
    ROLE = "train"

    @classmethod
    def train_sizing(cls, params: Params) -> TrainSizing:
        return TrainSizing(params.mini_batches, params.micro_batch_size)  # a value loss: no entropy term
    MODEL_HEAD = "value"
    REQUIRES = C.typed(C.PROMPT_IDS, C.RESPONSE_IDS, C.VALUES, C.RETURNS)
    PRODUCES = {name: pa.float32() for name in METRICS}

    def __init__(self, params: Params, ctx: OpContext):
        self.params = params
        self.ctx = ctx
        self.policy = ctx.model.policy  # the value model
        self.trainer = make_trainer(self.policy, params, label=f"critic-update '{ctx.node_id}'", prefix="critic",
                                    metrics=METRICS, group_summed=GROUP_SUMMED, seed=ctx.seed,
                                    world_size=ctx.world_size,
                                    max_tokens_per_micro_batch=ctx.model.spec.train.max_tokens_per_micro_batch)

    def state_dict(self) -> dict:
        return self.trainer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.trainer.load_state_dict(state)

    def __call__(self, batch: pa.Table) -> pa.Table:
        data = self._arrays(batch)
        loss = ValueLoss(self.policy, self.params, data)
        return metrics_row(METRICS, self.trainer.step(step_rows(batch, data), loss))

    def _arrays(self, batch: pa.Table) -> dict:
        values, lengths = ragged_to_padded(batch.column(C.VALUES), dtype=np.float32)
        return {
            "prompts": token_lists(batch.column(C.PROMPT_IDS)),
            "responses": token_lists(batch.column(C.RESPONSE_IDS)),
            "values": values,
            "returns": ragged_to_padded(batch.column(C.RETURNS), dtype=np.float32)[0],
            "mask": response_mask(batch, lengths, values.shape[1]),  # not a tool's tokens
        }


class ValueLoss:
    """verl's clipped value loss over micro-batches of one step's rows (a
    :class:`dapo_flow.training.MicroLoss`)."""

    def __init__(self, policy, params: Params, data: dict):
        self.policy, self.params, self.data = policy, params, data

    def __call__(self, rows: np.ndarray, n_tokens: int, n_seqs: int) -> tuple[torch.Tensor, dict[str, float]]:
        p, data = self.params, self.data
        vpreds, resp_mask = self.policy.response_values(
            [data["prompts"][i] for i in rows], [data["responses"][i] for i in rows], grad=True)
        width = vpreds.shape[1]
        dev = self.policy.to_device({k: data[k][rows, :width] for k in ("mask", "returns", "values")})
        m = dev["mask"] & resp_mask
        loss, stats = algos.value_loss(
            vpreds, dev["returns"], dev["values"],
            m, clip=p.clip, agg=p.loss_agg_mode, num_tokens=n_tokens, num_seqs=n_seqs, norm_len=p.norm_len)
        host = host_floats({"loss": loss, "tokens": m.sum(),  # one transfer from the device
                            "vpred_sum": torch.where(m, vpreds.detach(), 0.0).sum()})
        return loss, {"critic/vf_loss": host["loss"],
                      "critic/vf_clipfrac": stats["vf_clipfrac"] * (host["tokens"] / n_tokens),
                      "critic/vpred_mean": host["vpred_sum"] / n_tokens}

    def zero_pass(self) -> None:
        eos = self.policy.eos_id
        values, _ = self.policy.response_values([[eos]], [[eos]], grad=True)
        (values.sum() * 0.0).backward()
