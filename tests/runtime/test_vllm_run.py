"""Rollout engines that are not the trainer get the trainer's weights after every update.

Each run inserts `check` (tests/runtime/logp_agreement.py) after `old_logp`: it records
max |rollout_logp - old_logp| over the batch, i.e. how far the rollout engine's sampled-token
logprobs are from the trainer's recomputation. Every update moves the weights, so from step 2
on the gap is small only if weight sync really reached the engine (vLLM, or a separate
rollout actor in `placement: {mode: disaggregated}`); a sync-less run is the negative control.

Costs on 2 CPU cores: vLLM engine start ~12-20 s per run, a Ray cluster ~10 s.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dapo_flow.graph.compiler import compile_graph
from dapo_flow.graph.plan import Cluster
from dapo_flow.runtime import execute
from dapo_flow.runtime.worker import StageWorker
from dapo_flow.tracking import read_run

CHECK_OP = Path(__file__).with_name("logp_agreement.py")
METRIC = "check/logp_max_abs_diff"
CLUSTER = Cluster(cpus=2)

pytestmark = pytest.mark.slow


def _graph(small_graph, workdir: Path, *, backend: str, steps: int, disaggregated: bool = False) -> Path:
    """The small runtime-test graph with `check` between old_logp and adv, one mini-batch."""
    path = small_graph(workdir, name=f"check-{backend}", steps=steps, ckpt=0, backend=backend)
    text = path.read_text()
    adv = "{id: adv, op: advantage, inputs: [old_logp]}"
    assert text.count(adv) == 1, "tests/runtime/conftest.py TEMPLATE changed: update _graph"
    check = f"{{id: check, op: custom, impl: '{CHECK_OP}:CheckLogp', inputs: [old_logp]}}"
    text = text.replace(adv, check + "\n  - {id: adv, op: advantage, inputs: [check]}")
    # one mini-batch, so actor/ppo_kl is the first mini-batch's (~0), not a mean with later ones
    train = "params: {lr: 1.0e-4, mini_batches: 2}"
    assert text.count(train) == 1, "tests/runtime/conftest.py TEMPLATE changed: update _graph"
    text = text.replace(train, "params: {lr: 1.0e-4, mini_batches: 1}")
    if disaggregated:
        text += "placement: {mode: disaggregated}\n"
    path.write_text(text)
    return path


def _history(path: Path, executor: str, steps: int) -> dict[str, list[float]]:
    placed = compile_graph(path, CLUSTER)
    summary = execute(placed, executor=executor)
    assert summary["steps"] == steps
    history = read_run(summary["tracking_uri"], summary["run_id"])["history"]
    return {key: [v for _, v in points] for key, points in history.items()}


def _assert_engine_has_trainer_weights(h: dict[str, list[float]], steps: int) -> None:
    print(f"\n{METRIC}: {h[METRIC]}\ntime/rollout: {h['time/rollout']}\ntime/weight_sync: {h['time/weight_sync']}")
    assert len(h[METRIC]) == steps
    # float32 engines on CPU agree to ~5e-6 (vLLM and HF alike); without sync it is ~1 (below)
    assert max(h[METRIC]) < 1e-4, h[METRIC]
    assert all(s > 0 for s in h["time/weight_sync"]), h["time/weight_sync"]
    assert all(g > 0 for g in h["actor/grad_norm"])  # the weights did move every step
    # the only mini-batch starts at the weights old_logp was computed with: KL ~1e-7
    assert all(abs(kl) < 1e-5 for kl in h["actor/ppo_kl"]), h["actor/ppo_kl"]


@pytest.fixture()
def vllm_installed():
    pytest.importorskip("vllm")


@pytest.mark.vllm
def test_vllm_local_runs_one_after_another_each_sync_weights_into_their_engine(workdir, small_graph, vllm_installed):
    """A local sweep of two runs, as `dapo-flow sweep --executor local` runs them. An in-process
    vLLM-CPU engine created after other engines generated in the same process can return wrong
    logprobs for a few tokens after weight syncs (trigger not pinned down; seen when
    tests/models/test_vllm.py ran earlier in the pytest process: gap 0.8-4 from step 2), so the
    sweep gives each such run a fresh process, and both runs must agree to float precision
    (with the runs in this process, after test_vllm.py, this failed with a gap of 4.0)."""
    from dapo_flow.experiments.sweep import load_patch, plan_jobs, run_sweep
    from dapo_flow.tracking import read_run

    path = _graph(small_graph, workdir, backend="vllm", steps=2)  # step 2 samples synced weights
    patch_file = workdir / "two.yaml"
    patch_file.write_text(f"base: {path.name}\nexperiment: check-vllm\nvariants:\n  base: []\n")
    patch = load_patch(patch_file)
    result = run_sweep(patch, plan_jobs(patch, seeds="0,1"), executor="local")
    assert [r.ok for r in result.results] == [True, True], [r.error for r in result.results]
    for r in result.results:
        history = read_run(result.tracking_uri, r.run_id)["history"]
        _assert_engine_has_trainer_weights({k: [v for _, v in pts] for k, pts in history.items()}, 2)


@pytest.mark.shared_ray
@pytest.mark.vllm
def test_vllm_ray_run_syncs_weights_into_the_engine(workdir, small_graph, vllm_installed):
    h = _history(_graph(small_graph, workdir, backend="vllm", steps=2), "ray", 2)
    _assert_engine_has_trainer_weights(h, 2)


def test_without_sync_the_check_catches_stale_weights(workdir, small_graph, monkeypatch):
    """Negative control: the same disaggregated run (in-process) with weight import disabled."""
    monkeypatch.setattr(StageWorker, "import_weights", lambda self, model, weights, version=None: 0.0)
    h = _history(_graph(small_graph, workdir, backend="hf", steps=2, disaggregated=True), "local", 2)
    assert h[METRIC][0] < 1e-4  # step 1: nobody has updated yet
    print(f"\nwithout sync: {METRIC}: {h[METRIC]}")
    assert h[METRIC][1] > 1e-3, h[METRIC]  # step 2: the rollout actor still has step-0 weights


@pytest.mark.shared_ray
def test_disaggregated_vllm_takes_broadcast_weights_on_ray(workdir, small_graph):
    """The default sync between actors: the trainer broadcasts buckets over a gloo bus straight
    into the vLLM engine's in-memory reload (models.weight_bus)."""
    h = _history(_graph(small_graph, workdir, backend="vllm", steps=3, disaggregated=True), "ray", 3)
    _assert_engine_has_trainer_weights(h, 3)


@pytest.mark.shared_ray
def test_disaggregated_hf_syncs_weights_between_actors_both_ways_alike(workdir, small_graph):
    """Between hf actors on Ray, the broadcast (the default) and the object store each bring the
    rollout actor the trainer's weights, and carry them exactly: every metric of the run is the
    same."""
    path = _graph(small_graph, workdir, backend="hf", steps=2, disaggregated=True)
    from dapo_flow.graph.edits import edit_file, parse_cli_edits

    runs = {}
    for how in ("broadcast", "object-store"):
        placed = edit_file(path, parse_cli_edits([("set", f"models.policy.rollout.weight_sync={how}")])).compile(CLUSTER)
        summary = execute(placed, executor="ray")
        history = read_run(summary["tracking_uri"], summary["run_id"])["history"]
        runs[how] = {key: [v for _, v in points] for key, points in history.items()}
        _assert_engine_has_trainer_weights(runs[how], 2)
    keys = [k for k in runs["broadcast"] if k.startswith(("actor/", "batch/", "val/", "check/"))]
    assert "actor/pg_loss" in keys and METRIC in keys
    for key in keys:
        assert runs["broadcast"][key] == runs["object-store"][key], key
