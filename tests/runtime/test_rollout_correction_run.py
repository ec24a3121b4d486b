"""A run with a rollout-correction node inserted into the small DAPO graph as an ablation edit."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow  # a whole run (~20 s)


def test_inserted_into_the_small_graph_it_runs_and_logs_the_mismatch(workdir, small_graph):
    """--insert corr:rollout-correction:after=old_logp: the hf engine is the trained policy, so
    its logprobs equal the trainer's to float rounding: weights ~1, nothing rejected."""
    from rich.console import Console

    from dapo_flow.graph.edits import edit_file, parse_cli_edits
    from dapo_flow.graph.plan import Cluster
    from dapo_flow.runtime import execute
    from dapo_flow.tracking import read_run

    path = small_graph(workdir, steps=2, ckpt=0)
    edits = parse_cli_edits([("insert", "corr:rollout-correction:after=old_logp"),
                             ("set", "corr.rollout_rs=token_k1,seq_mean_k3"),
                             ("set", "corr.rollout_rs_threshold=0.5_2.0,0.01")])
    placed = edit_file(str(path), edits).compile(Cluster(cpus=2))
    train = next(n for n in placed.plan.nodes if n.id == "train")
    assert train.params.rollout_is_weights == "use" and train.params.loss_mask == "use"
    summary = execute(placed, executor="local", console=Console(file=open(workdir / "log.txt", "w")))
    history = read_run(summary["tracking_uri"], summary["run_id"])["history"]
    for key in ("rollout_corr/rollout_is_mean", "rollout_corr/kl_k3", "rollout_corr/rollout_rs_masked_fraction"):
        assert [s for s, _ in history[key]] == [1, 2], key
    assert all(abs(v - 1.0) < 1e-3 for _, v in history["rollout_corr/rollout_is_mean"])
    assert all(v == 0.0 for _, v in history["rollout_corr/rollout_rs_masked_fraction"])
    assert all(abs(v) < 1e-4 for _, v in history["rollout_corr/kl_k1"])
