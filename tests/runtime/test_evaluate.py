"""dapo-flow eval: the base model or a checkpoint on validation prompts, logged to MLflow."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from dapo_flow.graph.compiler import compile_graph
from dapo_flow.errors import RunError
from dapo_flow.graph.plan import Cluster
from dapo_flow.runtime import execute
from dapo_flow.experiments.evaluate import evaluate, resolve_checkpoint
from dapo_flow.tracking import EVAL_TAG
from dapo_flow.tracking import read_run

CLUSTER = Cluster(cpus=2)
ROOT = Path(__file__).resolve().parents[2]


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    assert files, f"no weights in {model_dir}"
    return {k: v for f in files for k, v in load_file(f).items()}


def _all_hold(policies: list, weights: dict[str, torch.Tensor]) -> bool:
    return bool(policies) and all(all(torch.equal(p.model.state_dict()[k], v) for k, v in weights.items())
                                  for p in policies)


def test_eval_base_then_latest_checkpoint(workdir, small_graph, tiny_adder_path, policies):
    path = small_graph(workdir, steps=2, ckpt=2, val_n=4, val_temp=1.0)
    placed = compile_graph(path, CLUSTER)
    with pytest.raises(RunError, match="no checkpoint of graph 'small'.*--checkpoint base"):
        evaluate(placed)

    policies.clear()
    loaded = policies
    base_weights = _weights(tiny_adder_path)
    base = evaluate(placed, which="base", n=4, temperature=1.0)
    assert base["checkpoint"] is None and base["step"] is None
    assert _all_hold(loaded, base_weights)
    m = base["metrics"]
    assert m["eval/prompts"] == 16 and 0 <= m["val/acc"] <= m["val/pass_at_2"] <= m["val/pass_at_4"] <= 1
    run = read_run(base["tracking_uri"], base["run_id"])
    assert run["tags"][EVAL_TAG] == "1" and run["status"] == "FINISHED"
    assert (run["params"]["eval.checkpoint"], run["params"]["eval.n"]) == ("base", "4")

    trained = execute(placed, executor="local")
    loaded.clear()
    latest = evaluate(placed, save=str(workdir / "seed0.parquet"))  # the graph's val_n / temperature
    # and seed: training's own validation
    assert latest["step"] == 2 and latest["checkpoint"].endswith("step_000002")
    # what was evaluated is step 2's policy: the weights the checkpoint saved, which 2 steps of
    # training moved off the base model's (equal metrics alone could not tell the two apart)
    trained_weights = _weights(Path(latest["checkpoint"]) / "models" / "policy")
    assert trained_weights.keys() == base_weights.keys()
    assert any(not torch.equal(trained_weights[k], base_weights[k]) for k in base_weights)
    assert _all_hold(loaded, trained_weights)
    val = read_run(trained["tracking_uri"], trained["run_id"])["history"]
    for key in ("val/acc", "val/pass_at_4"):
        assert latest["metrics"][key] == val[key][-1][1]  # step 2's validation, reproduced exactly
    other = evaluate(placed, seed=7, save=str(workdir / "seed7.parquet"))  # same checkpoint
    assert 0 <= other["metrics"]["val/acc"] <= other["metrics"]["val/pass_at_4"] <= 1
    texts = {seed: pq.read_table(workdir / f"seed{seed}.parquet").sort_by([("prompt_id", "ascending"),
                                                                          ("sample_idx", "ascending")])
             for seed in (0, 7)}
    assert texts[0].column("prompt_id").equals(texts[7].column("prompt_id"))  # the same prompts, 4 each
    assert texts[0].column("response_text").to_pylist() != texts[7].column("response_text").to_pylist()
    assert read_run(other["tracking_uri"], other["run_id"])["params"]["seed"] == "7"
    step_dir, models, step = resolve_checkpoint(placed.plan.spec, latest["checkpoint"])
    assert models == {"policy": str(step_dir / "models" / "policy")} and step == 2
    loaded.clear()
    again = evaluate(placed, which=latest["checkpoint"], n=4, temperature=1.0)  # a path: same model
    assert again["metrics"]["val/acc"] == latest["metrics"]["val/acc"]  # seeded: deterministic
    assert _all_hold(loaded, trained_weights)
    history = read_run(latest["tracking_uri"], latest["run_id"])["history"]
    assert [s for s, _ in history["val/acc"]] == [2]  # logged at the checkpoint's step
    greedy = evaluate(placed, n=1, temperature=0.0, split="train", size=8)
    assert greedy["metrics"]["eval/prompts"] == 8 and "val/pass_at_2" not in greedy["metrics"]


def test_eval_errors_are_exit_2(workdir, small_graph, capsys):
    from dapo_flow import cli

    path = str(small_graph(workdir, steps=2, ckpt=2))
    assert cli.main(["eval", path, "--checkpoint", str(workdir / "nowhere")]) == 2
    assert "not a checkpoint" in capsys.readouterr().err
    with pytest.raises(SystemExit) as refused:  # argparse's check, as for every other range
        cli.main(["eval", path, "--n", "0"])
    assert refused.value.code == 2 and "--n: must be a whole number 1-1024, got 0" in capsys.readouterr().err
    assert cli.main(["eval", path]) == 2  # nothing trained yet
    assert "no checkpoint" in capsys.readouterr().err
    assert cli.main(["eval", path, "--batch-size", "0"]) == 2
    assert "--batch-size must be >= 1" in capsys.readouterr().err
    assert cli.main(["eval", path, "--checkpoint", "base", "--save", str(workdir / "out.csv")]) == 2
    assert "name a .parquet file" in capsys.readouterr().err


@pytest.mark.slow  # a sweep of two trained variants, then their evals
def test_eval_sweep_compares_every_variant_checkpoint(tmp_path, monkeypatch, capsys, tiny_adder_path, policies):
    from dapo_flow import cli
    from dapo_flow.tracking import PARENT_TAG
    from dapo_flow.tracking import child_runs, default_tracking_uri, latest_run

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    patch = str(ROOT / "graphs" / "ablations" / "length-penalty.yaml")
    args = ["--only", "dapo,kimi-length-0.5", "--seeds", "0"]
    assert cli.main(["eval", patch, "--sweep", *args]) == 2  # nothing trained yet
    assert "no checkpoint for any" in capsys.readouterr().err
    assert cli.main(["sweep", patch, *args, "--steps", "2", "--executor", "local"]) == 0
    capsys.readouterr()
    policies.clear()
    loaded = policies
    assert cli.main(["eval", patch, "--sweep", *args, "--n", "4", "--temperature", "1.0"]) == 0
    out = capsys.readouterr().out
    assert "final pass@4" in out and "Δ val acc" in out and "(baseline)" in out and "samples" not in out.split("eval length-penalty")[-1]
    uri = default_tracking_uri()
    parent = latest_run(uri, "length-penalty", f"tags.`{PARENT_TAG}` = 'parent' and tags.`{EVAL_TAG}` = '1'")
    children = child_runs(uri, parent["run_id"], ["val/acc"])
    assert sorted(c["params"]["sweep.variant"] for c in children) == ["dapo", "kimi-length-0.5"]
    assert all(c["params"]["eval.step"] == "2" and c["params"]["eval.n"] == "4" for c in children)
    # each variant's eval ran its own step-2 weights: two distinct checkpoints, neither the base model's
    saved = [_weights(Path(c["params"]["eval.checkpoint"]) / "models" / "policy") for c in children]
    base_weights = _weights(tiny_adder_path)
    for weights in saved:
        assert any(not torch.equal(weights[k], base_weights[k]) for k in base_weights)
        assert any(_all_hold([p], weights) for p in loaded)
    assert any(not torch.equal(saved[0][k], saved[1][k]) for k in base_weights)
    assert cli.main(["eval", patch, "--sweep", "--checkpoint", "base"]) == 2
    assert cli.main(["eval", patch, "--seeds", "0"]) == 2  # --seeds without --sweep
