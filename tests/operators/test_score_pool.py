"""score with `workers`: the same columns as in-process scoring, per-sample timeouts that kill
and replace the stuck worker, and the same errors (a raising function, a dying worker)."""

from __future__ import annotations

import random

import numpy as np
import pyarrow as pa
import pytest
from pydantic import ValidationError

from dapo_flow.errors import RunError
from dapo_flow.core import columns as C
from dapo_flow.core.contract import OpContext
from dapo_flow.graph.registry import OPERATORS

pytestmark = pytest.mark.timeout(120)  # a pool that hangs fails the test, not the suite

REWARDS = '''
import os, time
def exact(text, truth, extra):
    return 1.0 if text.strip() == truth else -1.0
def graded(text, truth, extra):  # a dict with acc and an extra column
    return {"score": len(text) / 7.0, "acc": text.strip() == truth, "length": len(text)}
def sleepy(text, truth, extra):
    if truth == "HANG":
        while True:
            time.sleep(60)
    return exact(text, truth, extra)
def busy(text, truth, extra):  # stuck in C code, deaf to signals: only a kill stops it
    if truth == "HANG":
        return float(2 ** 10 ** 10 > 0)
    return exact(text, truth, extra)
def boom(text, truth, extra):
    if truth == "7":
        raise ValueError("cannot parse " + text)
    return 0.5
def nan_on_7(text, truth, extra):
    return float("nan") if truth == "7" else 0.5
def dies(text, truth, extra):
    if truth == "7":
        os._exit(1)
    return 0.5
'''

MATH_TRUTHS = [r"\frac{3}{4}", r"2\sqrt{3}", "12", r"\dfrac{\pi}{6}", "x^2+1", "(1, 2)", "0.5",
               r"10\%", "-7", r"\text{(B)}", "1,000", r"\left(0, \frac{1}{2}\right]"]
MATH_WRONG = [r"\frac{4}{3}", "13", r"\sqrt{12}", "x^2-1", "(2, 1)", "0.25", "-8"]


def _op(**params):
    cls = OPERATORS["score"]
    return cls(cls.Params(**params), OpContext(node_id="score"))


def _rows(responses: list[str], truths: list[str]) -> pa.Table:
    n = len(responses)
    return pa.table({
        C.PROMPT_ID: pa.array([f"p{i // 2}" for i in range(n)]),
        C.SAMPLE_IDX: pa.array([i % 2 for i in range(n)], pa.int32()),
        C.RESPONSE_TEXT: pa.array(responses),
        C.GROUND_TRUTH: pa.array(truths),
    })


def _math_rows(n: int, seed: int = 0) -> pa.Table:
    """Responses ending in a boxed answer (right, rewritten, wrong), an `Answer:` line or none."""
    rng = random.Random(seed)
    responses, truths = [], []
    for _ in range(n):
        truth = rng.choice(MATH_TRUTHS)
        answer = rng.choice([truth, truth.replace(r"\frac", r"\tfrac"), f" {truth} ", rng.choice(MATH_WRONG)])
        steps = " ".join(rf"Step {k}: $x_{k} = \frac{{{k}}}{{{k + 1}}}$." for k in range(rng.randint(1, 8)))
        ending = rng.choice([rf"So the answer is $\boxed{{{answer}}}$.", f"Answer: {answer}", "I am not sure."])
        responses.append(f"Let's think step by step. {steps} {ending}")
        truths.append(truth)
    return _rows(responses, truths)


def _addition_rows(n: int, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    a, b = rng.integers(0, 100, n), rng.integers(0, 100, n)
    noise = rng.integers(-1, 2, n)  # a third of the answers off by one
    return _rows([str(x + y + d) for x, y, d in zip(a, b, noise)], [str(x + y) for x, y in zip(a, b)])


def _write_rewards(tmp_path) -> str:
    path = tmp_path / "rewards.py"
    path.write_text(REWARDS)
    return str(path)


@pytest.mark.parametrize("reward, rows, extra", [
    ("builtin:math", _math_rows(60), ()),  # math_verify: ~20 ms a row, twice
    ("builtin:addition", _addition_rows(300), ()),
    ("graded", _addition_rows(200), ("length",)),  # a user function's dict, with an extra column
])
def test_pool_gives_the_in_process_columns(tmp_path, reward, rows, extra):
    if not reward.startswith("builtin:"):
        reward = f"{_write_rewards(tmp_path)}:{reward}"
    in_process = _op(reward=reward, extra_columns=extra)
    expected = in_process(rows)
    pooled_op = _op(reward=reward, extra_columns=extra, workers=2)
    pooled = pooled_op(rows)
    assert pooled.equals(expected)
    assert pooled_op.last_metrics() == in_process.last_metrics()
    # no timeout: no timeouts metric; a declared extra column: its mean
    assert set(in_process.last_metrics()) == {"score/mean", "acc/mean", *(f"score/extra/{x}" for x in extra)}
    acc = expected.column(C.ACC).to_numpy()
    assert 0 < acc.mean() < 1  # both right and wrong answers were scored
    processes = [w.process for w in pooled_op._pool._slots if w is not None]
    assert len(processes) == 2 and all(p.is_alive() for p in processes)
    pooled_op.close()
    assert not any(p.is_alive() for p in processes)


@pytest.mark.parametrize("fn", ["sleepy", "busy"])
def test_a_sample_past_the_timeout_gets_wrong_and_its_worker_is_replaced(tmp_path, fn):
    truths = [str(i % 10) for i in range(200)]
    responses = [t if i % 3 else "x" for i, t in enumerate(truths)]
    truths[123] = "HANG"
    op = _op(reward=f"{_write_rewards(tmp_path)}:{fn}", workers=2, timeout_s=1.0, wrong=-2.0)
    out = op(_rows(responses, truths))  # a hang is the module's timeout
    score, acc = out.column(C.SCORE).to_numpy(), out.column(C.ACC).to_numpy()
    expected = np.array([1.0 if r == t else -1.0 for r, t in zip(responses, truths)], np.float32)
    expected[123] = -2.0  # `wrong`, not what the function would say
    assert np.array_equal(score, expected)
    assert acc[123] == 0 and np.array_equal(np.delete(acc, 123), np.delete(expected, 123) > 0)
    assert op.last_metrics()["score/timeouts"] == 1
    # the pool survived: the next call scores normally, with two live workers
    again = op(_rows(responses[:50], [str(i % 10) for i in range(50)]))
    assert again.column(C.SCORE).to_pylist() == [1.0 if i % 3 else -1.0 for i in range(50)]
    assert op.last_metrics()["score/timeouts"] == 0
    assert sum(w is not None and w.process.is_alive() for w in op._pool._slots) == 2
    op.close()


@pytest.mark.parametrize("fn, shown", [
    ("boom", "raised ValueError('cannot parse 7')"), ("nan_on_7", "returned nan as 'score'"),
])
def test_a_bad_reward_in_a_worker_is_the_in_process_error(tmp_path, fn, shown):
    rewards = _write_rewards(tmp_path)
    rows = _rows([str(i % 10) for i in range(60)], [str(i % 10) for i in range(60)])
    with pytest.raises(RunError) as in_process:
        _op(reward=f"{rewards}:{fn}")(rows)
    op = _op(reward=f"{rewards}:{fn}", workers=2)
    with pytest.raises(RunError) as pooled:
        op(rows)
    assert str(pooled.value) == str(in_process.value)  # the first bad row, in row order
    assert f"{shown} for prompt id 'p3', sample 1 (response '7')" in str(pooled.value)
    assert op(rows.slice(0, 5)).column(C.SCORE).to_pylist() == [0.5] * 5  # the pool still works
    op.close()


def test_a_worker_that_exits_is_a_run_error_naming_the_sample(tmp_path):
    rewards = _write_rewards(tmp_path)
    rows = _rows([str(i % 10) for i in range(40)], [str(i % 10) for i in range(40)])
    op = _op(reward=f"{rewards}:dies", workers=2, timeout_s=30.0)
    with pytest.raises(RunError, match=r"its worker process died \(exit code 1\) while scoring prompt "
                                       r"id 'p(3|8|13|18)', sample 1") as err:
        op(rows)
    assert f"reward function '{rewards}:dies' (node 'score')" in str(err.value)
    assert op(rows.slice(0, 5)).column(C.SCORE).to_pylist() == [0.5] * 5
    op.close()


def test_a_function_the_workers_cannot_import_is_a_run_error(tmp_path):
    rewards = _write_rewards(tmp_path)
    op = _op(reward=f"{rewards}:exact", workers=1)  # the driver imports it here
    (tmp_path / "rewards.py").unlink()  # gone before the worker starts
    with pytest.raises(RunError, match=r"cannot be loaded in a worker process: .*does not exist"):
        op(_rows(["1"], ["1"]))
    op.close()


def test_timeout_needs_workers():
    cls = OPERATORS["score"]
    with pytest.raises(ValidationError, match="timeout_s needs workers >= 1"):
        cls.Params(timeout_s=5)
    assert cls.Params(timeout_s=5, workers=1).timeout_s == 5


VERL_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's signature, unchanged: per data source, a float or a dict with extra metrics."""
    right = solution_str.strip() == ground_truth
    if data_source == "lenient":
        return {"score": 1.0 if right else 0.0, "acc": right, "length": len(solution_str)}
    assert extra_info == {}, extra_info
    return 1.0 if right else -1.0
'''


@pytest.mark.parametrize("workers", [0, 1])
def test_a_verl_reward_file_works_unchanged_with_each_rows_data_source(tmp_path, monkeypatch, workers):
    (tmp_path / "verl_reward.py").write_text(VERL_REWARD)
    monkeypatch.chdir(tmp_path)
    batch = _rows(["4", "5", "4", "5"], ["4", "4", "4", "4"]).append_column(
        C.DATA_SOURCE, pa.array(["strict", "strict", "lenient", "lenient"]))
    op = _op(reward="verl_reward.py:compute_score", extra_columns=("length",), workers=workers)
    try:
        out = op(batch)
    finally:
        op.close()
    assert out.column(C.SCORE).to_pylist() == [1.0, -1.0, 1.0, 0.0]
    assert out.column(C.ACC).to_pylist() == [1.0, 0.0, 1.0, 0.0]
    assert out.column("length").to_pylist() == [0.0, 0.0, 1.0, 1.0]
    assert op.last_metrics()["score/extra/length"] == 0.5  # a dict's extras are logged, as verl does
