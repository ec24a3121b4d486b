"""The RL loop, top to bottom in named phases:

rollout until the group filter has enough groups -> train segment (old/ref logprobs ->
advantages -> update) -> weight sync -> log -> validate -> checkpoint.

Variants are nodes of the graph, never `if` branches here: the loop only knows the
plan's segments (rollout, train), its group filter and its weight syncs.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import pyarrow as pa

from dapo_flow import algos
from dapo_flow.graph import columns as C
from dapo_flow.data.arrow_utils import group_codes
from dapo_flow.errors import RunError
from dapo_flow.graph.plan import DRIVER, IN_ACTOR, Call
from dapo_flow.runtime.metrics import MetricAccumulator, concat, first_row
from dapo_flow.runtime.sampler import PromptSampler
from dapo_flow.runtime.worker import StageWorker
from dapo_flow.graph.spec import PROMPTS_SOURCE

@dataclass
class LoopState:
    step: int = 0  # completed steps
    carry: pa.Table | None = None  # kept groups beyond prompts_per_step (carry_surplus)
    samples_generated: int = 0
    wall_seconds: float = 0.0
    keep_rate: float | None = None  # gen_prompts_per_batch auto: EMA of kept groups per prompt
    skipped_in_a_row: int = 0  # steps in a row that trained nothing (the group filter kept too little)


@dataclass
class Rollout:
    batch: pa.Table | None  # None: skip this step
    metrics: dict[str, float] = field(default_factory=dict)


class Runner:
    """Executes a placed plan exactly: per phase its calls, in order, each in its stage (the
    driver worker or an executor actor), then its weight syncs. ``call_log`` records every
    call and sync made, as (phase, stage, node ids) and ("sync", source, target, kind)."""

    def __init__(self, placed, executor, driver: StageWorker, sampler: PromptSampler):
        self.placed = placed
        self.plan = placed.plan
        self.run = self.plan.spec.run
        self.ex = executor
        self.driver = driver
        self.sampler = sampler
        self.nodes = {n.id: n for n in self.plan.nodes}
        self.stage_of = dict(placed.node_stage)
        self.chunk = self.run.chunk_prompts
        self.call_log: list[tuple[str, str, tuple[str, ...]]] = []

    # --- call execution --------------------------------------------------------
    def _submit(self, phase: str, call: Call, table: pa.Table):
        self.call_log.append((phase, call.stage, call.nodes))
        if call.stage == DRIVER:
            return self.driver.run_chain(list(call.nodes), table)
        return self.ex.call(call.stage, "run_chain", list(call.nodes), table)

    def _finish(self, call: Call, handle, acc: MetricAccumulator) -> pa.Table:
        table, report = handle if call.stage == DRIVER else self.ex.get(handle)
        for nid, metrics, seconds in report:
            acc.add(metrics)
            acc.add({f"time/{nid}": seconds})
        return table

    def _input(self, nid: str, outs: dict[str, pa.Table]) -> pa.Table:
        node = self.nodes[nid]
        tables = [outs[i] for i in node.inputs]
        if callable(getattr(node.op_cls, "combine", None)):  # a keyed join (e.g. baseline)
            return node.op_cls.combine(node.params, tables)
        merged = tables[0]
        for other in tables[1:]:  # row-aligned join: add the columns the first lacks
            for name in other.column_names:
                if name not in merged.column_names:
                    merged = merged.append_column(name, other.column(name))
        return merged

    def run_calls(self, phase: str, feeds: dict[str, pa.Table], acc: MetricAccumulator,
                  first_done: Any = None) -> dict[str, pa.Table]:
        """Run the phase's calls; returns each call's output under its last node's id (inner
        nodes of a call are not returned). ``first_done``: the first call's handle, already
        submitted (streaming)."""
        outs = dict(feeds)
        for k, call in enumerate(self.placed.calls[phase]):
            handle = first_done if k == 0 and first_done is not None else (
                self._submit(phase, call, self._input(call.nodes[0], outs)))
            outs[call.nodes[-1]] = self._finish(call, handle, acc)
        return outs

    # --- phase 1: rollout with dynamic sampling ---------------------------------
    def rollout_batch(self, prompts: pa.Table, acc: MetricAccumulator) -> pa.Table:
        """One generation batch through the rollout phase, streamed in chunks: every chunk's
        first call (generation, in its actor) is queued at once, and each finished chunk flows
        on to scoring / shaping / filtering while later chunks still generate."""
        head = self.placed.calls["rollout"][0]
        size = self.chunk or prompts.num_rows
        chunks = [prompts.slice(i, size) for i in range(0, prompts.num_rows, size)]
        stream = head.stage != DRIVER and self.nodes[head.nodes[0]].inputs == (PROMPTS_SOURCE,)
        handles = [self._submit("rollout", head, c) for c in chunks] if stream else [None] * len(chunks)
        kept = []
        for chunk, handle in zip(chunks, handles):
            outs = self.run_calls("rollout", {PROMPTS_SOURCE: chunk}, acc, first_done=handle)
            kept.append(outs[self.plan.group_filter])
        return concat(kept)

    def collect(self, state: LoopState) -> Rollout:
        acc = MetricAccumulator()
        need = self.run.prompts_per_step
        if self.plan.group_filter is None:  # no dynamic sampling: the train segment generates
            generated = need * _group_size(self.plan)
            state.samples_generated += generated
            return Rollout(self.sampler.next(need), {"sampling/samples_generated": float(generated)})
        fparams = self.nodes[self.plan.group_filter].params
        auto = self.run.gen_prompts_per_batch == "auto"
        kept = [state.carry] if state.carry is not None else []
        state.carry = None
        groups, batches, generated, empty_in_a_row = _n_groups(concat(kept)), 0, 0, 0
        while groups < need:
            if fparams.max_gen_batches and batches >= fparams.max_gen_batches:
                if fparams.on_cap == "error":
                    raise RunError(
                        f"dynamic sampling kept {groups}/{need} prompt groups after {batches} "
                        f"generation batches (group-filter max_gen_batches={fparams.max_gen_batches}). "
                        "Fix: raise max_gen_batches or run.gen_prompts_per_batch, lower "
                        "run.prompts_per_step, or set on_cap: train-on-what-we-have / skip-step"
                    )
                if fparams.on_cap == "skip-step" or groups == 0:
                    state.samples_generated += generated  # generated, though none is trained on
                    self._count_skipped(state, fparams, groups, batches)
                    return Rollout(None, {**acc.result(), "sampling/gen_batches": batches,
                                          "sampling/samples_generated": float(generated),
                                          "sampling/capped": 1.0, "sampling/skipped": 1.0})
                break
            size = (auto_batch_size(need - groups, state.keep_rate, need) if auto
                    else self.run.gen_prompts_per_batch or need)
            prompts = self.sampler.next(size)
            out = self.rollout_batch(prompts, acc)
            generated += prompts.num_rows * _group_size(self.plan)
            batches += 1
            kept.append(out)
            # group ids never repeat across generation batches (the sampler suffixes the epoch)
            got = _n_groups(out)
            groups += got
            if auto:
                state.keep_rate = _ema(state.keep_rate, got / max(prompts.num_rows, 1))
            empty_in_a_row = 0 if got else empty_in_a_row + 1
            limit = fparams.max_skipped_steps
            if not fparams.max_gen_batches and limit and empty_in_a_row >= limit:  # else: a hang
                raise RunError(_nothing_kept(
                    fparams, f"{empty_in_a_row} generation batches in a row kept no prompt group at "
                    f"group-filter '{self.plan.group_filter}' (with max_gen_batches: 0 the step "
                    f"would never end; max_skipped_steps={limit})"))
        state.skipped_in_a_row = 0
        batch = concat(kept)
        batch, surplus = _cut_groups(batch, need)
        if self.run.carry_surplus and surplus is not None and surplus.num_rows:
            state.carry = surplus
        state.samples_generated += generated
        metrics = acc.result()
        metrics.update({
            "sampling/gen_batches": float(batches),
            "sampling/kept_groups": float(_n_groups(batch)),
            "sampling/samples_generated": float(generated),
            "sampling/generated_per_trained": float(generated / max(batch.num_rows, 1)),
            "sampling/capped": float(groups < need),
        })
        if state.keep_rate is not None:
            metrics["sampling/keep_rate"] = state.keep_rate
        return Rollout(batch, metrics)

    def _count_skipped(self, state: LoopState, fparams, groups: int, batches: int) -> None:
        """One more step that trains nothing; max_skipped_steps of them in a row stop the run."""
        state.skipped_in_a_row += 1
        limit = fparams.max_skipped_steps
        if limit and state.skipped_in_a_row >= limit:
            raise RunError(_nothing_kept(
                fparams, f"{state.skipped_in_a_row} steps in a row were skipped: group-filter "
                f"'{self.plan.group_filter}' kept too few prompt groups (the last step kept "
                f"{groups}/{self.run.prompts_per_step} after {batches} generation batches; "
                f"max_skipped_steps={limit})"))

    # --- phase 2: train segment -------------------------------------------------
    def train(self, rollout: Rollout) -> dict[str, float]:
        acc = MetricAccumulator()
        feeds = {PROMPTS_SOURCE: rollout.batch}
        if self.plan.group_filter is not None:
            feeds = {self.plan.group_filter: rollout.batch}
        outs = self.run_calls(self.plan.phases[-1][0], feeds, acc)
        metrics = acc.result()
        for nid in self.plan.train:  # batch/* came with each sink's report (StageWorker.run)
            if self.nodes[nid].cardinality == "sink":
                metrics.update(first_row(outs[nid]))
        return metrics

    # --- phase 3: weight sync ---------------------------------------------------
    def sync(self) -> dict[str, float]:
        """The plan's weight syncs (none where a stage generates with the policy it trains)."""
        seconds = 0.0
        for sync in self.placed.syncs:
            self.call_log.append(("sync", sync.source, (sync.target, sync.kind)))
            if sync.kind == IN_ACTOR:
                seconds += self.ex.get(self.ex.call(sync.source, "sync_generators"))
            else:
                weights = self.ex.call(sync.source, "export_weights", sync.model)
                seconds += self.ex.get(self.ex.call(sync.target, "import_weights", sync.model, weights))
        return {"time/weight_sync": seconds}

    # --- phase 4: validation ------------------------------------------------------
    def validate(self, val_prompts: pa.Table | None, log_samples: int, *, n: int | None = None,
                 temperature: float | None = None) -> tuple[dict[str, float], list[dict]]:
        """avg@n accuracy (val/acc), score, response length and, for n > 1, unbiased pass@k of
        the generate node on ``val_prompts`` (n, temperature: default run.val_n / val_temperature)."""
        gen, score = self.plan.first("generate"), self.plan.first("reward")
        if val_prompts is None or gen is None or score is None:
            return {}, []
        start = time.perf_counter()
        n = n or self.run.val_n
        temperature = self.run.val_temperature if temperature is None else temperature
        overrides = {"temperature": temperature, "n": n}
        stage = self.stage_of[gen.id]
        self.call_log.append(("validate", stage, (gen.id,)))
        if stage == DRIVER:
            rolled = self.driver.run_variant(gen.id, val_prompts, overrides)
        else:
            rolled = self.ex.get(self.ex.call(stage, "run_variant", gen.id, val_prompts, overrides))
        grade = Call(self.stage_of[score.id], (score.id,))
        scored = self._finish(grade, self._submit("validate", grade, rolled), MetricAccumulator())
        metrics = {
            "val/acc": float(np.mean(scored.column(C.ACC).to_numpy())),
            "val/score": float(np.mean(scored.column(C.SCORE).to_numpy())),
            "val/response_len_mean": float(np.mean(scored.column(C.RESPONSE_LEN).to_numpy())),
            "time/validate": time.perf_counter() - start,
        }
        if n > 1:  # avg@n is val/acc; pass@k (unbiased) for k = 2, 4, ..., n
            groups = group_codes(scored.column(C.PROMPT_ID))
            acc = scored.column(C.ACC).to_numpy()
            for k in sorted({2 ** i for i in range(1, n.bit_length())} | {n}):
                metrics[f"val/pass_at_{k}"] = algos.pass_at_k(groups, acc, k)
        cols = [c for c in (C.PROMPT_TEXT, C.RESPONSE_TEXT, C.GROUND_TRUTH, C.SCORE, C.ACC) if c in scored.column_names]
        samples = scored.select(cols).slice(0, log_samples).to_pylist()
        return metrics, samples


def _nothing_kept(fparams, what: str) -> str:
    """The RunError text when dynamic sampling keeps (almost) nothing, step after step."""
    return (
        f"training is doing nothing: {what}.\n"
        f"    a group is dropped when its '{fparams.metric}' is the same for every sample; likely "
        "causes: greedy sampling (generate temperature 0 or top_k 1), a constant reward (a reward "
        "function that always returns the same value, or correct == wrong), a task the model "
        "always or never solves\n"
        "    fix: remove the cause and start a new run; if groups are kept, just too few, raise "
        "max_gen_batches or run.gen_prompts_per_batch (max_skipped_steps: 0 never stops the run)"
    )


KEEP_RATE_MARGIN = 1.15  # ask for 15% more groups than the keep rate predicts: one batch usually does
KEEP_RATE_FLOOR = 0.05  # a run of all-filtered batches must not ask for unbounded batches
_EMA_WEIGHT = 0.3  # weight of the newest batch in the keep-rate average


def auto_batch_size(remaining: int, keep_rate: float | None, need: int) -> int:
    """Prompts for the next generation batch under `gen_prompts_per_batch: auto`: enough to
    keep `remaining` groups at the keep rate seen so far, with a margin; `need` before any
    batch has been seen, at most 8 x `need`."""
    if keep_rate is None:
        return need
    want = math.ceil(remaining * KEEP_RATE_MARGIN / max(keep_rate, KEEP_RATE_FLOOR))
    return max(1, min(want, 8 * need))


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - _EMA_WEIGHT) * old + _EMA_WEIGHT * new


def _n_groups(table: pa.Table | None) -> int:
    if table is None or table.num_rows == 0:
        return 0
    return len(np.unique(table.column(C.PROMPT_ID).to_numpy(zero_copy_only=False)))


def _cut_groups(batch: pa.Table, need: int) -> tuple[pa.Table, pa.Table | None]:
    """First ``need`` whole groups (in order of appearance) and the surplus (verl cuts by
    rows and can split a group; we never do)."""
    ids = batch.column(C.PROMPT_ID).to_numpy(zero_copy_only=False)
    uniq, first = np.unique(ids, return_index=True)
    if len(uniq) <= need:
        return batch, None
    chosen = uniq[np.argsort(first)][:need]
    mask = np.isin(ids, chosen)
    return batch.filter(pa.array(mask)), batch.filter(pa.array(~mask))


def _group_size(plan) -> int:
    gen = plan.first("generate")
    return int(getattr(gen.params, "n", 1)) if gen is not None else 1


ProgressFn = Callable[[int, dict[str, float]], None]
