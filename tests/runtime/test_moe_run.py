"""graphs/moe.yaml: a short real run (--executor local) of DAPO on builtin:tiny-moe, its load-balancing
loss trained on, the router metrics logged every step."""

from __future__ import annotations

from pathlib import Path

import pytest

from dapo_flow.graph.edits import edit_file, parse_cli_edits
from dapo_flow.graph.plan import Cluster
from dapo_flow.runtime import execute
from dapo_flow.tracking import read_run

MOE = str(Path(__file__).resolve().parents[2] / "graphs" / "moe.yaml")


@pytest.mark.slow
@pytest.mark.models("tiny-moe")
def test_a_short_moe_run_logs_its_routing_every_step(workdir):
    edits = [("set", s) for s in ("run.steps=2", "run.prompts_per_step=8", "run.val_every=2", "run.checkpoint_every=0",
                                  "data.val.size=16", "train.router_aux_loss_coef=0.001")]
    summary = execute(edit_file(MOE, parse_cli_edits(edits)).compile(Cluster(cpus=2)), executor="local")
    run = read_run(summary["tracking_uri"], summary["run_id"])
    assert run["status"] == "FINISHED" and summary["steps"] == 2
    history = run["history"]
    for key in ("moe/aux_loss", "moe/router_entropy", "moe/load_max", *(f"moe/load_expert_{e}" for e in range(4))):
        assert [s for s, _ in history[key]] == [1, 2], key
    for step in range(2):
        assert sum(history[f"moe/load_expert_{e}"][step][1] for e in range(4)) == pytest.approx(1.0, abs=1e-5)
    assert all(1.0 <= v <= 4.0 for _, v in history["moe/load_max"])  # 1 = balanced, 4 = one expert
    assert all(v >= 2.0 for _, v in history["moe/aux_loss"])  # k = 2 at perfect balance
    assert "val/acc" in run["metrics"] and "actor/pg_loss" in run["metrics"]
