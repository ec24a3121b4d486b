"""Checkpoints on CUDA: a run checkpointed on the GPU resumes there with the figures of the run
that did not stop; its checkpoint holds host tensors only, and resumes on a machine without a GPU;
a checkpoint written without a GPU resumes on one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpu_runs import cli_without_gpu, devices_of, history, run_graph, small_graph

pytestmark = pytest.mark.gpu


def _printed(logged: dict, key: str) -> list[tuple[int, str]]:
    return [(step, f"{value:.3f}") for step, value in logged[key]]


def _checkpoints(workdir: Path, run_id: str) -> list[Path]:
    return sorted((workdir / "dapo-flow-runs" / "checkpoints").glob(f"*/{run_id}/step_*"))


def _run_id_of_the_only_run(workdir: Path) -> str:
    from dapo_flow.tracking import search_runs

    [run] = search_runs(f"sqlite:///{workdir / 'dapo-flow-runs' / 'mlflow.db'}", "gpu-tests")
    return run["run_id"]


def test_a_run_resumes_on_the_gpu_as_if_it_had_not_stopped(workdir, quiet, device, policies):
    straight, _ = run_graph(small_graph(workdir, name="straight", steps=4, ckpt=2), [], console=quiet)
    path = small_graph(workdir, name="stopped", steps=4, ckpt=2)
    first, _ = run_graph(path, [], steps=2, console=quiet)
    resumed, _ = run_graph(path, [], resume=first["run_id"], console=quiet)
    assert resumed["run_id"] == first["run_id"] and resumed["steps"] == 4
    assert policies and devices_of(policies) == {device.type}
    a, b = history(straight), history(resumed)
    for key in ("batch/reward_mean", "val/acc", "actor/pg_loss", "actor/entropy"):
        assert [s for s, _ in b[key]] == [s for s, _ in a[key]], key  # each step logged once
        assert _printed(b, key) == _printed(a, key), key


def test_a_checkpoint_written_on_the_gpu_holds_host_tensors_and_resumes_without_a_gpu(workdir, quiet, device):
    path = small_graph(workdir, steps=3, ckpt=2)
    first, _ = run_graph(path, [], steps=2, console=quiet)
    [step] = _checkpoints(workdir, first["run_id"])
    ops = torch.load(step / "ops.pt", weights_only=False)  # no map_location: tensors land where they were
    tensors = []

    def walk(value) -> None:
        if isinstance(value, torch.Tensor):
            tensors.append(value)
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)

    walk(ops)
    assert tensors and {t.device.type for t in tensors} == {"cpu"}  # the optimizer's state included

    done = cli_without_gpu(["run", str(path), "--executor", "local", "--resume", first["run_id"]], workdir)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    logged = history(first)  # the same MLflow run, trained on by the other process
    assert [s for s, _ in logged["batch/reward_mean"]] == [1, 2, 3]
    assert [s for s, _ in logged["val/acc"]] == [0, 2, 3]


def test_a_checkpoint_written_without_a_gpu_resumes_on_it(workdir, quiet, device, policies):
    path = small_graph(workdir, steps=3, ckpt=2)
    done = cli_without_gpu(["run", str(path), "--executor", "local", "--steps", "2"], workdir)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_id = _run_id_of_the_only_run(workdir)
    resumed, _ = run_graph(path, [], resume=run_id, console=quiet)
    assert resumed["run_id"] == run_id and resumed["steps"] == 3
    assert devices_of(policies) == {device.type}
    assert [s for s, _ in history(resumed)["batch/reward_mean"]] == [1, 2, 3]
