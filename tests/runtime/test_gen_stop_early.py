"""run.gen_stop_early: a generation batch generated in parts, stopping once enough groups are kept,
trains exactly what the whole batch trains (the prompts it leaves are those the group filter would
have dropped unused), in-process and on a Ray training group of 2, and resumes exactly."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from dapo_flow.core import columns as C
from dapo_flow.graph.edits import edit_file, parse_cli_edits
from dapo_flow.graph.plan import Cluster
from dapo_flow.operators.generate import CallSeeds
from dapo_flow.runtime import execute
from dapo_flow.runtime.loop import part_size
from dapo_flow.tracking import read_run

ROOT = Path(__file__).resolve().parents[2]
# the main job, short: 8 groups a step from generation batches of 24 prompts x 8 (3x what it trains)
SHORT = ("run.steps=10", "run.prompts_per_step=8", "run.gen_prompts_per_batch=24", "data.val.size=16",
         "run.val_every=5", "run.checkpoint_every=5")


def _run(workdir: Path, executor: str, *sets: str, steps: int | None = None, resume: str | None = None) -> dict:
    placed = edit_file(ROOT / "graphs/dapo.yaml", parse_cli_edits([("set", s) for s in (*SHORT, *sets)])
                       ).compile(Cluster(cpus=2))
    summary = execute(placed, executor=executor, steps=steps, resume=resume)
    return read_run(summary["tracking_uri"], summary["run_id"])["history"] | {"_summary": summary}


def _trained(history: dict) -> dict:
    """What training and validation logged: every actor/, batch/ and val/ metric."""
    return {k: v for k, v in history.items() if k.split("/")[0] in ("actor", "batch", "val")}


def test_a_part_is_sized_from_the_keep_rate():
    assert part_size(64, 32, None) == 64  # nothing measured yet: the whole batch
    assert part_size(64, 32, 0.97) == 36  # 36 * 0.97 - 2 sd = 32.9 >= 32
    assert part_size(64, 32, 1.0) == part_size(64, 32, 0.98) == 35  # a rate of 1 is not trusted to the row
    assert part_size(64, 32, 0.5) == 64  # more than the batch holds: all of it
    assert part_size(10, 2, 0.9) == 4
    assert part_size(10, 2, 0.9, floor=8) == 8  # each engine's share of a part: 4+ prompts
    assert all(1 <= part_size(left, need, rate) <= left for left in (1, 7, 64) for need in (1, 5, 40)
               for rate in (0.01, 0.3, 0.99))


def test_the_rest_of_a_batch_takes_the_seeds_of_its_first_part():
    ids = [f"p{i}-e0" for i in range(6)]
    whole, parts = CallSeeds(seed=3), CallSeeds(seed=3)
    marked = C.batch_part(pa.table({C.PROMPT_ID: ids}), continues=True, prompt_width=7).slice(2)
    assert C.continues_call(marked) and C.prompt_width(marked) == 7  # a worker's share keeps the marks
    first = C.batch_part(pa.table({C.PROMPT_ID: ids}), continues=False, prompt_width=7)
    assert not C.continues_call(first) and C.prompt_width(pa.table({C.PROMPT_ID: ids})) is None
    seeds = whole.take(pa.table({C.PROMPT_ID: ids}))
    head = parts.take(pa.table({C.PROMPT_ID: ids[:2]}))
    tail = parts.take(C.batch_part(pa.table({C.PROMPT_ID: ids[2:]}), continues=True, prompt_width=3))
    assert head + tail == seeds and parts.calls == whole.calls == 1
    nxt = pa.table({C.PROMPT_ID: ["q0-e0"]})
    assert parts.take(nxt) == whole.take(nxt)  # the next batch: the next call, in both


def test_stopping_early_trains_what_the_whole_batch_trains_and_resumes_exactly(workdir):
    whole = _run(workdir, "local", "run.gen_stop_early=false")
    early = _run(workdir, "local")
    assert _trained(early) == _trained(whole) and len(_trained(whole)) > 10
    ungenerated = [v for _, v in early["sampling/prompts_ungenerated"]]
    assert sum(ungenerated) > 0 and "sampling/prompts_ungenerated" not in whole
    generated = lambda h: h["_summary"]["samples_generated"]  # noqa: E731
    assert generated(early) == generated(whole) - 8 * sum(ungenerated)  # 8 samples a prompt

    first = _run(workdir, "local", steps=5)
    resumed = _run(workdir, "local", resume=first["_summary"]["run_id"])
    for key in ("sampling/keep_rate", "sampling/prompts_ungenerated", "sampling/samples_generated"):
        assert resumed[key] == early[key], key
    assert _trained(resumed) == _trained(early)


@pytest.mark.slow
@pytest.mark.shared_ray
def test_on_a_ray_training_group_each_worker_generates_its_share_of_each_part(workdir):
    """Two DDP workers each generate their share of every part (their seed counters move
    together): the run trains what the whole batches train."""
    whole = _run(workdir, "ray", "run.gen_stop_early=false", "run.steps=6")
    early = _run(workdir, "ray", "run.steps=6")
    assert _trained(early) == _trained(whole)
    assert sum(v for _, v in early["sampling/prompts_ungenerated"]) > 0
