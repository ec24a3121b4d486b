"""update: PPO-style policy update with DAPO's clip-higher, dual clip and loss aggregation.

ppo_epochs passes over `mini_batches` mini-batches; each mini-batch is one optimizer
step, accumulated over micro-batches whose losses are partial sums of the mini-batch
loss (verl's token-count semantics: token-mean divides by the mini-batch token count).
AdamW with linear warm-up, weight decay and grad-norm clipping; optional KL loss against
ref logprobs, entropy bonus, and overlong filtering (mask truncated responses).
Returns a one-row table of metrics.

An optimizer step whose gradient norm is nan or inf is skipped (counted in
``actor/skipped_steps``); `max_nonfinite_steps` of them in a row stop the run with a RunError,
since from then on training would silently do nothing. So do `max_empty_steps` steps in a row
whose every response is masked out (``actor/skipped_minibatches`` counts such mini-batches).
"""

from __future__ import annotations

import warnings
from typing import Literal

import numpy as np
import pyarrow as pa
import torch
from pydantic import BaseModel, Field, model_validator

from dapo_flow import algos
from dapo_flow.algos.balance import balanced_partitions, token_budget_micro_batches
from dapo_flow.graph import columns as C
from dapo_flow.data.arrow_utils import ragged_to_padded, response_mask, token_lists
from dapo_flow.graph.contract import OpContext, PARAMS_CONFIG
from dapo_flow.errors import RunError
from dapo_flow.models.devices import host_floats, to_host

LossAgg = Literal[algos.LOSS_AGG_MODES]  # type: ignore[valid-type]
KLType = Literal[algos.KL_KINDS]  # type: ignore[valid-type]


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


class Params(OptimizerParams):
    clip_low: float = Field(0.2, ge=0.0, lt=1.0)
    """Lower ratio clip: r >= 1 - clip_low."""
    clip_high: float = Field(0.28, ge=0.0, le=10.0)
    """Upper ratio clip (DAPO clip-higher: 0.28)."""
    clip_c: float | None = Field(10.0, gt=1.0)
    """Dual-clip constant for negative advantages; null disables it. vanilla only (the default
    is not applied to another policy_loss; setting it with one is an error)."""
    policy_loss: Literal["vanilla", "gspo", "cispo", "gpg"] = "vanilla"
    """Policy-gradient loss (verl's actor.policy_loss.loss_mode; docs/semantics.md, "Policy-loss
    family"): `vanilla`: PPO clipped surrogate with clip-higher and dual clip (DAPO); `gspo`: the
    same clip on a sequence-level ratio, the geometric mean of the token ratios (GSPO; its clip
    ranges are ~1e-4 scale, verl's example 3e-4 / 4e-4); `cispo`: REINFORCE weighted by the clipped
    token ratio under stop-gradient, so clipped tokens still get a gradient (MiniMax-M1); `gpg`:
    plain -A * logp, no ratio, no clip (GPG). All aggregate with loss_agg_mode."""
    kl_coef: float = Field(0.0, ge=0.0)
    """KL loss coefficient against ref_logp (0 = no KL; DAPO uses none)."""
    kl_type: KLType = "low_var_kl"
    """KL estimator for the loss term."""
    entropy_coef: float = Field(0.0, ge=0.0)
    """Entropy bonus coefficient."""
    mask_truncated: bool = False
    """Overlong filtering: truncated responses get no loss (DAPO paper, TRL's mask_truncated_completions)."""
    advantage_column: Literal["auto", "advantage", "token_advantage"] = "auto"
    """Advantages to train on: per sequence (`advantage`, broadcast over the response tokens) or
    per token (`token_advantage`, from a token-level estimator such as reinforce_pp); `auto`:
    whichever reaches this node (resolved when the graph compiles)."""
    loss_mask: Literal["auto", "use", "ignore"] = "auto"
    """Per-token `loss_mask` column (from `agent-generate`: 0 on tool tokens; from an
    `overlong-filter` node: 0 on a truncated row): `use` it (0 tokens get no loss), `ignore` it
    (trains on a tool's tokens too), or `auto`: use it when an upstream node produces it."""
    temperature: float = Field(1.0, gt=0.0, le=10.0)
    """Divide logits by this (set it to generate's temperature)."""
    critic_warmup: int = Field(0, ge=0)
    """Leave the policy as it is for the first this many RL steps, while a critic learns the
    values its advantages come from (verl's trainer.critic_warmup)."""

    @model_validator(mode="after")
    def _dual_clip_is_vanilla_only(self) -> "Params":
        if self.policy_loss != "vanilla" and self.clip_c is not None and "clip_c" in self.model_fields_set:
            raise ValueError(
                f"clip_c (dual clip) applies to policy_loss vanilla only, but policy_loss is "
                f"{self.policy_loss} and clip_c is set to {self.clip_c}: set clip_c: null or remove it")
        return self


METRICS = (
    "actor/pg_loss", "actor/clipfrac", "actor/clipfrac_lower", "actor/ppo_kl", "actor/grad_norm",
    "actor/entropy", "actor/lr", "actor/kl_loss", "actor/skipped_minibatches",
    "actor/skipped_steps", "actor/skipped_steps_total",
)
# statistics each worker of a group computes for its share of a mini-batch (already divided by
# the group's token count): the group's value is their sum
GROUP_SUMMED = ("actor/pg_loss", "actor/entropy", "actor/clipfrac", "actor/clipfrac_lower",
                "actor/ppo_kl", "actor/kl_loss")


class Optimization:
    """What every training operator does around its loss: AdamW with linear warm-up over RL
    steps, ``ppo_epochs`` passes over ``mini_batches`` optimizer steps cut as one worker cuts
    them (also in a training group), micro-batches whose losses are partial sums of the
    mini-batch's, grad-norm clipping, skipped nan/inf steps and the counters that stop a run
    training nothing, checkpointable state. A subclass says which columns it reads
    (:meth:`_arrays`) and what one micro-batch's loss is (:meth:`_micro_loss`); its metrics are
    ``METRICS``, named ``PREFIX/...``."""

    CARDINALITY = "sink"
    NEEDS_MODEL = True
    ROLE = "train"
    OP = "update"  # the op's name, in messages
    PREFIX = "actor"
    METRICS: tuple[str, ...] = ()
    GROUP_SUMMED: tuple[str, ...] = ()

    def __init__(self, params: OptimizerParams, ctx: OpContext):
        self.params = params
        self.ctx = ctx
        self.policy = ctx.model.policy  # stays in eval mode: no dropout in RL (HFPolicy)
        self.optimizer = torch.optim.AdamW(
            self.policy.model.parameters(), lr=params.lr, weight_decay=params.weight_decay
        )
        self.steps_done = 0
        self.nonfinite_in_a_row = 0  # optimizer steps skipped for a nan/inf grad norm, in a row
        self.skipped_total = 0  # all optimizer steps skipped so far, for PREFIX/skipped_steps_total
        self.empty_in_a_row = 0  # steps in a row with every response masked out
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)

    def _key(self, name: str) -> str:
        return f"{self.PREFIX}/{name}"

    def _lr_factor(self, step: int) -> float:
        w = self.params.warmup_steps
        return min(1.0, (step + 1) / w) if w else 1.0

    def state_dict(self) -> dict:
        """Counters and the scheduler; the optimizer too unless the model is sharded (a training
        group checkpoints its optimizer state with the weights, shard by shard)."""
        state = {
            "scheduler": self.scheduler.state_dict(),
            "steps_done": self.steps_done,
            "nonfinite_in_a_row": self.nonfinite_in_a_row,
            "skipped_total": self.skipped_total,
            "empty_in_a_row": self.empty_in_a_row,
        }
        if not self.policy.sharded:  # on the host: the driver and the disk may have no device
            state["optimizer"] = to_host(self.optimizer.state_dict())
        return state

    def load_state_dict(self, state: dict) -> None:
        if "optimizer" in state and self.policy.sharded:  # a one-worker run resumed by a group
            from dapo_flow.models import fsdp

            fsdp.load_full_optimizer_state(self.policy.model, self.optimizer, state["optimizer"])
        elif "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.steps_done = int(state["steps_done"])
        self.nonfinite_in_a_row = int(state.get("nonfinite_in_a_row", 0))  # older checkpoints lack it
        self.skipped_total = int(state.get("skipped_total", 0))
        self.empty_in_a_row = int(state.get("empty_in_a_row", 0))

    def __call__(self, batch: pa.Table) -> pa.Table:
        total_rows = int(self._group_sum([batch.num_rows])[0])
        if total_rows == 0:
            raise algos.AlgoError(
                f"{self.OP} '{self.ctx.node_id}' got an empty batch: a node between the group-filter "
                "(or generate) and this node dropped every row. Fix: let that node keep rows, or "
                "move it before the group-filter so dynamic sampling refills the batch")
        data = self._arrays(batch)
        mask = data["mask"]
        rng = np.random.default_rng([self.ctx.seed, self.steps_done])
        positions = self._batch_positions(batch)
        sums: dict[str, float] = {name: 0.0 for name in self.METRICS}
        n_opt_steps = 0
        for _epoch in range(self.params.ppo_epochs):
            for mb in self._mini_batches(rng, positions, batch.num_rows, total_rows):
                n_tokens, n_seqs = (int(x) for x in self._group_sum([mask[mb].sum(), len(mb)]))
                if n_tokens == 0:  # e.g. every response truncated under overlong filtering
                    sums[self._key("skipped_minibatches")] += 1
                    continue
                stats = self._minibatch(mb, data, n_tokens, n_seqs)
                for key, value in stats.items():
                    sums[key] += value
                n_opt_steps += 1
                self._count_nonfinite(stats)
        self._count_empty(trained_tokens=n_opt_steps > 0)
        with warnings.catch_warnings():  # warm-up follows RL steps, also when no optimizer step ran
            warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler\.step\(\)`", UserWarning)
            self.scheduler.step()
        self.steps_done += 1
        out = {k: v / max(n_opt_steps, 1) for k, v in sums.items()}
        counts = (self._key("skipped_minibatches"), self._key("skipped_steps"))  # sums, not means
        out.update({k: sums[k] for k in counts})
        out[self._key("skipped_steps_total")] = float(self.skipped_total)
        out[self._key("lr")] = self.optimizer.param_groups[0]["lr"]
        return self._metrics_row(out)

    def _metrics_row(self, values: dict[str, float]) -> pa.Table:
        return pa.table({k: pa.array([values.get(k, 0.0)], pa.float32()) for k in self.METRICS})

    def _arrays(self, batch: pa.Table) -> dict:
        """What the loss reads, per row of ``batch``: at least ``prompts`` and ``responses``
        (token lists) and ``mask`` ((rows, width) bool: the tokens that take part in the loss)."""
        raise NotImplementedError

    def _micro_loss(self, rows: np.ndarray, data: dict, n_tokens: int, n_seqs: int
                    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The loss of micro-batch ``rows`` as its part of the mini-batch's (``n_tokens`` /
        ``n_seqs`` count the whole mini-batch over the group), and its statistics (shares of the
        mini-batch's: they are added up)."""
        raise NotImplementedError

    def _zero_loss_pass(self) -> None:
        """A forward/backward of one token with zero loss (see :meth:`_empty_pass`)."""
        raise NotImplementedError

    def _batch_positions(self, batch: pa.Table) -> np.ndarray | None:
        """Each local row's position in the whole batch the group trains on (rows of a filter
        before this update in the chain closed up, as one worker would see them); ``None`` in a
        group whose rows came without their ``batch_row`` (then each worker cuts its own rows).
        Shape: (rows,) int64."""
        if self.ctx.world_size == 1:
            return np.arange(batch.num_rows)
        if C.BATCH_ROW not in batch.column_names:
            return None
        mine = batch.column(C.BATCH_ROW).to_numpy(zero_copy_only=False).astype(np.int64)
        size = int(self._group_max([mine.max() + 1 if len(mine) else 0])[0])
        present = np.zeros(size)
        present[mine] = 1.0
        present = np.asarray(self._group_sum(present)) > 0
        return (np.cumsum(present) - 1)[mine]

    def _mini_batches(self, rng, positions: np.ndarray | None, rows: int, total_rows: int) -> list[np.ndarray]:
        """Local row indices of each optimizer step's mini-batch, one epoch. The whole batch is
        cut (shuffled or in order) as one worker cuts it and each worker takes its rows of every
        mini-batch, so the k-th optimizer step trains the same rows at any group size."""
        count = min(self.params.mini_batches, total_rows)
        if positions is None:  # verl's ranks: each worker cuts its own rows; the k-th of each make step k
            order = rng.permutation(rows) if self.params.shuffle else np.arange(rows)
            return np.array_split(order, count)
        order = rng.permutation(total_rows) if self.params.shuffle else np.arange(total_rows)
        local = np.full(total_rows, -1, dtype=np.int64)
        local[positions] = np.arange(rows)
        return [mb[mb >= 0] for mb in (local[whole] for whole in np.array_split(order, count))]

    def _group_max(self, values) -> list[float]:
        """Maxima over the training group's workers (the values themselves without a group)."""
        if self.ctx.world_size == 1:
            return [float(v) for v in values]
        from dapo_flow.models import fsdp

        return fsdp.all_reduce_max([float(v) for v in values])

    def _group_sum(self, values) -> list[float]:
        """Sums over the training group's workers (the values themselves without a group)."""
        if self.ctx.world_size == 1:
            return [float(v) for v in values]
        from dapo_flow.models import fsdp

        return fsdp.all_reduce_sum([float(v) for v in values])

    def _micro_batches(self, mb: np.ndarray, prompts: list, responses: list) -> list[np.ndarray]:
        """Rows of mini-batch ``mb`` per forward/backward pass: up to the model's token budget
        (``train.max_tokens_per_micro_batch``, prompt + response tokens), else
        ``micro_batch_size`` rows. In a group every worker runs as many passes as the worker
        that needs most (each pass is an FSDP collective): one with fewer re-cuts its rows into
        that many balanced parts, some possibly empty."""
        budget = self.ctx.model.spec.train.max_tokens_per_micro_batch
        tokens = np.array([len(prompts[i]) + len(responses[i]) for i in mb], dtype=np.int64)
        if budget is None:
            size = self.params.micro_batch_size
            parts = [np.arange(i, min(i + size, len(mb))) for i in range(0, len(mb), size)]
        else:
            parts = token_budget_micro_batches(tokens, budget)
        if self.ctx.world_size > 1 and self.policy.sharded:
            count = int(self._group_max([len(parts)])[0])
            if len(parts) < count:
                parts = balanced_partitions(tokens, count)
        return [mb[part] for part in parts]

    def _minibatch(self, mb: np.ndarray, data: dict, n_tokens: int, n_seqs: int) -> dict[str, float]:
        """One optimizer step over mini-batch rows ``mb`` (micro-batched). ``n_tokens`` and
        ``n_seqs`` count the whole mini-batch, over every worker of a group: each worker's loss is
        its share of the group's loss, times the world size since the group averages gradients
        (FSDP2 in the backward, DDP in ``reduce_gradients``)."""
        world = self.ctx.world_size
        self.optimizer.zero_grad(set_to_none=True)
        stats = {name: 0.0 for name in self.METRICS}
        lr = self.optimizer.param_groups[0]["lr"]
        for rows in self._micro_batches(mb, data["prompts"], data["responses"]):
            if len(rows) == 0:  # this worker has no rows for a pass the others make
                self._empty_pass()
                continue
            loss, part = self._micro_loss(rows, data, n_tokens, n_seqs)
            (loss * world if world > 1 else loss).backward()
            for key, value in part.items():
                stats[key] += value
        if world > 1:  # each worker's statistics are its share of the group's: add them up
            summed = self._group_sum([stats[k] for k in self.GROUP_SUMMED])
            stats.update(zip(self.GROUP_SUMMED, summed))
            self.policy.reduce_gradients()  # DDP: one all-reduce per optimizer step (FSDP2: done)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.model.parameters(), self.params.grad_clip)
        if hasattr(grad_norm, "full_tensor"):  # sharded: a DTensor holding the global norm
            grad_norm = grad_norm.full_tensor()
        finite = bool(torch.isfinite(grad_norm))
        if finite:  # a nan/inf step would poison the weights and Adam's moments for good
            self.optimizer.step()
        stats[self._key("skipped_steps")] = float(not finite)
        stats[self._key("grad_norm")] = float(grad_norm)
        stats[self._key("lr")] = lr
        return stats

    def _empty_pass(self) -> None:
        """A forward/backward pass of one token with zero loss: a worker with no rows left takes
        part in the group's collectives (FSDP gathers and reduces in every pass; DDP has none
        there, so it skips it)."""
        if self.policy.sharded:
            self._zero_loss_pass()

    def _count_nonfinite(self, stats: dict[str, float]) -> None:
        """Track skipped (non-finite) optimizer steps; stop after max_nonfinite_steps in a row."""
        if not stats[self._key("skipped_steps")]:
            self.nonfinite_in_a_row = 0
            return
        self.skipped_total += 1
        self.nonfinite_in_a_row += 1
        limit = self.params.max_nonfinite_steps
        if limit and self.nonfinite_in_a_row >= limit:
            raise RunError(_nonfinite_message(f"{self.OP} '{self.ctx.node_id}'", stats[self._key("grad_norm")], limit,
                                              self.steps_done + 1))

    def _count_empty(self, trained_tokens: bool) -> None:
        """Track steps with every response masked out; stop after max_empty_steps in a row."""
        self.empty_in_a_row = 0 if trained_tokens else self.empty_in_a_row + 1
        limit = self.params.max_empty_steps
        if limit and self.empty_in_a_row >= limit:
            raise RunError(
                f"{self.OP} '{self.ctx.node_id}': no token was left to train on in {limit} steps in "
                "a row: every response was masked out (truncated under mask_truncated, or "
                "loss_mask false from an overlong-filter node), so the run was training nothing.\n"
                "    fix: raise generate's max_tokens so responses can finish, or stop masking "
                "truncated responses (max_empty_steps: 0 never stops)")


class Update(Optimization):
    """Trains the node's model (the policy) on the batch; emits one row of metrics."""

    Params = Params
    ROLE = "train"
    METRICS = METRICS
    GROUP_SUMMED = GROUP_SUMMED
    PRODUCES = {name: pa.float32() for name in METRICS}

    @classmethod
    def upstream_problems(cls, params: Params, generator_id: str, generator_params) -> list:
        from dapo_flow.models.sampling import temperature_problems

        return temperature_problems(params.temperature, generator_id, generator_params.temperature)

    @classmethod
    def resolve(cls, params: Params, available: dict[str, pa.DataType]) -> Params:
        update = {}
        if params.loss_mask == "auto":
            update["loss_mask"] = "use" if C.LOSS_MASK in available else "ignore"
        if params.advantage_column == "auto":
            token_only = C.TOKEN_ADVANTAGE in available and C.ADVANTAGE not in available
            update["advantage_column"] = C.TOKEN_ADVANTAGE if token_only else C.ADVANTAGE
        return params.model_copy(update=update) if update else params

    @classmethod
    def requires(cls, params: Params) -> dict[str, pa.DataType]:
        cols = [C.PROMPT_IDS, C.RESPONSE_IDS, C.OLD_LOGP,
                C.TOKEN_ADVANTAGE if params.advantage_column == C.TOKEN_ADVANTAGE else C.ADVANTAGE]
        cols += [C.TRUNCATED] if params.mask_truncated else []
        cols += [C.LOSS_MASK] if params.loss_mask == "use" else []
        cols += [C.REF_LOGP] if params.kl_coef > 0 else []
        return C.typed(*cols)

    def __init__(self, params: Params, ctx: OpContext):
        super().__init__(params, ctx)
        self.rl_steps = 0  # calls, warm-up ones included (critic_warmup counts them)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "rl_steps": self.rl_steps}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.rl_steps = int(state.get("rl_steps", self.steps_done))

    def __call__(self, batch: pa.Table) -> pa.Table:
        self.rl_steps += 1
        if self.rl_steps <= self.params.critic_warmup:  # the critic learns first; nothing moves
            return self._metrics_row({"actor/lr": self.optimizer.param_groups[0]["lr"],
                                      "actor/skipped_steps_total": float(self.skipped_total)})
        return super().__call__(batch)

    def _arrays(self, batch: pa.Table) -> dict:
        p = self.params
        old_logp, lengths = ragged_to_padded(batch.column(C.OLD_LOGP), dtype=np.float32)
        if p.loss_mask == "use":  # the tokens the model generated (not a tool's), rows not filtered out
            mask = response_mask(batch, lengths, old_logp.shape[1])
        else:
            mask = np.arange(old_logp.shape[1])[None, :] < lengths[:, None]
        if p.mask_truncated:
            mask &= ~batch.column(C.TRUNCATED).to_numpy(zero_copy_only=False)[:, None]
        if p.advantage_column == C.TOKEN_ADVANTAGE:  # (batch, width), 0 past each response
            adv = ragged_to_padded(batch.column(C.TOKEN_ADVANTAGE), dtype=np.float32)[0]  # as old_logp: same lengths
        else:  # (batch,): broadcast over the tokens per micro-batch
            adv = batch.column(C.ADVANTAGE).to_numpy().astype(np.float32)
        return {
            "prompts": token_lists(batch.column(C.PROMPT_IDS)),
            "responses": token_lists(batch.column(C.RESPONSE_IDS)),
            "old_logp": old_logp,
            "ref_logp": ragged_to_padded(batch.column(C.REF_LOGP), dtype=np.float32)[0] if p.kl_coef > 0 else None,
            "mask": mask,
            "adv": adv,
        }

    def _micro_loss(self, rows: np.ndarray, data: dict, n_tokens: int, n_seqs: int
                    ) -> tuple[torch.Tensor, dict[str, float]]:
        p = self.params
        adv, ref_logp = data["adv"], data["ref_logp"]
        logp, entropy, resp_mask = self.policy.response_logprobs(
            [data["prompts"][i] for i in rows],
            [data["responses"][i] for i in rows],
            temperature=p.temperature,
            with_entropy=True,
            grad=True,
        )
        width = logp.shape[1]
        dev = self.policy.to_device({  # the batch's arrays where the model's outputs are
            "mask": data["mask"][rows, :width],
            "old": data["old_logp"][rows, :width],
            "adv": adv[rows, :width] if adv.ndim == 2 else adv[rows],
            "ref": ref_logp[rows, :width] if p.kl_coef > 0 else None,
        })
        m = dev["mask"] & resp_mask
        a = dev["adv"] if adv.ndim == 2 else dev["adv"][:, None].expand(-1, width)
        agg = dict(num_tokens=n_tokens, num_seqs=n_seqs)
        extra = {"clip_c": p.clip_c} if p.policy_loss == "vanilla" else {}  # dual clip: vanilla only
        pg_loss, pg_stats = algos.POLICY_LOSSES[p.policy_loss](
            dev["old"], logp, a, m, clip_low=p.clip_low, clip_high=p.clip_high,
            agg=p.loss_agg_mode, norm_len=p.norm_len, **extra, **agg,
        )
        loss = pg_loss
        stats = {"actor/pg_loss": pg_loss, "actor/entropy": algos.agg_loss(entropy.detach(), m, "token-sum") / n_tokens}
        if p.entropy_coef > 0:
            loss = loss - p.entropy_coef * algos.agg_loss(entropy, m, p.loss_agg_mode, norm_len=p.norm_len, **agg)
        if p.kl_coef > 0:
            kl = algos.kl_penalty(logp, dev["ref"], p.kl_type)
            kl_loss = algos.agg_loss(kl, m, p.loss_agg_mode, norm_len=p.norm_len, **agg)
            loss = loss + p.kl_coef * kl_loss
            stats["actor/kl_loss"] = kl_loss
        stats = host_floats({**stats, "tokens": m.sum()})  # one transfer from the device
        share = stats.pop("tokens") / n_tokens  # this micro-batch's weight in the token statistics
        for key in ("clipfrac", "clipfrac_lower", "ppo_kl"):
            stats[f"actor/{key}"] = pg_stats[key] * share
        return loss, stats

    def _zero_loss_pass(self) -> None:
        eos = self.policy.eos_id
        logp, _, _ = self.policy.response_logprobs([[eos]], [[eos]], temperature=self.params.temperature,
                                                   grad=True)
        (logp.sum() * 0.0).backward()


def _nonfinite_message(node: str, grad_norm: float, limit: int, update_step: int) -> str:
    return (
        f"{node}: the gradient norm was {grad_norm} (not finite) in {limit} optimizer "
        f"steps in a row, the last in update step {update_step}; each such step is skipped, so the "
        "run was training nothing.\n"
        "    likely causes: lr, entropy_coef or kl_coef too large; clip settings (clip_high, clip_c, "
        "grad_clip); non-finite rewards or advantages upstream; a float16 model overflowing\n"
        "    the checkpoints written so far are intact: after a fix outside the graph (reward "
        "code, data, environment) `dapo-flow run GRAPH --resume` continues from the newest; a "
        "changed param is a new graph, run it without --resume (max_nonfinite_steps: 0 only "
        "counts such steps, in actor/skipped_steps)"
    )
