"""dapo-flow diff: key-by-key differences of two effective graphs, defaults filled in."""

from __future__ import annotations

import copy
from pathlib import Path

from dapo_flow import cli
from dapo_flow.graph.edits import apply_edits
from dapo_flow.graph.diff import Change, diff_graphs, flatten_graph
from dapo_flow.graph.loader import load
from dapo_flow.experiments.sweep import load_patch

ROOT = Path(__file__).resolve().parents[1]
DAPO, GRPO = ROOT / "graphs" / "dapo.yaml", ROOT / "graphs" / "grpo.yaml"
LADDER = ROOT / "graphs" / "ablations" / "dapo-ladder.yaml"


def raw(path: Path) -> dict:
    return dict(load(path).raw)


def test_grpo_to_dapo():
    changes = diff_graphs(raw(GRPO), raw(DAPO))
    assert Change("changed", "train.clip_high", 0.2, 0.28) in changes
    assert not [c for c in changes if c.key == "adv.reward_column"]  # `auto` in both files
    assert Change("changed", "old_logp.inputs", ["verify"], ["dynamic_sampling"]) in changes
    assert Change("changed", "run.gen_prompts_per_batch", None, 48) in changes
    added = [c.key for c in changes if c.kind == "added"]
    assert added == ["node overlong", "node dynamic_sampling"]  # placed where dapo has them
    assert [c.key for c in changes].index("node overlong") < [c.key for c in changes].index("old_logp.inputs")
    texts = [c.render() for c in changes]
    assert "train.clip_high: 0.2 -> 0.28" in texts
    assert "node overlong: added (op overlong-shape, inputs [verify], max_len 8, buffer_len 4, factor 1.0)" in texts
    reverse = diff_graphs(raw(DAPO), raw(GRPO))
    assert "node overlong: removed" in " ".join(c.render() for c in reverse)


def test_defaults_filled_in():
    a = raw(DAPO)
    b = copy.deepcopy(a)
    del b["nodes"][6]["params"]["clip_high"]  # 0.28 is the default
    del b["run"]["val_n"]  # 1 is the default
    a["run"]["val_n"] = 1
    b["nodes"][6]["params"]["mask_truncated"] = False  # written out, same as the default
    assert diff_graphs(a, b) == []
    sections, nodes = flatten_graph(a)
    assert sections["run.steps"] == 120 and nodes["train"]["kl_coef"] == 0.0
    assert nodes["train"]["op"] == "update" and nodes["rollout"]["inputs"] == ["prompts"]


def test_unvalidated_graph_still_diffs():
    a, b = raw(DAPO), raw(DAPO)
    b["nodes"][0]["params"]["n"] = "many"  # not valid: compared as written
    b["run"]["steps"] = -1
    keys = {c.key for c in diff_graphs(a, b)}
    assert keys == {"rollout.n", "run.steps"}


def test_ladder_top_rung_is_dapo_yaml():
    """The ladder's edits rebuild graphs/dapo.yaml from graphs/grpo.yaml exactly."""
    patch = load_patch(LADDER)
    verl = next(v for v in patch.variants if v.name == "dapo-verl")
    doc = apply_edits(load(patch.base), verl.edits)
    assert diff_graphs(doc.raw, raw(DAPO)) == [Change("changed", "name", "grpo", "dapo")]
    paper = next(v for v in patch.variants if v.name == "+dynamic-sampling")
    doc = apply_edits(load(patch.base), paper.edits)
    assert {c.key for c in diff_graphs(doc.raw, raw(DAPO))} == {"name", "train.clip_c", "train.mask_truncated",
                                                               "old_logp.source"}


def test_cli_diff(capsys):
    assert cli.main(["diff", str(GRPO), str(DAPO)]) == 0
    out = capsys.readouterr().out
    assert "~ train.clip_high: 0.2 -> 0.28" in out and "+ node dynamic_sampling: added" in out
    assert out.rstrip().endswith("9 differences")
    assert cli.main(["diff", str(DAPO), str(DAPO)]) == 0
    assert "no differences" in capsys.readouterr().out
    assert cli.main(["diff", str(DAPO), "nope.yaml"]) == 2
    assert "nope.yaml: no such file, and not an MLflow run id" in capsys.readouterr().err
