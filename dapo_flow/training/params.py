"""The optimisation settings every training operator takes (`update`, `critic-update`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_validator

from dapo_flow import algos
from dapo_flow.core.contract import PARAMS_CONFIG

LossAgg = Literal[algos.LOSS_AGG_MODES]  # type: ignore[valid-type]


class OptimizerParams(BaseModel):
    """The optimisation settings every training operator takes (`update`, `critic-update`)."""

    model_config = PARAMS_CONFIG

    lr: float = Field(1e-6, gt=0.0, le=1.0)
    """AdamW learning rate (DAPO: 1e-6 on 32B; the tiny default model wants ~1e-3)."""
    weight_decay: float = Field(0.0, ge=0.0, le=1.0)
    """AdamW weight decay (verl's DAPO recipe: 0.1)."""
    warmup_steps: int = Field(0, ge=0)
    """Linear lr warm-up over this many RL steps."""
    ppo_epochs: int = Field(1, ge=1, le=100)
    """Passes over the batch per RL step."""
    mini_batches: int = Field(1, ge=1, le=4096)
    """Optimizer steps per epoch (verl: train_batch_size / ppo_mini_batch_size)."""
    micro_batch_size: int = Field(64, ge=1, le=65536)
    """Rows per forward/backward pass (gradient accumulation inside a mini-batch), unless the
    model sets `train.max_tokens_per_micro_batch`."""
    shuffle: bool = False
    """Shuffle rows before splitting into mini-batches (seeded)."""
    loss_agg_mode: LossAgg = "token-mean"
    """How token losses become one number (DAPO: token-mean)."""
    norm_len: int | None = Field(None, ge=1)
    """Constant length for seq-mean-token-sum-norm (Dr.GRPO): set max response length."""
    grad_clip: float = Field(1.0, gt=0.0)
    """Max global grad norm."""
    max_nonfinite_steps: int = Field(3, ge=0, le=1_000_000)
    """Stop the run after this many optimizer steps in a row with a nan/inf gradient norm (each
    is skipped, so the run would train nothing); 0 never stops (they are only counted)."""
    max_empty_steps: int = Field(3, ge=0, le=1_000_000)
    """Stop the run after this many steps in a row with no token left to train on (every response
    masked: truncated under mask_truncated, or loss_mask false); 0 never stops."""

    @model_validator(mode="after")
    def _norm_len_for_drgrpo(self) -> "OptimizerParams":
        if self.loss_agg_mode == "seq-mean-token-sum-norm" and self.norm_len is None:
            raise ValueError("loss_agg_mode seq-mean-token-sum-norm needs norm_len (set it to max_tokens)")
        return self
