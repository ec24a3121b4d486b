"""A run that would train nothing stops with a clear error (exit 2, MLflow run FAILED) instead
of finishing green: non-finite gradients, dynamic sampling that keeps no group, an update fed
an empty batch. In-process (--executor local), through the CLI the user runs."""

from __future__ import annotations

import pytest

from dapo_flow import cli
from dapo_flow.graph.compiler import compile_graph
from dapo_flow.errors import RunError
from dapo_flow.graph.plan import Cluster
from dapo_flow.runtime import execute
from dapo_flow.tracking import default_tracking_uri, read_run, search_runs


def _run(path, **kw):
    return execute(compile_graph(path, Cluster(cpus=2)), executor="local", **kw)


def _cli_run(path, *flags) -> int:
    return cli.main(["run", str(path), "--executor", "local", *flags])


def _only_run() -> dict:
    [run] = search_runs(default_tracking_uri(), "runtime-tests")
    return run


@pytest.mark.timeout(300)
def test_nonfinite_gradients_stop_the_run_within_k_steps(workdir, small_graph, capsys):
    # entropy_coef 1e38 overflows the loss: every optimizer step has a nan grad norm; the small
    # graph has 2 mini-batches per step, so max_nonfinite_steps=3 is reached in update step 2
    path = small_graph(workdir, steps=6, ckpt=1)
    assert _cli_run(path, "--set", "train.entropy_coef=1e38") == 2
    err = capsys.readouterr().err
    assert "update 'train': the gradient norm was nan (not finite) in 3 optimizer steps in a row" in err
    assert "update step 2" in err and "Traceback" not in err
    run = _only_run()
    assert run["status"] == "FAILED"
    history = read_run(default_tracking_uri(), run["run_id"])["history"]
    assert history["actor/skipped_steps"] == [(1, 2.0)]  # step 1 checkpointed; step 2 failed
    assert history["actor/skipped_steps_total"] == [(1, 2.0)]


def _constant_metric_graph(small_graph, workdir, *, on_cap, cap, steps, max_skipped=None):
    # correct == wrong: every group has zero score spread, so dynamic sampling keeps nothing
    path = small_graph(workdir, metric="score", wrong=1.0, cap=cap, on_cap=on_cap, steps=steps, ckpt=0)
    if max_skipped is not None:
        text = path.read_text().replace(f"on_cap: {on_cap}", f"on_cap: {on_cap}, max_skipped_steps: {max_skipped}")
        path.write_text(text)
    return path


def test_skipped_steps_count_their_samples(workdir, small_graph):
    summary = _run(_constant_metric_graph(small_graph, workdir, on_cap="skip-step", cap=2, steps=2))
    # 2 steps x 2 generation batches x 8 prompts x 4 samples, generated although none trained
    assert summary["samples_generated"] == 128
    history = read_run(summary["tracking_uri"], summary["run_id"])["history"]
    assert history["sampling/samples_generated"] == [(1, 64.0), (2, 64.0)]
    assert history["sampling/samples_generated_total"] == [(1, 64.0), (2, 128.0)]


@pytest.mark.parametrize("policy", ["skip-step", "train-on-what-we-have"])
def test_k_skipped_steps_in_a_row_stop_the_run(workdir, small_graph, policy, capsys):
    path = _constant_metric_graph(small_graph, workdir, on_cap=policy, cap=1, steps=10, max_skipped=3)
    assert _cli_run(path) == 2
    err = capsys.readouterr().err
    assert "training is doing nothing: 3 steps in a row were skipped: group-filter 'filter' kept" in err
    assert "the last step kept 0/4 after 1 generation batches" in err and "greedy sampling" in err
    run = _only_run()
    assert run["status"] == "FAILED"
    assert read_run(default_tracking_uri(), run["run_id"])["history"]["sampling/skipped"] == [(1, 1.0), (2, 1.0)]


@pytest.mark.timeout(120)  # it hung forever before
def test_unlimited_generation_batches_keeping_nothing_stop_instead_of_hanging(workdir, small_graph):
    path = _constant_metric_graph(small_graph, workdir, on_cap="error", cap=0, steps=2, max_skipped=3)
    with pytest.raises(RunError, match=r"3 generation batches in a row kept no prompt group at "
                                       r"group-filter 'filter' \(with max_gen_batches: 0"):
        _run(path)


DROP_ALL = '''
import pyarrow as pa
from pydantic import BaseModel, ConfigDict


class NoParams(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class DropAll:
    """A row filter in the train segment that drops every row."""

    Params = NoParams
    REQUIRES = {}
    PRODUCES = {}
    CARDINALITY = "filter"
    NEEDS_MODEL = False

    def __init__(self, params, ctx):
        pass

    def __call__(self, batch: pa.Table) -> pa.Table:
        return batch.slice(0, 0)
'''


def test_an_empty_batch_reaching_update_is_exit_2_with_a_message(workdir, small_graph, capsys):
    (workdir / "drop_all.py").write_text(DROP_ALL)
    path = small_graph(workdir, steps=2, ckpt=0)
    drop = "  - {id: drop, op: custom, impl: drop_all.py:DropAll, inputs: [adv]}\n"
    path.write_text(path.read_text().replace("inputs: [adv]", "inputs: [drop]") + drop)
    code = _cli_run(path)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "update 'train' got an empty batch" in err and "Traceback" not in err
    assert _only_run()["status"] == "FAILED"


def test_a_reward_function_returning_none_is_exit_2_naming_it_and_the_sample(workdir, small_graph, capsys):
    (workdir / "my_reward.py").write_text("def reward(text, truth, extra):\n    return None\n")
    path = small_graph(workdir, steps=2, ckpt=0)
    ref = f"{workdir / 'my_reward.py'}:reward"
    path.write_text(path.read_text().replace("params: {correct: 1.0,", f"params: {{reward: '{ref}', correct: 1.0,"))
    assert _cli_run(path) == 2
    err = capsys.readouterr().err
    assert f"reward function '{ref}' (node 'verify') returned None as 'score' for prompt id" in err
    assert "Traceback" not in err
    assert _only_run()["status"] == "FAILED"


def test_the_skipped_steps_in_a_row_survive_a_resume(workdir, small_graph, capsys):
    # 2 skipped steps, checkpointed; the resumed run stops at its 1st skipped step (3 in a row),
    # not after 3 more
    path = _constant_metric_graph(small_graph, workdir, on_cap="skip-step", cap=1, steps=2, max_skipped=3)
    path.write_text(path.read_text().replace("checkpoint_every: 0", "checkpoint_every: 1"))
    run_id = _run(path)["run_id"]
    assert _cli_run(path, "--resume", run_id, "--steps", "10") == 2
    assert "3 steps in a row were skipped" in capsys.readouterr().err
    history = read_run(default_tracking_uri(), run_id)["history"]
    assert [s for s, _ in history["sampling/skipped"]] == [1, 2]
