"""graphs/distill.yaml: a teacher that must share the student's tokenizer and stay frozen
(validate), and a short real run of on-policy distillation (--executor local)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dapo_flow.errors import GraphError
from dapo_flow.graph.edits import edit_file, parse_cli_edits
from dapo_flow.graph.plan import Cluster
from dapo_flow.runtime import execute
from dapo_flow.tracking import read_run

DISTILL = str(Path(__file__).resolve().parents[2] / "graphs" / "distill.yaml")


def _edited(*sets: str):
    return edit_file(DISTILL, parse_cli_edits([("set", s) for s in sets]))


def test_a_teacher_of_another_tokenizer_fails_validate_naming_the_node_and_the_fix():
    with pytest.raises(GraphError) as err:
        _edited("models.teacher.path=builtin:tiny-chat").compile(Cluster(cpus=2))
    text = str(err.value)
    assert "teacher_logp" in text and "distill.yaml" in text
    assert "model 'teacher' does not share the tokenizer of 'policy'" in text
    assert "use a 'teacher' with 'policy''s tokenizer" in text


def test_a_teacher_that_is_trained_fails_validate():
    with pytest.raises(GraphError, match="a teacher must stay frozen, but 'policy' is updated by node 'train'"):
        _edited("teacher_logp.model=policy").compile(Cluster(cpus=2))


def test_the_teacher_is_never_trained_nor_synced():
    placed = _edited().compile(Cluster(cpus=2))
    assert placed.plan.syncs == (("train", "policy"),)
    assert placed.node_stage["teacher_logp"] == "model:teacher"
    assert {n.id: n.logprob_role() for n in placed.plan.with_role("logprob")}["teacher_logp"] == "teacher"


@pytest.mark.models("tiny-adder-teacher")
def test_a_short_distillation_run_trains_on_the_teachers_signal(workdir):
    placed = _edited("run.steps=2", "run.prompts_per_step=8", "run.val_every=2",
                     "run.checkpoint_every=0", "data.val.size=16").compile(Cluster(cpus=2))
    summary = execute(placed, executor="local")
    run = read_run(summary["tracking_uri"], summary["run_id"])
    assert run["status"] == "FINISHED" and summary["steps"] == 2
    history = run["history"]
    assert [s for s, _ in history["distill/reverse_kl"]] == [1, 2]
    # the soft student against the sharp teacher: a positive KL on the student's own samples
    assert all(kl > 0 for _, kl in history["distill/reverse_kl"])
    assert "actor/pg_loss" in run["metrics"] and "val/acc" in run["metrics"]
    assert any(k.startswith("time/") and "teacher" in k for k in run["metrics"]), sorted(run["metrics"])
    # the share of the student's sampled tokens that are the teacher's top-1 choice
    assert [s for s, _ in history["distill/teacher_agreement"]] == [1, 2]
    assert all(0.3 < a < 1.0 for _, a in history["distill/teacher_agreement"]), history["distill/teacher_agreement"]


def test_top_k_distillation_without_the_teachers_top_k_fails_validate_naming_the_fix():
    with pytest.raises(GraphError) as err:
        _edited("train.distill_topk_coef=1.0").compile(Cluster(cpus=2))
    text = str(err.value)
    assert "node 'train' inputs: requires column 'teacher_topk_ids' (list<list<int32>>)" in text
    assert "add an upstream node that produces it: op 'logprob' with role: teacher, top_k: 8" in text


@pytest.mark.models("tiny-adder-teacher")
def test_top_k_distillation_trains_on_the_forward_kl_to_the_teachers_top_k(workdir):
    placed = _edited("teacher_logp.top_k=4", "train.distill_topk_coef=0.5", "run.steps=1",
                     "run.prompts_per_step=4", "run.val_every=0", "run.checkpoint_every=0").compile(Cluster(cpus=2))
    summary = execute(placed, executor="local")
    history = read_run(summary["tracking_uri"], summary["run_id"])["history"]
    # the student's top-4 mass differs from the sharp teacher's: a nonzero term, logged per step
    assert [s for s, _ in history["actor/distill_fkl"]] == [1] and history["actor/distill_fkl"][0][1] != 0
    assert history["actor/grad_norm"][0][1] > 0


def test_a_frozen_model_read_only_by_teacher_or_ref_nodes_is_scored_by_a_vllm_engine_alone():
    """`backend: vllm` on the teacher: no torch copy of it, its engine's prompt logprobs instead
    (Plan.engine_scored); explain says so and prices the engine. A model anything generates
    with or trains, or an hf one, keeps its torch copy."""
    from dapo_flow.graph.explain import explain

    placed = _edited("models.teacher.backend=vllm").compile(Cluster(cpus=2))
    assert placed.plan.engine_scored == ("teacher",)
    text = explain(placed)
    assert "scored by its vllm engine alone (prompt logprobs, no torch copy)" in text
    assert "vLLM KV cache (kv_cache_gib)" in text.split("model:teacher: peak")[1].split("\n\n")[0]
    assert _edited().compile(Cluster(cpus=2)).plan.engine_scored == ()  # hf: its torch copy scores
    assert _edited("models.policy.backend=vllm").compile(Cluster(cpus=2)).plan.engine_scored == ()


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.models("tiny-adder-teacher")
def test_a_vllm_served_teacher_gives_the_hf_teachers_signal(workdir, tmp_path):
    """Three steps of top-K distillation with the teacher on vLLM (a run of its own process: one
    vLLM engine per process) log the reverse KL and forward KL of the hf teacher's run."""
    import os
    import subprocess
    import sys

    sets = ["run.steps=3", "run.prompts_per_step=8", "run.val_every=0", "run.checkpoint_every=0",
            "teacher_logp.top_k=4", "train.distill_topk_coef=1.0"]
    summary = execute(_edited(*sets).compile(Cluster(cpus=2)), executor="local")
    want = read_run(summary["tracking_uri"], summary["run_id"])["history"]
    cli = [sys.executable, "-m", "dapo_flow.cli", "run", DISTILL, "--executor", "local",
           *[a for s in sets + ["models.teacher.backend=vllm"] for a in ("--set", s)]]
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'vllm.db'}",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(DISTILL).parents[1]), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(cli, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    from dapo_flow.tracking import latest_run

    uri = env["MLFLOW_TRACKING_URI"]
    got = read_run(uri, latest_run(uri, "dapo-flow")["run_id"])["history"]  # the graph's tracking.experiment
    for key in ("distill/reverse_kl", "actor/distill_fkl", "actor/pg_loss"):
        assert [s for s, _ in got[key]] == [1, 2, 3], key
        assert [v for _, v in got[key]] == pytest.approx([v for _, v in want[key]], rel=1e-3, abs=1e-4), key
