"""The `dapo-flow` command: happy paths, and bad input -> exit 2 with file:line, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dapo_flow import cli

ROOT = Path(__file__).resolve().parents[1]
DAPO = str(ROOT / "graphs" / "dapo.yaml")
BAD = ROOT / "tests" / "graphs_bad"


def test_validate_ok_without_ray_or_mlflow():
    code = ("import sys; from dapo_flow import cli; rc = cli.main(['validate', sys.argv[1]]); "
            "print('heavy:', [m for m in ('ray', 'mlflow') if m in sys.modules]); sys.exit(rc)")
    # COLUMNS narrower than the line, as a long checkout path makes it: the line is not folded
    r = subprocess.run([sys.executable, "-c", code, DAPO], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env={**os.environ, "COLUMNS": "20"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == f"ok: {DAPO}: graph 'dapo', 7 nodes, 2 stages"
    assert "heavy: []" in r.stdout


def test_validate_bad_exits_2_with_location(capsys):
    # in this process (a subprocess costs seconds of imports; the one above checks the module path)
    assert cli.main(["validate", str(BAD / "bad_multiple.yaml")]) == 2
    out, err = capsys.readouterr()
    assert "bad_multiple.yaml:18: node 'verify' op: unknown op 'scor'" in err
    assert "did you mean 'score'?" in err
    assert "Traceback" not in err + out


def test_bad_yaml_and_missing_file(capsys):
    assert cli.main(["validate", str(BAD / "bad_tab_indent.yaml")]) == 2
    err = capsys.readouterr().err
    assert "bad_tab_indent.yaml:18:" in err and "tab" in err
    assert cli.main(["explain", str(BAD / "nope.yaml")]) == 2
    assert "nope.yaml: no such file" in capsys.readouterr().err


def test_explain(capsys):
    assert cli.main(["explain", DAPO, "--cpus", "2", "--gpus", "0"]) == 0
    out = capsys.readouterr().out
    assert out == (ROOT / "tests/golden/dapo.explain.txt").read_text()
    assert cli.main(["explain", DAPO, "--nodes", "3"]) == 0  # --nodes alone describes a cluster too
    assert "GPUs, 3 node(s)" in capsys.readouterr().out


def test_graph_png_and_mmd(tmp_path, capsys):
    png, mmd = tmp_path / "dag.png", tmp_path / "dag.mmd"
    assert cli.main(["graph", DAPO, "-o", str(png)]) == 0
    assert png.read_bytes().startswith(b"\x89PNG")
    assert cli.main(["graph", DAPO, "-o", str(mmd)]) == 0
    assert mmd.read_text().startswith("flowchart TD")
    assert cli.main(["graph", DAPO, "-o", str(tmp_path / "dag.gif")]) == 2
    assert "use one of" in capsys.readouterr().err


def test_ops(capsys):
    assert cli.main(["ops"]) == 0
    out = capsys.readouterr().out
    for op in ("generate", "score", "overlong-shape", "group-filter", "logprob", "advantage",
               "update", "rollout-correction", "custom"):
        assert op in out
    assert "clip_high: float = 0.28" in out
    assert "Upper ratio clip (DAPO clip-higher: 0.28)." in out  # the field's docstring
    assert "response_ids: list<int32>" in out
    assert ">= 1, <= 1024" in out
    # an op without params says so instead of an empty heading
    block = out.split("overlong-filter", 1)[1].split("\n\n", 1)[0]
    assert "  params (none)" in block and "  params\n" not in block


def test_help(capsys):
    # as a process, as `dapo-flow --help` runs: the command list without importing torch (0.9 s
    # instead of 3.8: the operators, which need it, load with the first command)
    code = ("import sys\nfrom dapo_flow import cli\ntry:\n    cli.main(['--help'])\nexcept SystemExit as e:\n    code = e.code\n"
            "print('torch loaded:', 'torch' in sys.modules)\nsys.exit(code)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    for cmd in ("validate", "explain", "graph", "ops", "run", "models", "ui"):
        assert cmd in r.stdout
    assert "torch loaded: False" in r.stdout
    with pytest.raises(SystemExit) as done:
        cli.main(["run", "--help"])
    assert done.value.code == 0 and capsys.readouterr().out.count("--executor") >= 1


def test_run_calls_execute(monkeypatch):
    import types

    seen = {}
    fake = types.ModuleType("dapo_flow.runtime")
    fake.execute = lambda placed, **kw: seen.update(kw, graph=placed.plan.spec.name)
    monkeypatch.setitem(sys.modules, "dapo_flow.runtime", fake)
    assert cli.main(["run", DAPO, "--executor", "local", "--steps", "3", "--resume"]) == 0
    artifacts, params = seen.pop("artifacts"), seen.pop("extra_params")
    assert seen == {"executor": "local", "address": None, "resume": True, "steps": 3, "graph": "dapo"}
    assert set(artifacts) == {"graph/plan.txt", "graph/dag.png"} and params == {}  # no edits
    assert cli.main(["run", DAPO, "--executor", "local", "--resume", "0123abcd"]) == 0
    assert seen["resume"] == "0123abcd" and seen["steps"] is None
    assert cli.main(["run", DAPO, "--executor", "local"]) == 0
    assert seen["resume"] is False


@pytest.mark.parametrize("argv", [
    ["run", DAPO, "--steps", "0"],  # used to run the graph's 120 steps
    ["run", DAPO, "--steps", "-5"],  # used to exit 0 after no training
    ["run", DAPO, "--steps", "two"],
    ["sweep", "patch.yaml", "--parallel", "0"],
    ["sweep", "patch.yaml", "--parallel", "-2"],
    ["sweep", "patch.yaml", "--steps", "0"],
    ["explain", DAPO, "--nodes", "0"],
])
def test_counts_below_one_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {argv[2]}:" in err and ">= 1" in err


@pytest.mark.parametrize("seed", ["-1", str(2**32), str(2**65)])
def test_eval_seed_out_of_range_is_a_usage_error(seed, capsys):
    # 2**65 used to pass argparse and end in torch's "Overflow when unpacking long long"
    with pytest.raises(SystemExit) as info:
        cli.main(["eval", DAPO, "--seed", seed])
    assert info.value.code == 2
    assert "argument --seed: must be a seed 0-4294967295" in capsys.readouterr().err


def test_usage_errors_exit_2():
    with pytest.raises(SystemExit) as info:
        cli.main(["models"])
    assert info.value.code == 2
