"""Data that leaves nothing to train or validate on is a clear exit 2 at start, through the CLI
the user runs (--executor local), never a hang: the sampler used to loop forever on an empty
permutation at 100% CPU, with the MLflow run left RUNNING."""

from __future__ import annotations

import json

import pytest

from dapo_flow import cli
from dapo_flow.tracking import default_tracking_uri, search_runs

TRAIN = 'train: {source: "builtin:addition", split: train}'
VAL = 'val: {source: "builtin:addition", split: val, size: 16}'


def _graph_with(small_graph, workdir, old: str, new: str):
    path = small_graph(workdir, steps=2, ckpt=0)
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))
    return path


def _run_fails_cleanly(path, capsys) -> str:
    assert cli.main(["run", str(path), "--executor", "local"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert search_runs(default_tracking_uri(), "runtime-tests") == []  # refused before any run
    return " ".join(err.split())  # the console wraps long lines


@pytest.mark.timeout(120)
def test_empty_training_file_exits_2_at_start(workdir, small_graph, capsys):
    (workdir / "empty.jsonl").write_text("")
    path = _graph_with(small_graph, workdir, TRAIN, 'train: {source: "empty.jsonl"}')
    err = _run_fails_cleanly(path, capsys)
    assert "empty.jsonl: no usable prompts: it has no rows" in err


@pytest.mark.timeout(120)
def test_every_training_row_skipped_exits_2_at_start(workdir, small_graph, capsys):
    rows = [{"prompt": "1+1="}, {"prompt": "", "answer": "0"}]  # no ground truth, empty prompt
    (workdir / "bad.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n")
    path = _graph_with(small_graph, workdir, TRAIN, 'train: {source: "bad.jsonl", on_bad_row: skip}')
    err = _run_fails_cleanly(path, capsys)
    assert "bad.jsonl: no usable prompts: all 2 rows read were skipped as bad rows" in err
    assert "1 no ground truth" in err and "1 missing or empty `prompt`" in err


@pytest.mark.timeout(120)
def test_empty_validation_file_exits_2_at_start(workdir, small_graph, capsys):
    (workdir / "val.jsonl").write_text("\n\n")
    path = _graph_with(small_graph, workdir, VAL, 'val: {source: "val.jsonl"}')
    err = _run_fails_cleanly(path, capsys)
    assert "val.jsonl: no usable prompts: it has no rows" in err
