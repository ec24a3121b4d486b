"""The trainer: optimizer steps around a training operator's loss.

:func:`make_trainer` builds an :class:`AdamWTrainer`, the one implementation of the
:class:`Trainer` Protocol: AdamW with linear warm-up over RL steps, ``ppo_epochs`` passes over
``mini_batches`` optimizer steps cut as one worker cuts them (also in a training group), micro-
batches whose losses are partial sums of the mini-batch's, grad-norm clipping, skipped nan/inf
steps and the counters that stop a run that trains nothing, and its state for checkpoints. The
operator hands it a :class:`MicroLoss` (what one micro-batch's loss is) and :class:`StepRows`
(what the trainer must know of the rows: which tokens the loss counts, each row's length, its
place in the group's batch).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from dapo_flow import algos
from dapo_flow.algos.balance import balanced_partitions, token_budget_micro_batches
from dapo_flow.errors import RunError
from dapo_flow.models.devices import to_host
from dapo_flow.training.params import OptimizerParams
from dapo_flow.training.parallel import Parallelism, parallelism_of


@runtime_checkable
class MicroLoss(Protocol):
    """A training operator's loss over the rows of one forward/backward pass."""

    def __call__(self, rows: np.ndarray, n_tokens: int, n_seqs: int) -> tuple[torch.Tensor, dict[str, float]]:
        """The loss of micro-batch ``rows`` (indices into the step's rows) as its part of the
        mini-batch's (``n_tokens`` / ``n_seqs`` count the whole mini-batch over the group), and
        its statistics (shares of the mini-batch's: they are added up)."""

    def zero_pass(self) -> None:
        """A forward/backward pass of one token with zero loss: a worker with no rows left still
        takes part in the group's collectives."""


@dataclass(frozen=True)
class StepRows:
    """What the trainer reads of one step's rows. Shape: loss_tokens (rows, width) bool, the
    tokens the loss counts; row_tokens (rows,) prompt + response tokens (the micro-batch token
    budget's measure); batch_row (rows,) each row's position in the whole batch the group
    trains on, or None (a group's rows that came without it: each worker cuts its own)."""

    loss_tokens: np.ndarray
    row_tokens: np.ndarray
    batch_row: np.ndarray | None = None

    @property
    def num_rows(self) -> int:
        return len(self.row_tokens)


@runtime_checkable
class Trainer(Protocol):
    optimizer: Any  # the torch optimizer: a sharded model's checkpoint saves its state with the weights
    steps_done: int  # RL steps trained (their optimizer steps may have been skipped)
    skipped_total: int  # optimizer steps skipped for a nan/inf gradient norm, all along

    @property
    def lr(self) -> float: ...

    def step(self, rows: StepRows, loss: MicroLoss) -> dict[str, float]:
        """One RL step over ``rows``: its optimizer steps, then the schedule's; the metrics
        (named by the trainer's ``metrics``), averaged over the optimizer steps but for the
        counts."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def make_trainer(policy: Any, params: OptimizerParams, *, label: str, prefix: str, metrics: tuple[str, ...],
                 group_summed: tuple[str, ...], seed: int, world_size: int,
                 max_tokens_per_micro_batch: int | None) -> "AdamWTrainer":
    """The trainer of ``policy`` (an HFPolicy: ``model``, ``sharded``, ``reduce_gradients``) in a
    training group of ``world_size``. ``label`` names it in errors ("update 'train'"); its own
    metrics are ``prefix``/grad_norm, lr, skipped_*; ``metrics`` are every metric the step
    reports (the operator's too); ``group_summed``, the loss statistics each worker computes as
    its share of the group's."""
    return AdamWTrainer(policy.model, params, parallelism_of(policy, world_size), label=label, prefix=prefix,
                        metrics=metrics, group_summed=group_summed, seed=seed,
                        max_tokens_per_micro_batch=max_tokens_per_micro_batch)


class AdamWTrainer:
    """:class:`Trainer` with torch's AdamW on ``model``'s parameters."""

    def __init__(self, model: torch.nn.Module, params: OptimizerParams, parallel: Parallelism, *, label: str,
                 prefix: str, metrics: tuple[str, ...], group_summed: tuple[str, ...], seed: int,
                 max_tokens_per_micro_batch: int | None):
        self.model = model
        self.params = params
        self.parallel = parallel
        self.label, self.prefix, self.metrics, self.group_summed = label, prefix, metrics, group_summed
        self.seed = seed
        self.max_tokens_per_micro_batch = max_tokens_per_micro_batch
        # the trained weights: all of them, or under LoRA the adapters (no state for frozen ones)
        self.trained = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.trained, lr=params.lr, weight_decay=params.weight_decay)
        self.steps_done = 0
        self.nonfinite_in_a_row = 0  # optimizer steps skipped for a nan/inf grad norm, in a row
        self.skipped_total = 0  # all optimizer steps skipped so far, for PREFIX/skipped_steps_total
        self.empty_in_a_row = 0  # steps in a row with every response masked out
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def _lr_factor(self, step: int) -> float:
        w = self.params.warmup_steps
        return min(1.0, (step + 1) / w) if w else 1.0

    # --- checkpoints ------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Counters and the scheduler; the optimizer too unless the layout saves it with the
        weights (FSDP2: shard by shard)."""
        state = {
            "scheduler": self.scheduler.state_dict(),
            "steps_done": self.steps_done,
            "nonfinite_in_a_row": self.nonfinite_in_a_row,
            "skipped_total": self.skipped_total,
            "empty_in_a_row": self.empty_in_a_row,
        }
        if self.parallel.checkpoints_optimizer:  # on the host: the driver and the disk may have no device
            state["optimizer"] = to_host(self.optimizer.state_dict())
        return state

    def load_state_dict(self, state: dict) -> None:
        if "optimizer" in state:
            self.parallel.load_optimizer_state(self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.steps_done = int(state["steps_done"])
        self.nonfinite_in_a_row = int(state.get("nonfinite_in_a_row", 0))  # older checkpoints lack it
        self.skipped_total = int(state.get("skipped_total", 0))
        self.empty_in_a_row = int(state.get("empty_in_a_row", 0))

    # --- one RL step ------------------------------------------------------------------------------

    def step(self, rows: StepRows, loss: MicroLoss) -> dict[str, float]:
        total_rows = int(self.parallel.sum([rows.num_rows])[0])
        if total_rows == 0:
            raise algos.AlgoError(
                f"{self.label} got an empty batch: a node between the group-filter "
                "(or generate) and this node dropped every row. Fix: let that node keep rows, or "
                "move it before the group-filter so dynamic sampling refills the batch")
        mask = rows.loss_tokens
        rng = np.random.default_rng([self.seed, self.steps_done])
        positions = self._batch_positions(rows)
        sums: dict[str, float] = {name: 0.0 for name in self.metrics}
        n_opt_steps = 0
        for _epoch in range(self.params.ppo_epochs):
            for mb in self._mini_batches(rng, positions, rows.num_rows, total_rows):
                n_tokens, n_seqs = (int(x) for x in self.parallel.sum([mask[mb].sum(), len(mb)]))
                if n_tokens == 0:  # e.g. every response truncated under overlong filtering
                    sums[self._key("skipped_minibatches")] += 1
                    continue
                stats = self._optimizer_step(mb, rows.row_tokens, loss, n_tokens, n_seqs)
                for key, value in stats.items():
                    sums[key] += value
                n_opt_steps += 1
                self._count_nonfinite(stats)
        self._count_empty(trained_tokens=n_opt_steps > 0)
        lr = self.lr  # the step's, as verl logs it: the scheduler then sets the next step's
        with warnings.catch_warnings():  # warm-up follows RL steps, also when no optimizer step ran
            warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler\.step\(\)`", UserWarning)
            self.scheduler.step()
        self.steps_done += 1
        out = {k: v / max(n_opt_steps, 1) for k, v in sums.items()}
        counts = (self._key("skipped_minibatches"), self._key("skipped_steps"))  # sums, not means
        out.update({k: sums[k] for k in counts})
        out[self._key("skipped_steps_total")] = float(self.skipped_total)
        out[self._key("lr")] = lr
        return out

    def _batch_positions(self, rows: StepRows) -> np.ndarray | None:
        """Each local row's position in the whole batch the group trains on (rows of a filter
        before the operator closed up, as one worker would see them); ``None`` in a group whose
        rows came without their ``batch_row`` (then each worker cuts its own rows).
        Shape: (rows,) int64."""
        if self.parallel.world_size == 1:
            return np.arange(rows.num_rows)
        if rows.batch_row is None:
            return None
        mine = rows.batch_row.astype(np.int64)
        size = int(self.parallel.max([mine.max() + 1 if len(mine) else 0])[0])
        present = np.zeros(size)
        present[mine] = 1.0
        present = np.asarray(self.parallel.sum(present)) > 0
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

    def _micro_batches(self, mb: np.ndarray, row_tokens: np.ndarray) -> list[np.ndarray]:
        """Rows of mini-batch ``mb`` per forward/backward pass: up to the model's token budget
        (``train.max_tokens_per_micro_batch``, prompt + response tokens), else
        ``micro_batch_size`` rows. Where every worker must run as many passes as the worker that
        needs most (FSDP2), one with fewer re-cuts its rows into that many balanced parts, some
        possibly empty."""
        budget = self.max_tokens_per_micro_batch
        tokens = np.asarray(row_tokens[mb], dtype=np.int64)
        if budget is None:
            size = self.params.micro_batch_size
            parts = [np.arange(i, min(i + size, len(mb))) for i in range(0, len(mb), size)]
        else:
            parts = token_budget_micro_batches(tokens, budget)
        if self.parallel.equal_passes:
            count = int(self.parallel.max([len(parts)])[0])
            if len(parts) < count:
                parts = balanced_partitions(tokens, count)
        return [mb[part] for part in parts]

    def _optimizer_step(self, mb: np.ndarray, row_tokens: np.ndarray, loss_of: MicroLoss, n_tokens: int,
                        n_seqs: int) -> dict[str, float]:
        """One optimizer step over mini-batch rows ``mb`` (micro-batched). ``n_tokens`` and
        ``n_seqs`` count the whole mini-batch, over every worker of a group: each worker's loss is
        its share of the group's loss, times the world size since the group averages gradients
        (FSDP2 in the backward, DDP in ``reduce_gradients``)."""
        world = self.parallel.world_size
        self.optimizer.zero_grad(set_to_none=True)
        stats = {name: 0.0 for name in self.metrics}
        lr = self.lr
        for rows in self._micro_batches(mb, row_tokens):
            if len(rows) == 0:  # this worker has no rows for a pass the others make
                loss_of.zero_pass()
                continue
            loss, part = loss_of(rows, n_tokens, n_seqs)
            (loss * world if world > 1 else loss).backward()
            for key, value in part.items():
                stats[key] += value
        if world > 1:  # each worker's statistics are its share of the group's: add them up
            summed = self.parallel.sum([stats[k] for k in self.group_summed])
            stats.update(zip(self.group_summed, summed))
            self.parallel.reduce_gradients()  # DDP: one all-reduce per optimizer step (FSDP2: done)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.trained, self.params.grad_clip)
        if hasattr(grad_norm, "full_tensor"):  # sharded: a DTensor holding the global norm
            grad_norm = grad_norm.full_tensor()
        finite = bool(torch.isfinite(grad_norm))
        if finite:  # a nan/inf step would poison the weights and Adam's moments for good
            self.optimizer.step()
        stats[self._key("skipped_steps")] = float(not finite)
        stats[self._key("grad_norm")] = float(grad_norm)
        stats[self._key("lr")] = lr
        return stats

    def _count_nonfinite(self, stats: dict[str, float]) -> None:
        """Track skipped (non-finite) optimizer steps; stop after max_nonfinite_steps in a row."""
        if not stats[self._key("skipped_steps")]:
            self.nonfinite_in_a_row = 0
            return
        self.skipped_total += 1
        self.nonfinite_in_a_row += 1
        limit = self.params.max_nonfinite_steps
        if limit and self.nonfinite_in_a_row >= limit:
            raise RunError(nonfinite_message(self.label, stats[self._key("grad_norm")], limit, self.steps_done + 1))

    def _count_empty(self, trained_tokens: bool) -> None:
        """Track steps with every response masked out; stop after max_empty_steps in a row."""
        self.empty_in_a_row = 0 if trained_tokens else self.empty_in_a_row + 1
        limit = self.params.max_empty_steps
        if limit and self.empty_in_a_row >= limit:
            raise RunError(
                f"{self.label}: no token was left to train on in {limit} steps in "
                "a row: every response was masked out (truncated under mask_truncated, or "
                "loss_mask false from an overlong-filter node), so the run was training nothing.\n"
                "    fix: raise generate's max_tokens so responses can finish, or stop masking "
                "truncated responses (max_empty_steps: 0 never stops)")


def nonfinite_message(label: str, grad_norm: float, limit: int, update_step: int) -> str:
    return (
        f"{label}: the gradient norm was {grad_norm} (not finite) in {limit} optimizer "
        f"steps in a row, the last in update step {update_step}; each such step is skipped, so the "
        "run was training nothing.\n"
        "    likely causes: lr, entropy_coef or kl_coef too large; clip settings (clip_high, clip_c, "
        "grad_clip); non-finite rewards or advantages upstream; a float16 model overflowing\n"
        "    the checkpoints written so far are intact: after a fix outside the graph (reward "
        "code, data, environment) `dapo-flow run GRAPH --resume` continues from the newest; a "
        "changed param is a new graph, run it without --resume (max_nonfinite_steps: 0 only "
        "counts such steps, in actor/skipped_steps)"
    )
