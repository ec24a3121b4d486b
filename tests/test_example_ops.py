"""The example custom operator in graphs/ops/: Kimi k1.5's length reward, by hand and in a
real (short) sweep through graphs/ablations/length-penalty.yaml."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from dapo_flow.core import columns as C

ROOT = Path(__file__).resolve().parents[1]


def _op_class():
    spec = importlib.util.spec_from_file_location("length_penalty", ROOT / "graphs" / "ops" / "length_penalty.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.KimiLengthPenalty


def test_kimi_length_reward_hand_worked():
    cls = _op_class()
    batch = pa.table({
        C.PROMPT_ID: ["a", "a", "a", "b", "b"],
        C.RESPONSE_LEN: pa.array([2, 4, 6, 3, 3], C.SCHEMA[C.RESPONSE_LEN]),
        C.ACC: pa.array([1.0, 1.0, 0.0, 1.0, 0.0], C.SCHEMA[C.ACC]),
        C.REWARD: pa.array([1.0, 1.0, -1.0, 1.0, -1.0], C.SCHEMA[C.REWARD]),
    })
    out = cls(cls.Params(weight=0.1), None)(batch)
    # group a: lengths 2..6, lam = 0.5 - (len - 2) / 4 = 0.5, 0, -0.5; correct rows keep lam,
    # the wrong one min(0, lam) = -0.5. Group b: equal lengths -> 0 for both.
    assert out.column("length_reward").to_pylist() == [0.5, 0.0, -0.5, 0.0, 0.0]
    np.testing.assert_allclose(out.column(C.REWARD).to_numpy(), [1.05, 1.0, -1.05, 1.0, -1.0], rtol=1e-6)
    assert out.schema.field(C.REWARD).type == C.SCHEMA[C.REWARD] and out.num_rows == 5
    # a short wrong answer is not rewarded for being short: lam > 0 clipped to 0
    wrong_short = batch.set_column(2, C.ACC, pa.array([0.0, 1.0, 1.0, 1.0, 0.0], C.SCHEMA[C.ACC]))
    assert cls(cls.Params(), None)(wrong_short).column("length_reward").to_pylist()[:3] == [0.0, 0.0, -0.5]
    with pytest.raises(ValueError):
        cls.Params(weight=-1.0)


def test_length_penalty_sweep_runs_the_custom_operator(tmp_path, monkeypatch, tiny_adder_path):
    from dapo_flow import cli
    from dapo_flow.tracking import child_runs, default_tracking_uri, latest_run

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    patch = ROOT / "graphs" / "ablations" / "length-penalty.yaml"
    assert cli.main(["sweep", str(patch), "--only", "kimi-length-0.5", "--steps", "1",  # one shows it runs
                     "--executor", "local"]) == 0
    uri = default_tracking_uri()
    parent = latest_run(uri, "length-penalty", "tags.`dapo_flow.sweep` = 'parent'")
    [child] = child_runs(uri, parent["run_id"], ["lenpen/mean"])
    assert child["status"] == "FINISHED" and child["params"]["nodes.lenpen.params.weight"] == "0.5"
    assert [s for s, _ in child["history"]["lenpen/mean"]] == [1]
