"""The runtime in-process (--executor local): a real short run, MLflow read back, resume,
determinism and the dynamic-sampling cap policies."""

from __future__ import annotations

import pytest

from dapo_flow.graph.compiler import compile_graph
from dapo_flow.errors import RunError
from dapo_flow.graph.plan import Call, Cluster
from dapo_flow.runtime import execute
from dapo_flow.tracking import read_run

CLUSTER = Cluster(cpus=2)


def _run(path, **kw):
    return execute(compile_graph(path, CLUSTER), executor="local", **kw)


def test_short_run_is_tracked_in_mlflow(workdir, small_graph):
    summary = _run(small_graph(workdir, steps=3, ckpt=2))
    run = read_run(summary["tracking_uri"], summary["run_id"])
    assert run["status"] == "FINISHED"
    assert run["params"]["nodes.train.params.lr"] == "0.0001"
    assert run["params"]["graph_hash"] == summary["graph_hash"]
    assert "version.torch" in run["params"]
    assert run["tags"]["graph"] == "small"
    assert run["tags"]["ops"].split(",")[0] == "generate"
    steps = [s for s, _ in run["history"]["batch/reward_mean"]]
    assert steps == [1, 2, 3]  # each step exactly once
    assert [s for s, _ in run["history"]["val/acc"]] == [0, 2, 3]
    for key in ("actor/pg_loss", "actor/clipfrac", "actor/clipfrac_lower", "actor/ppo_kl",
                "actor/grad_norm", "actor/entropy", "actor/lr", "sampling/gen_batches",
                "sampling/kept_groups", "time/rollout", "time/weight_sync", "perf/tokens_per_s",
                "batch/response_len_mean", "batch/overlong_frac", "overlong/penalty_mean"):
        assert key in run["metrics"], key
    assert {"graph", "samples"} <= set(run["artifacts"])
    assert summary["steps"] == 3 and summary["samples_generated"] > 0


def test_validation_with_several_samples_logs_pass_at_k(workdir, small_graph):
    summary = _run(small_graph(workdir, steps=2, ckpt=0, val_n=4, val_temp=1.0))
    history = read_run(summary["tracking_uri"], summary["run_id"])["history"]
    assert [s for s, _ in history["val/pass_at_4"]] == [0, 2] == [s for s, _ in history["val/pass_at_2"]]
    for (_, acc), (_, p2), (_, p4) in zip(history["val/acc"], history["val/pass_at_2"], history["val/pass_at_4"]):
        assert 0.0 <= acc <= p2 <= p4 <= 1.0  # avg@4 <= pass@2 <= pass@4
    assert any(p4 > acc for (_, acc), (_, p4) in zip(history["val/acc"], history["val/pass_at_4"]))


def test_same_seed_same_metrics_and_colocated_hf_rollout_skips_the_weight_sync_call(workdir, small_graph,
                                                                                      monkeypatch):
    """Two runs of one seed log the same numbers. And HF rollout samples from the trained policy
    itself: no sync call per step (a Ray round trip for nothing); a separate engine (vLLM,
    tests/runtime/test_vllm_run.py) still syncs."""
    from dapo_flow.runtime.worker import StageWorker

    calls = []
    monkeypatch.setattr(StageWorker, "sync_generators", lambda self: calls.append(1) or 0.0)
    a = _run(small_graph(workdir, name="a", steps=2, ckpt=0))
    b = _run(small_graph(workdir, name="b", steps=2, ckpt=0))
    assert a["steps"] == b["steps"] == 2 and calls == []
    ha = read_run(a["tracking_uri"], a["run_id"])["history"]
    hb = read_run(b["tracking_uri"], b["run_id"])["history"]
    for key in ("batch/reward_mean", "actor/pg_loss", "actor/grad_norm", "val/acc"):
        assert ha[key] == hb[key], key


def test_keep_checkpoints_prunes_the_oldest_and_resume_still_works(workdir, small_graph):
    from dapo_flow.runtime.setup import graph_hash
    from dapo_flow.tracking import runs_dir

    path = small_graph(workdir, steps=4, ckpt=1, keep=2)
    first = _run(path)
    [root] = (runs_dir() / "checkpoints").iterdir()
    root = root / first["run_id"]  # the run's own folder
    assert sorted(p.name for p in root.glob("step_*")) == ["step_000003", "step_000004"]
    resumed = _run(path, resume=first["run_id"], steps=5)
    assert resumed["run_id"] == first["run_id"]
    assert sorted(p.name for p in root.glob("step_*")) == ["step_000004", "step_000005"]
    # retention (like the step count) is not part of the graph's identity: resume finds it
    (workdir / "other").mkdir()
    other = small_graph(workdir / "other", steps=9, ckpt=1, keep=None)
    changed = small_graph(workdir / "other", name="changed", steps=4, ckpt=1, keep=2)
    spec = lambda p: compile_graph(p, CLUSTER).plan.spec  # noqa: E731
    assert graph_hash(spec(other)) == graph_hash(spec(path)) != graph_hash(spec(changed))


def test_resume_without_checkpoint_is_a_clear_error(workdir, small_graph):
    with pytest.raises(RunError, match="nothing to resume"):
        _run(small_graph(workdir), resume=True)


def test_resume_of_a_changed_graph_says_what_changed_and_undone_continues_the_same_run(workdir, small_graph):
    """A changed graph's resume names the change; undone, the FINISHED run, named by id, is
    trained further in the same run, each step logged once."""
    path = small_graph(workdir, steps=2, ckpt=2)
    first = _run(path)
    path.write_text(path.read_text().replace("lr: 1.0e-4", "lr: 5.0e-5").replace("steps: 2", "steps: 4"))
    with pytest.raises(RunError) as err:
        _run(path, resume=True)
    text = str(err.value)
    assert "nothing to resume" in text and "changed since its checkpoint" in text and "step_000002" in text
    assert "train.lr: 0.0001 -> 5e-05" in text and "run.steps" not in text  # steps may change
    assert "undo these changes" in text
    path.write_text(path.read_text().replace("lr: 5.0e-5", "lr: 1.0e-4"))
    resumed = _run(path, resume=first["run_id"])  # undone: the checkpoint is found again
    assert resumed["steps"] == 4 and resumed["run_id"] == first["run_id"]
    history = read_run(resumed["tracking_uri"], resumed["run_id"])["history"]
    assert [s for s, _ in history["batch/reward_mean"]] == [1, 2, 3, 4]


def _constant_metric_graph(small_graph, workdir, on_cap):
    # correct == wrong: every group has zero score spread, so dynamic sampling keeps nothing
    return small_graph(workdir, metric="score", wrong=1.0, cap=2, on_cap=on_cap, steps=2, ckpt=0)


def test_cap_error_says_what_to_change(workdir, small_graph):
    with pytest.raises(RunError, match=r"kept 0/4 prompt groups after 2 generation batches.*max_gen_batches"):
        _run(_constant_metric_graph(small_graph, workdir, "error"))


@pytest.mark.parametrize("policy", ["skip-step", "train-on-what-we-have"])
def test_cap_skip_policies_log_skipped_steps(workdir, small_graph, policy):
    summary = _run(_constant_metric_graph(small_graph, workdir, policy))
    history = read_run(summary["tracking_uri"], summary["run_id"])["history"]
    assert [v for _, v in history["sampling/skipped"]] == [1.0, 1.0]
    assert "actor/pg_loss" not in history  # nothing was trained


def test_reference_model_kl_in_reward_and_overlong_filter(workdir, small_graph):
    """A frozen reference in its own model, the `kl` node (adaptive) and `overlong-filter`,
    inserted as edits; the adaptive coefficient survives a resume."""
    from dapo_flow.graph.edits import edit_file, parse_cli_edits

    flags = [("set", "models.ref.path=builtin:tiny-adder"), ("insert", "ref:logprob:after=old_logp:model=ref"),
             ("set", "ref.role=ref"), ("insert", "kl:kl:after=ref"), ("set", "kl.target_kl=0.001"),
             ("set", "kl.horizon=10"), ("insert", "filt:overlong-filter:after=kl"), ("set", "train.kl_coef=0.01")]
    placed = edit_file(small_graph(workdir, steps=3, ckpt=2), parse_cli_edits(flags)).compile(CLUSTER)
    first = execute(placed, executor="local", steps=2)
    resumed = execute(placed, executor="local", resume=first["run_id"], steps=3)
    run = read_run(resumed["tracking_uri"], resumed["run_id"])
    coef = [v for _, v in run["history"]["kl/coef"]]
    assert resumed["run_id"] == first["run_id"] and len(coef) == 3
    assert coef[0] == pytest.approx(0.001) and coef[1] != coef[0] and coef[2] != coef[1]  # adapted, resumed
    # the filter masks the truncated rows: each step, the truncated fraction of the batch it trains
    masked = run["history"]["overlong_filter/masked_frac"]
    assert [s for s, _ in masked] == [1, 2, 3]
    assert masked == [(s, pytest.approx(v)) for s, v in run["history"]["batch/overlong_frac"]]
    assert any(v != 0 for _, v in run["history"]["actor/kl_loss"])  # the loss term sees ref_logp too
    assert run["params"]["nodes.train.params.loss_mask"] == "use"  # resolved params are logged
    assert run["params"]["nodes.adv.params.reward_column"] == "reward"


def test_auto_generation_batches_resume_exactly(workdir, small_graph):
    """gen_prompts_per_batch: auto sizes batches from the keep rate, which is checkpointed:
    2 steps + resume to 3 log the same numbers as 3 steps straight (the resumed step sized from
    the checkpointed rate)."""
    from dapo_flow.graph.edits import edit_file, parse_cli_edits

    def placed(name):
        path = small_graph(workdir, name=name, steps=3, ckpt=2)
        return edit_file(path, parse_cli_edits([("set", "run.gen_prompts_per_batch=auto")])).compile(CLUSTER)

    straight = execute(placed("straight"), executor="local")
    p = placed("resumed")
    first = execute(p, executor="local", steps=2)
    resumed = execute(p, executor="local", resume=first["run_id"])
    a = read_run(straight["tracking_uri"], straight["run_id"])["history"]
    b = read_run(resumed["tracking_uri"], resumed["run_id"])["history"]
    for key in ("sampling/keep_rate", "sampling/samples_generated", "batch/reward_mean", "actor/pg_loss"):
        assert a[key] == b[key], key
    assert [s for s, _ in a["sampling/keep_rate"]] == [1, 2, 3]
    assert all(0 < v <= 1 for _, v in a["sampling/keep_rate"])


def test_ctrl_c_swallowed_by_a_finalizer_still_stops_the_run():
    """Python drops a KeyboardInterrupt raised inside a weakref callback / __del__; the loop's
    check at the next step boundary raises it again."""
    from dapo_flow.runtime.interrupts import CtrlC

    with CtrlC() as ctrl_c:
        ctrl_c.check()  # nothing pressed: no-op
        try:
            ctrl_c._handle(2, None)  # what the SIGINT handler does, here swallowed by a finalizer
        except KeyboardInterrupt:
            pass
        with pytest.raises(KeyboardInterrupt):
            ctrl_c.check()


def test_ctrl_c_during_a_metric_flush_waits_for_the_write(workdir, small_graph, monkeypatch):
    """A real SIGINT lands while step 1's metrics are being written (right after checkpoint 2,
    as a user's Ctrl-C can): the write completes, then the run stops as interrupted and is
    marked KILLED. Raised mid-commit it used to leave sqlite locked ("database is locked")."""
    import os
    import signal

    from dapo_flow.tracking import Tracker, search_runs

    flush = Tracker.log_steps

    def flush_hit_by_ctrl_c(self, entries):
        entries = list(entries)
        if any(step == 1 for step, _ in entries):
            os.kill(os.getpid(), signal.SIGINT)  # delivered at once, inside this write
        flush(self, entries)

    monkeypatch.setattr(Tracker, "log_steps", flush_hit_by_ctrl_c)
    path = small_graph(workdir, steps=4, ckpt=2)
    with pytest.raises(RunError, match="interrupted.*--resume"):
        _run(path)
    monkeypatch.setattr(Tracker, "log_steps", flush)
    [run] = search_runs(f"sqlite:///{workdir / 'dapo-flow-runs' / 'mlflow.db'}", "runtime-tests")
    assert run["status"] == "KILLED"
    history = read_run(f"sqlite:///{workdir / 'dapo-flow-runs' / 'mlflow.db'}", run["run_id"])["history"]
    assert [s for s, _ in history["batch/reward_mean"]] == [1, 2]  # the whole flush landed
    resumed = _run(path, resume=True)
    assert resumed["run_id"] == run["run_id"]


def test_without_checkpoints_metrics_are_written_in_batches_and_when_the_run_fails(
        workdir, small_graph, monkeypatch, fails_in_update):
    """checkpoint_every: 0: the driver writes the buffered steps in one request every
    FLUSH_EVERY_S (here: at step 1, then not before the end), and a run that fails writes what
    it holds, since no checkpoint does."""
    from dapo_flow.runtime import session
    from dapo_flow.tracking import Tracker, search_runs

    monkeypatch.setattr(session, "FLUSH_EVERY_S", 1e9)
    writes = []
    log_steps = Tracker.log_steps

    def spy(self, entries):
        entries = list(entries)
        writes.append([step for step, _ in entries])
        log_steps(self, entries)

    monkeypatch.setattr(Tracker, "log_steps", spy)
    summary = _run(small_graph(workdir, name="batched", steps=4, ckpt=0))
    assert writes == [[0, 1], [2, 3, 4]]
    history = read_run(summary["tracking_uri"], summary["run_id"])["history"]
    assert [s for s, _ in history["batch/reward_mean"]] == [1, 2, 3, 4]
    writes.clear()
    with fails_in_update(3):
        _run(small_graph(workdir, name="failing", steps=4, ckpt=0))
    assert writes == [[0, 1], [2]]
    uri = f"sqlite:///{workdir / 'dapo-flow-runs' / 'mlflow.db'}"
    [failed] = [r for r in search_runs(uri, "runtime-tests") if r["name"] == "failing"]
    history = read_run(uri, failed["run_id"])["history"]
    assert [s for s, _ in history["batch/reward_mean"]] == [1, 2]


def test_ctrl_c_held_is_raised_when_the_block_ends():
    from dapo_flow.runtime.interrupts import CtrlC

    with CtrlC() as ctrl_c:
        with pytest.raises(KeyboardInterrupt):
            with ctrl_c.held():
                ctrl_c._handle(2, None)  # no raise here: the write inside goes on
                done = True
        assert done
        with ctrl_c.held(then_raise=False):
            ctrl_c._handle(2, None)  # remembered only
        with pytest.raises(KeyboardInterrupt):
            ctrl_c.check()


def test_a_failing_run_whose_store_also_fails_reports_the_first_error(workdir, small_graph, monkeypatch):
    """A crash inside the loop is what the user sees even if marking the run FAILED fails too."""
    from dapo_flow.runtime.loop import Runner
    from dapo_flow.tracking import Tracker

    def broken_update(self, rollout, version):
        raise ValueError("the real problem")

    def store_down(self, status="FINISHED"):
        raise OSError("database is locked")

    monkeypatch.setattr(Runner, "submit_update", broken_update)
    monkeypatch.setattr(Tracker, "finish", store_down)
    with pytest.raises(ValueError, match="the real problem"):
        _run(small_graph(workdir, steps=2, ckpt=0))


def test_a_checkpoint_the_disk_refuses_is_gone_past_the_final_one_stops_resumably(workdir, small_graph,
                                                                                   monkeypatch):
    """The disk fills at checkpoint 2 (the run goes on), has room at 3, fills again at the final
    one, 4: the run stops with the fix, and --resume finishes from checkpoint 3 with every step
    in MLflow once (the rule of run.max_failures in a row: tests/runtime/test_checkpoint_storage.py)."""
    import errno
    import io

    from rich.console import Console

    from dapo_flow.errors import ActorFault, CheckpointWriteError
    from dapo_flow.runtime import checkpoint, session
    from dapo_flow.tracking import runs_dir

    real_save = checkpoint.torch.save

    def fake_full_disk(obj, path):
        if any(f"step_00000{k}" in str(path) for k in (2, 4)):  # the op states of checkpoints 2, 4
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(obj, path)

    monkeypatch.setattr(checkpoint.torch, "save", fake_full_disk)
    path = small_graph(workdir, steps=4, ckpt=1)
    out = io.StringIO()
    with pytest.raises(CheckpointWriteError, match=r"could not write checkpoint .*step_000004: No space left "
                                                   r"on device .*\n    the previous checkpoint is "
                                                   r".*step_000003 \(intact\)"):
        _run(path, console=Console(file=out, width=400))
    said = out.getvalue()
    assert "could not write checkpoint" in said and "tries again at step 3 (1 failed in a row" in said
    [root] = (runs_dir() / "checkpoints").glob("*/*")  # the graph's folder / the run's
    assert sorted(p.name for p in root.iterdir()) == ["step_000001", "step_000003"]  # nothing half-written
    monkeypatch.setattr(checkpoint.torch, "save", real_save)

    def fake_lost_start(*args, **kwargs):  # an actor lost as they start (on Ray: a node not yet known dead)
        raise ActorFault("the actor of stage 'model:policy' died: its node is gone")

    real_start = session.start_executor
    monkeypatch.setattr(session, "start_executor", fake_lost_start)
    with pytest.raises(ActorFault) as info:
        _run(path, resume=True, console=Console(file=io.StringIO()))
    assert (info.value.run_id, info.value.step) == (root.name, None)  # what a recovery resumes
    monkeypatch.setattr(session, "start_executor", real_start)
    summary = _run(path, resume=True, console=Console(file=io.StringIO()))  # the run was let go: claimed again
    assert summary["steps"] == 4
    history = read_run(summary["tracking_uri"], summary["run_id"])["history"]
    assert [s for s, _ in history["batch/reward_mean"]] == [1, 2, 3, 4]


def test_resume_finds_the_same_graph_under_another_hash(workdir, small_graph):
    from dapo_flow.tracking import runs_dir

    path = small_graph(workdir, steps=2, ckpt=2)
    _run(path)
    [root] = (runs_dir() / "checkpoints").iterdir()
    root.rename(root.with_name("small-0123456789"))  # as an older dapo-flow's hash would name it
    with pytest.raises(RunError, match=r"same graph has a checkpoint under another hash: .*small-0123456789"):
        _run(path, resume=True)


def test_a_graph_without_group_filter_logs_its_trained_batch(workdir, small_graph):
    """GRPO-style: the whole step is one actor call, and only the update's row comes back; the
    update reports the statistics of the batch it trained on itself."""
    path = small_graph(workdir, steps=2, ckpt=0)
    text = path.read_text()
    text = "\n".join(line for line in text.splitlines() if "op: group-filter" not in line) + "\n"
    path.write_text(text.replace("inputs: [filter]", "inputs: [overlong]"))
    placed = compile_graph(path, CLUSTER)
    assert placed.plan.group_filter is None
    # one worker: every CPU map feeds only its actor, so the whole step is one call, no table back
    assert placed.calls["step"] == (Call("model:policy", ("rollout", "verify", "overlong", "old_logp", "adv", "train")),)
    summary = execute(placed, executor="local")
    history = read_run(summary["tracking_uri"], summary["run_id"])["history"]
    for key in ("batch/reward_mean", "batch/acc_mean", "batch/response_len_mean", "batch/advantage_mean"):
        assert [s for s, _ in history[key]] == [1, 2], key
