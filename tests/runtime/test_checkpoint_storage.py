"""Outages of the storage checkpoints go to: a disk that fills (a write the kernel refuses, a
writer's ENOSPC, on the driver or inside an actor), a folder that turns read-only or vanishes
mid-run. The previous checkpoint stays whole, the error names the checkpoint, the cause and the
fix, and a run goes on past a few failed checkpoints, trying again at the next one (it stops at
its final checkpoint and beyond run.max_failures in a row)."""

from __future__ import annotations

import errno
import io
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from rich.console import Console

from dapo_flow.errors import ActorFault, CheckpointWriteError, RunError
from dapo_flow.runtime import checkpoint, session
from dapo_flow.runtime.driver_state import DriverState

ROOT = Path(__file__).resolve().parents[2]
DRIVER = DriverState(step=1, mlflow_run_id="0123", sampler={}, trained_models=["policy"])


def _save(root: Path, step: int, ops: dict | None = None) -> Path:
    def save_models(out: Path) -> None:
        (out / "policy").mkdir()
        (out / "policy" / "config.json").write_text("{}")

    return checkpoint.save(root, step, driver=DRIVER, op_states=ops or {}, save_models=save_models)


def _ray_task_error(cause: Exception) -> RunError:
    """What the Ray executor raises when an actor's call failed with ``cause`` (executors._get)."""
    from ray.exceptions import RayTaskError

    wrapped = RayTaskError("StageWorker.save_models", "Traceback ...", cause).as_instanceof_cause()
    try:
        raise RunError("an operator failed inside an actor: ...") from wrapped
    except RunError as exc:
        return exc


@pytest.mark.parametrize("exc, code", [
    (OSError(errno.ENOSPC, "No space left on device"), errno.ENOSPC),
    (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"), None),  # torch.save's
    (Exception("Error while serializing: I/O error: Read-only file system (os error 30)"), errno.EROFS),  # safetensors'
    ("ray", errno.EDQUOT),  # inside an actor, through Ray
    (ActorFault("the actor of stage 'model:policy' died"), False),  # a fault to recover from
    (ValueError("a bug"), False),
])
def test_what_counts_as_the_storage_failing(exc, code):
    if exc == "ray":
        exc = _ray_task_error(OSError(errno.EDQUOT, "Disk quota exceeded"))
    got = checkpoint.write_failure(exc)
    assert got is code if code in (None, False) else got == code


class FakeFullDisk:
    """A save_models whose writer gets ENOSPC half-way through (a disk that fills)."""

    def __call__(self, out: Path) -> None:
        (out / "policy").mkdir()
        (out / "policy" / "model.safetensors").write_bytes(b"\0" * 1024)
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_disk_that_fills_leaves_the_previous_checkpoint_whole(tmp_path):
    first = _save(tmp_path, 1)
    with pytest.raises(CheckpointWriteError) as info:
        checkpoint.save(tmp_path, 2, driver=DRIVER, op_states={}, save_models=FakeFullDisk())
    err = info.value
    assert str(err).startswith(f"could not write checkpoint {tmp_path / 'step_000002'}: No space left on device (")
    assert "MiB free on its disk)" in err.why and f"the previous checkpoint is {first} (intact)" in str(err)
    assert err.fix == f"free space under {tmp_path} (run.keep_checkpoints bounds it)"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001"]  # nothing half-written
    assert checkpoint.verify(first) is None


def test_a_write_the_kernel_refuses_is_a_clear_error_too(tmp_path):
    """A real refused write (the file-size limit: EFBIG, as a full disk refuses one), where
    torch.save raises a RuntimeError without an errno."""
    first = _save(tmp_path, 1)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
    try:
        with pytest.raises(CheckpointWriteError, match=r"step_000002: the write failed \(\d+ MiB free on its disk\)"):
            _save(tmp_path, 2, ops={"big": torch.zeros(1 << 19)})  # 2 MiB
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001"] and checkpoint.verify(first) is None


def test_a_folder_that_vanished_mid_write_says_so(tmp_path):
    root = tmp_path / "run"

    def vanishes(out: Path) -> None:
        import shutil

        shutil.rmtree(root)
        raise OSError(errno.ENOENT, "No such file or directory")

    with pytest.raises(CheckpointWriteError, match=r"does not exist \(intact\)\n    fix: check that .*run stays "
                                                   r"there \(deleted while the run wrote it\? a disk unmounted\?\)"):
        checkpoint.save(root, 1, driver=DRIVER, op_states={}, save_models=vanishes)


# --- what the run does about it ------------------------------------------------------------


class FakeStorage:
    """Stands for session._checkpoint: writes a real checkpoint, or fails as a full disk would at
    the given steps."""

    def __init__(self, root: Path, failing: set[int]):
        self.root, self.failing = root, failing

    def __call__(self, runner, state, tracker, root, pending, ahead) -> Path:
        if state.step in self.failing:
            raise CheckpointWriteError("could not write ...", path=checkpoint.step_dir(root, state.step),
                                       why="No space left on device", fix=f"free space under {root}")
        return _save(root, state.step)


def _record(root: Path) -> tuple[session.RunRecord, io.StringIO]:
    out = io.StringIO()
    record = session.RunRecord(tracker=None, root=root, console=Console(file=out, width=400), ctrl_c=None,
                               logged={}, graph_hash="h")
    return record, out


def _checkpoints(record, steps: range, total: int, max_failures: int = 2) -> None:
    runner = SimpleNamespace(run=SimpleNamespace(max_failures=max_failures, checkpoint_every=2))
    for step in steps:
        record.checkpoint(runner, SimpleNamespace(step=step), [], [], total=total)


def test_the_run_goes_on_past_a_failed_checkpoint_and_stops_beyond_max_failures(tmp_path, monkeypatch):
    monkeypatch.setattr(session, "_checkpoint", FakeStorage(tmp_path, failing={4, 6, 10, 12, 14}))
    record, out = _record(tmp_path)
    _checkpoints(record, range(2, 13, 2), total=20)  # 4 fails, 8 written again, 10 and 12 fail
    said = out.getvalue()
    assert said.count("could not write checkpoint") == 4
    assert (f"could not write checkpoint {tmp_path / 'step_000004'}: No space left on device; the previous one, "
            f"{tmp_path / 'step_000002'}, is intact\n    fix: free space under {tmp_path}\n    the run goes on and "
            "tries again at step 6 (1 failed in a row; it stops after 2: run.max_failures)") in said
    assert "tries again at step 8 (2 failed in a row" in said and "tries again at step 12 (1 failed" in said
    with pytest.raises(CheckpointWriteError):  # a third in a row
        _checkpoints(record, [14], total=20)
    assert record.written == tmp_path / "step_000008"


def test_the_final_checkpoint_failing_stops_the_run(tmp_path, monkeypatch):
    monkeypatch.setattr(session, "_checkpoint", FakeStorage(tmp_path, failing={4}))
    with pytest.raises(CheckpointWriteError):
        _checkpoints(_record(tmp_path)[0], [2, 4], total=4)  # the run's result would be lost unsaid


def test_max_failures_0_stops_at_the_first(tmp_path, monkeypatch):
    monkeypatch.setattr(session, "_checkpoint", FakeStorage(tmp_path, failing={2}))
    with pytest.raises(CheckpointWriteError):
        _checkpoints(_record(tmp_path)[0], [2], total=10, max_failures=0)


def test_a_vanished_checkpoint_is_said_and_written_anew(tmp_path, monkeypatch):
    import shutil

    monkeypatch.setattr(session, "_checkpoint", FakeStorage(tmp_path / "run", failing=set()))
    record, out = _record(tmp_path / "run")
    _checkpoints(record, [2], total=10)
    shutil.rmtree(tmp_path / "run")
    _checkpoints(record, [4], total=10)
    assert (f"checkpoint {tmp_path / 'run' / 'step_000002'} is gone (its folder deleted? its disk unmounted?): "
            "the run has nothing to resume from until step 4's is written") in out.getvalue().replace("\n", " ")
    assert record.written == tmp_path / "run" / "step_000004" and checkpoint.verify(record.written) is None


# --- a real run: its checkpoint folder deleted, then made read-only --------------------------

WATCHER = """
import glob, os, shutil, subprocess, sys, threading, time

def wait_for(step):
    while not glob.glob(f"dapo-flow-runs/checkpoints/*/*/step_{step:06d}/manifest.json"):
        time.sleep(0.01)
    return os.path.dirname(glob.glob(f"dapo-flow-runs/checkpoints/*/*/step_{step:06d}")[0])

def outages():
    shutil.rmtree(wait_for(1))  # the run's checkpoint folder deleted
    run = wait_for(2)
    if os.geteuid() == 0:  # root writes through file modes: a read-only mount (this process's own)
        subprocess.run(["mount", "--bind", run, run], check=True)
        subprocess.run(["mount", "-o", "remount,bind,ro", run], check=True)
    else:
        os.chmod(run, 0o555)

threading.Thread(target=outages, daemon=True).start()
from dapo_flow import cli
sys.exit(cli.main(["run", sys.argv[1], "--executor", "local"]))
"""


def _read_only_possible() -> list[str]:
    """The command prefix that gives the run a mount namespace of its own (as root), or []."""
    if os.geteuid() != 0:
        return []
    if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip("running as root without mount namespaces: nothing is read-only to root")
    return ["unshare", "-m", "--propagation", "private"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_run_whose_checkpoint_folder_vanishes_then_turns_read_only(workdir, small_graph):
    """Step 1's checkpoint deleted with its folder: step 2's is written anew. The folder then
    read-only: checkpoints 3 and 4 fail and the run goes on, the final one (5) stops it with the
    fix; once writable again, --resume finishes from step 2 with every step in MLflow once."""
    from dapo_flow.tracking import read_run

    path = small_graph(workdir, name="outage", steps=5, ckpt=1)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "300"}
    first = subprocess.run([*_read_only_possible(), sys.executable, "-c", WATCHER, str(path)], cwd=workdir,
                           capture_output=True, text=True, timeout=500, env=env)
    said = " ".join((first.stdout + first.stderr).split())
    assert first.returncode == 2, said[-3000:]
    assert "Traceback" not in said
    [run] = list((workdir / "dapo-flow-runs" / "checkpoints").glob("*/*"))
    os.chmod(run, 0o755)  # writable again (as root the read-only mount ended with the process)
    assert f"checkpoint {run / 'step_000001'} is gone" in said and "until step 2's is written" in said
    for step, again in ((3, 4), (4, 5)):
        assert f"could not write checkpoint {run / f'step_{step:06d}'}: " in said
        assert f"the run goes on and tries again at step {again}" in said
    assert f"the previous one, {run / 'step_000002'}, is intact" in said
    assert f"error: could not write checkpoint {run / 'step_000005'}" in said and f"make {run} writable" in said
    assert sorted(p.name for p in run.iterdir()) == ["step_000002"]

    again = subprocess.run([sys.executable, "-m", "dapo_flow.cli", "run", str(path), "--executor", "local",
                            "--resume"], cwd=workdir, capture_output=True, text=True, timeout=500, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    history = read_run(f"sqlite:///{workdir / 'dapo-flow-runs' / 'mlflow.db'}", run.name)["history"]  # folder: run id
    for key in ("batch/reward_mean", "actor/pg_loss"):
        assert [s for s, _ in history[key]] == [1, 2, 3, 4, 5], key
