"""Checkpoints one folder per run, checked by a manifest: `--resume` picks the right run
(the newest unfinished one, or the one named), falls back past a damaged checkpoint with
every step still logged once, and a write or load that fails says why and what to do."""

from __future__ import annotations

import errno
import io
import json
import os

import pytest
from rich.console import Console

from dapo_flow.graph.compiler import compile_graph
from dapo_flow.errors import ModelError, RunError
from dapo_flow.graph.plan import Cluster
from dapo_flow.runtime import checkpoint, execute
from dapo_flow.runtime.driver_state import DriverState
from dapo_flow.runtime.loop import Runner
from dapo_flow.runtime.resume import checkpoint_root
from dapo_flow.tracking import default_tracking_uri, read_run

CLUSTER = Cluster(cpus=2)
# a checkpoint every step: the newest (2) damaged falls back to the one before it (1), the fewest
# steps that show a fallback and an exact replay of a step logged once
STEPS = 3
CKPT = 1
DIE_AFTER = 2  # the damaged-checkpoint runs die here, with steps 1-2 in MLflow


class _Crash(BaseException):
    """Stands for the process dying (OOM kill, preemption)."""


def _deterministic(history: dict) -> dict:
    return {k: v for k, v in history.items()
            if not k.startswith(("time/", "perf/")) and k not in ("gen/seconds", "gen/tokens_per_s")}


def _quiet() -> Console:
    return Console(file=io.StringIO(), width=400)


def _run_and_die(placed, after: int) -> None:
    """Run ``placed`` until it dies starting step ``after + 1``: steps up to ``after`` logged
    and checkpointed (as far as checkpoint_every goes), the MLflow run marked FAILED."""
    collect = Runner.collect

    def collect_or_die(self, state):
        if state.step == after:
            raise _Crash()
        return collect(self, state)

    with pytest.MonkeyPatch.context() as mp, pytest.raises(_Crash):
        mp.setattr(Runner, "collect", collect_or_die)
        execute(placed, executor="local", console=_quiet())


@pytest.fixture(scope="module")
def straight(tmp_path_factory, small_graph, tiny_adder_path) -> dict:
    """Deterministic metric histories of the STEPS-step graph run straight through."""
    where = tmp_path_factory.mktemp("straight")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(where)
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        summary = execute(compile_graph(small_graph(where, steps=STEPS, ckpt=CKPT), CLUSTER),
                          executor="local", console=_quiet())
        return _deterministic(read_run(summary["tracking_uri"], summary["run_id"])["history"])


def _truncate(path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


# driver.json in the fast tier; the other files take the same fallback path (whole suite)
@pytest.mark.parametrize("damaged", [pytest.param("models/policy/model.safetensors", marks=pytest.mark.slow),
                                     pytest.param("ops.pt", marks=pytest.mark.slow), "driver.json"])
def test_a_damaged_newest_checkpoint_falls_back_and_logs_each_step_once(
        workdir, small_graph, straight, damaged):
    path = small_graph(workdir, steps=STEPS, ckpt=CKPT)
    placed = compile_graph(path, CLUSTER)
    _run_and_die(placed, DIE_AFTER)
    [run_folder] = checkpoint_root(placed.plan.spec).iterdir()
    newest = checkpoint.step_dir(run_folder, DIE_AFTER)
    _truncate(newest / damaged)
    assert "truncated" in checkpoint.verify(newest)

    console = _quiet()
    summary = execute(placed, executor="local", resume=True, console=console)
    out = console.file.getvalue()
    assert f"checkpoint {newest} is damaged ({damaged} is" in out and "falling back" in out
    assert "resuming from" in out and "step_000001" in out and "Traceback" not in out  # the one before
    assert summary["run_id"] == run_folder.name
    run = read_run(summary["tracking_uri"], summary["run_id"])
    assert run["status"] == "FINISHED"
    for key in ("batch/reward_mean", "actor/pg_loss"):  # step 2 ran twice, logged once
        assert [s for s, _ in run["history"][key]] == list(range(1, STEPS + 1)), key
    assert [s for s, _ in run["history"]["val/acc"]] == [0, 2, 3]  # val_every 2, and the last step
    assert _deterministic(run["history"]) == straight  # the replay is exact
    assert (run_folder / f"{checkpoint.DAMAGED_PREFIX}{newest.name}" / damaged).is_file()  # kept aside
    assert checkpoint.verify(newest) is None  # written again, whole


def test_every_checkpoint_damaged_is_a_clear_error(workdir, small_graph):
    path = small_graph(workdir, steps=4, ckpt=2)
    _run_and_die(compile_graph(path, CLUSTER), 2)
    [only] = checkpoint_root(compile_graph(path, CLUSTER).plan.spec).glob("*/step_000002")
    (only / checkpoint.OPS_FILE).write_bytes(b"")
    with pytest.raises(RunError, match=r"every checkpoint under .* is damaged:\n.*ops.pt is 0 bytes.*"
                                       r"\n    fix: run without --resume"):
        execute(compile_graph(path, CLUSTER), executor="local", resume=True, console=_quiet())


def test_resume_by_run_id_and_its_errors(workdir, small_graph):
    """`--resume RUN_ID`: a run of another graph, an unknown id or a FINISHED run with nothing
    left to train are clear errors; a killed run named by id continues."""
    small = compile_graph(small_graph(workdir, steps=2, ckpt=2), CLUSTER)
    other = compile_graph(small_graph(workdir, name="other", steps=2, ckpt=2), CLUSTER)
    finished = execute(small, executor="local", console=_quiet())
    foreign = execute(other, executor="local", console=_quiet())

    def resume(run_id, **kw):
        return execute(small, executor="local", resume=run_id, console=_quiet(), **kw)

    with pytest.raises(RunError, match=rf"run {foreign['run_id']} has no checkpoint of graph 'small'.*"
                                       r"it is a run of graph 'other'"):
        resume(foreign["run_id"])
    with pytest.raises(RunError, match=r"has no run 0123abc.*\n    fix: check the id.*\n    runs of this "
                                       rf"graph with checkpoints: {finished['run_id']} \(step 2, FINISHED\)"):
        resume("0123abc")
    with pytest.raises(RunError, match=r"FINISHED at step 2, and this run trains to step 2\n.*--steps N"):
        resume(finished["run_id"])
    with pytest.raises(RunError, match=r"no unfinished run of graph 'small'.*\n      "
                                       rf"{finished['run_id']} \(step 2, FINISHED\)\n.*--resume RUN_ID --steps N"):
        execute(small, executor="local", resume=True, console=_quiet())

    _run_and_die(small, 1)  # a run that dies before its first checkpoint has none to resume
    with pytest.raises(RunError, match="no unfinished run"):
        execute(small, executor="local", resume=True, console=_quiet())
    assert resume(finished["run_id"], steps=3)["steps"] == 3  # trained further, by id


def test_checkpoints_of_the_older_layout_are_read_as_their_runs(workdir, small_graph):
    """Before one folder per run, checkpoints sat in the graph's folder without a manifest:
    --resume continues the run they name (moving them into its folder) and eval finds them."""
    from dapo_flow.experiments.evaluate import resolve_checkpoint

    path = small_graph(workdir, steps=4, ckpt=2)
    placed = compile_graph(path, CLUSTER)
    _run_and_die(placed, 2)
    root = checkpoint_root(placed.plan.spec)
    [run_folder] = root.iterdir()
    (run_folder / "step_000002" / checkpoint.MANIFEST_FILE).unlink()
    (run_folder / "step_000002").rename(root / "step_000002")  # the older layout
    run_folder.rmdir()
    assert resolve_checkpoint(placed.plan.spec, "latest")[0] == root / "step_000002"

    summary = execute(placed, executor="local", resume=True, console=_quiet())
    assert summary["run_id"] == run_folder.name and summary["steps"] == 4
    assert sorted(p.name for p in run_folder.iterdir()) == ["step_000002", "step_000004"]
    history = read_run(summary["tracking_uri"], summary["run_id"])["history"]
    assert [s for s, _ in history["batch/reward_mean"]] == [1, 2, 3, 4]


@pytest.mark.parametrize("code, fix", [
    (errno.EROFS, "make .* writable \\(its permissions, or a read-only filesystem\\)"),
    (errno.EACCES, "make .* writable"),
    (errno.ENOSPC, "free space under .*keep_checkpoints"),
    (errno.EDQUOT, "free space under"),
])
def test_a_failed_checkpoint_write_gets_the_hint_of_its_cause(tmp_path, code, fix):
    def save_models(out):
        raise OSError(code, "injected")

    with pytest.raises(RunError, match=rf"could not write checkpoint .*step_000003: {os.strerror(code)}.*\n.*does not "
                                       rf"exist.*\n    fix: {fix}"):
        checkpoint.save(tmp_path, 3, driver=DRIVER, op_states={}, save_models=save_models)
    assert list(tmp_path.iterdir()) == []  # nothing half-written left


def _fake_checkpoint(root, config_text: str):
    def save_models(out):
        (out / "policy").mkdir()
        (out / "policy" / "config.json").write_text(config_text)

    return checkpoint.save(root, 1, driver=DRIVER, op_states={}, save_models=save_models)


DRIVER = DriverState(step=1, mlflow_run_id="0123", sampler={}, trained_models=["policy"])


def test_the_manifest_finds_a_changed_or_missing_file(tmp_path):
    step = _fake_checkpoint(tmp_path, json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert checkpoint.verify(step) is None
    config = step / "models" / "policy" / "config.json"
    config.write_text(config.read_text().replace("Llama", "Gemma"))  # same size, other bytes
    assert checkpoint.verify(step) == "models/policy/config.json differs from what was written (checksum mismatch)"
    config.unlink()
    assert checkpoint.verify(step) == "models/policy/config.json is missing"
    (step / checkpoint.MANIFEST_FILE).write_text("{")
    assert checkpoint.verify(step).startswith("manifest.json is unreadable")


@pytest.mark.parametrize("config_text", ["", "{}", '{"architectures": ["BertModel"]}'])
def test_a_checkpoint_model_that_does_not_load_says_the_checkpoint_is_damaged(tmp_path, config_text):
    from dapo_flow.models import resolve_model

    step = _fake_checkpoint(tmp_path, config_text)
    with pytest.raises(ModelError) as err:
        resolve_model(str(step / "models" / "policy"))
    text = str(err.value)
    assert f"checkpoint {step} is damaged" in text and "falls back" in text and "path:" not in text


def test_the_progress_bar_shows_the_reward_the_step_has():
    from dapo_flow.runtime.session import _progress_info

    assert _progress_info({"batch/reward_mean": 0.25, "score/mean": 0.5}, 0.5) == "reward +0.250  val acc 0.500"
    assert _progress_info({"score/mean": -0.5}, None) == "score -0.500"  # GRPO: no group filter
    assert _progress_info({"sampling/skipped": 1.0}, None) == ""  # nothing to show, no +nan
    assert _progress_info({"batch/reward_mean": float("nan")}, 0.25) == "val acc 0.250"


def test_a_run_another_process_is_training_is_not_resumed_twice(workdir, small_graph):
    """Two processes resuming one run would interleave its checkpoints and metrics: the second
    is refused (exit 2 message) and leaves the run's MLflow status alone."""
    import subprocess
    import sys

    from dapo_flow.runtime.resume import owner_lock

    small = compile_graph(small_graph(workdir, steps=2, ckpt=2), CLUSTER)
    run_id = execute(small, executor="local", console=_quiet())["run_id"]
    lock = owner_lock(checkpoint_root(small.plan.spec) / run_id)
    assert lock.is_file()  # the first run held it; it ended, so it is free now
    holder = subprocess.Popen(  # another process training the run, as far as the lock says
        [sys.executable, "-c", f"import filelock, sys; held = filelock.FileLock({str(lock)!r}); held.acquire(); "
                               "print('held', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunError, match=rf"run {run_id} is being trained by another dapo-flow process"):
            execute(small, executor="local", resume=run_id, steps=3, console=_quiet())
        assert read_run(default_tracking_uri(), run_id)["status"] == "FINISHED"
    finally:
        holder.kill()
        holder.wait()
    assert execute(small, executor="local", resume=run_id, steps=3, console=_quiet())["steps"] == 3
