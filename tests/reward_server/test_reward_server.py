"""The reward server and its client over loopback: the same columns as in-process scoring, clear
4xx answers to bad requests, and a server that is down, slow, answers garbage or the wrong
count: bounded retries, then an error naming the URL, or the rows masked and counted."""

from __future__ import annotations

import asyncio
import re
import httpx
import numpy as np
import pyarrow as pa
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from dapo_flow.core import columns as C
from dapo_flow.core.contract import OpContext
from dapo_flow.errors import RunError
from dapo_flow.operators.score import Score
from dapo_flow.reward_server.server import host_warning, make_app
from reward_servers import free_port, serve_reward, stop, threaded

pytestmark = pytest.mark.timeout(300)  # a client that hangs fails the test, not the suite

REWARDS = '''
def graded(text, truth, extra):  # a dict with acc and an extra metric, per data source
    return {"score": len(text) / 7.0, "acc": text.strip() == truth, "length": len(text),
            "pred": text.strip()}  # not a number: left out on the wire, as in-process
def compute_score(data_source, solution_str, ground_truth, extra_info=None):  # verl's signature
    return (2.0 if data_source == "double" else 1.0) * (solution_str.strip() == ground_truth) - 0.5
def boom(text, truth, extra):
    if truth == "7":
        raise ValueError("cannot parse " + text)
    return 1.0 if text.strip() == truth else -1.0
'''
MATH = [(r"so $\boxed{\frac{3}{4}}$", r"\frac{3}{4}"), (r"$\boxed{0.75}$", r"\frac{3}{4}"), ("Answer: 12", "12"),
        (r"\boxed{13}", "12"), ("no idea", "7"), (r"\boxed{7}", "7"), ("7", "7"), (r"\boxed{x^2+1}", "x^2+1")]


@pytest.fixture()
def rewards(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rewards.py").write_text(REWARDS)
    return tmp_path


def _rows(pairs, sources=None) -> pa.Table:
    n = len(pairs)
    return pa.table({
        C.PROMPT_ID: [f"p{i // 4}" for i in range(n)],
        C.SAMPLE_IDX: pa.array([i % 4 for i in range(n)], pa.int32()),
        C.PROMPT_TEXT: [f"question {i // 4}" for i in range(n)],
        C.DATA_SOURCE: sources or ["single", "double"] * (n // 2),
        C.RESPONSE_TEXT: [p[0] for p in pairs],
        C.GROUND_TRUTH: [p[1] for p in pairs],
    })


def _op(reward: str, **params) -> Score:
    return Score(Score.Params(reward=reward, **params), OpContext(node_id="verify"))


@pytest.mark.parametrize("ref, extra", [("builtin:math", ()), ("rewards.py:graded", ("length",)),
                                        ("rewards.py:compute_score", ())])
def test_scores_through_the_server_equal_in_process(rewards, ref, extra):
    rows = _rows(MATH * 3)
    with threaded(make_app(ref, concurrency=3)) as url:
        remote = _op(url, extra_columns=extra, server={"batch_size": 5, "concurrency": 3})
        out = remote(rows)
        assert remote.last_metrics()["score/masked"] == 0 == remote.last_metrics()["score/server_retries"]
        remote.close()
    local = _op(ref, extra_columns=extra)(rows)
    assert out.equals(local)
    assert out.column(C.ACC).to_pylist() != [0.0] * rows.num_rows  # something was right


def test_bad_requests_get_clear_4xx_answers(rewards):
    with threaded(make_app("rewards.py:boom", concurrency=2)) as url:
        post = lambda body, **kw: httpx.post(url + "/score", content=body, trust_env=False, **kw)  # noqa: E731
        health = httpx.get(url + "/health", trust_env=False).json()
        assert health == {"status": "ok", "reward": "rewards.py:boom", "rows_scored": 0}
        bad_json = post(b'{"rows": [')
        assert bad_json.status_code == 400 and "not valid JSON" in bad_json.json()["detail"]
        missing = post(b'{"rows": [{"response": "7"}]}')
        assert missing.status_code == 422 and "rows.0.ground_truth: Field required" in missing.json()["detail"]
        too_many = post(('{"rows": [%s]}' % ",".join(['{"response": "1", "ground_truth": "1"}'] * 4097)).encode())
        assert too_many.status_code == 413 and "at most 4096" in too_many.json()["detail"]
        ok = post(b'{"rows": [{"response": "7", "ground_truth": "7"}, {"response": "x", "ground_truth": "7"},'
                  b' {"response": "1", "ground_truth": "2"}]}')
        assert ok.json() == {"scores": [{"error": "raised ValueError('cannot parse 7')"},
                                        {"error": "raised ValueError('cannot parse x')"}, -1.0]}
        assert httpx.get(url + "/health", trust_env=False).json()["rows_scored"] == 3


def test_a_function_failing_on_a_row_stops_the_run_naming_the_sample_or_masks_it(rewards):
    rows = _rows([("3", "3"), ("x", "7"), ("5", "4"), ("2", "2")] + [("7", "7")] * 4)
    with threaded(make_app("rewards.py:boom")) as url:
        with pytest.raises(RunError, match=r"'http://127\.0\.0\.1:\d+' \(node 'verify'\) raised "
                                           r"ValueError\('cannot parse x'\) \(on the reward server\) for "
                                           r"prompt id 'p0', sample 1"):
            _op(url)(rows)
        op = _op(url, server={"on_error": "mask"})
        out = op(rows)
    # p0: sample 1 masked, its group's mean of (1, -1, 1); p1: all masked, equal (no advantage)
    assert out.column(C.SCORE).to_pylist() == pytest.approx([1, 1 / 3, -1, 1, -1, -1, -1, -1])
    assert out.column(C.ACC).to_pylist() == pytest.approx([1, 2 / 3, 0, 1, 0, 0, 0, 0])
    assert op.last_metrics()["score/masked"] == 5


def test_a_server_that_is_down_fails_after_the_retries_naming_the_url_or_masks(rewards):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    op = _op(url, server={"retries": 2, "backoff_s": 0.01})
    with pytest.raises(RunError, match=rf"reward server {url} \(node 'verify'\): no usable answer to a batch "
                                       r"of 8 rows after 3 attempts; the last: could not reach it \(ConnectError"):
        op(_rows(MATH))
    assert op._client.retried == 2
    masking = _op(url, server={"retries": 1, "backoff_s": 0.01, "on_error": "mask", "batch_size": 3})
    out = masking(_rows(MATH))
    assert out.column(C.SCORE).to_pylist() == [-1.0] * 8 and out.column(C.ACC).to_pylist() == [0.0] * 8
    assert masking.last_metrics()["score/masked"] == 8 and masking.last_metrics()["score/server_retries"] == 3


def _fake(answer) -> FastAPI:
    """FakeRewardServer: answers each POST /score with ``answer(n_rows, call)``; sleeps on ('sleep', s)."""
    app, calls = FastAPI(), []

    @app.post("/score")
    async def score(request: Request):
        n = len((await request.json())["rows"])
        calls.append(n)
        status, body = answer(n, len(calls))
        if status == "sleep":
            await asyncio.sleep(body)
            status, body = 200, {"scores": [1.0] * n}
        return JSONResponse(body, status) if isinstance(body, dict) else Response(body, status)

    app.state.calls = calls
    return app


@pytest.mark.parametrize("answer, last", [
    (lambda n, k: (200, b"<html>oops</html>"), "the reply is not JSON"),
    (lambda n, k: (200, {"scores": [1.0] * (n - 1)}), "7 scores for 8 rows"),
    (lambda n, k: (200, {"scores": ["1.0"] * n}), "score 0 is '1.0': not a finite number"),
    (lambda n, k: (200, {"scores": [{"acc": 1}] * n}), "score 0 is {'acc': 1}"),
    (lambda n, k: (200, {"score": [1.0] * n}), "the reply has no 'scores' list"),
    (lambda n, k: (503, b"busy"), "HTTP 503: 'busy'"),
    (lambda n, k: ("sleep", 3.0), "no answer within timeout_s=0.3 s"),
])
def test_garbage_wrong_counts_errors_and_silence_are_retried_then_named(answer, last):
    app = _fake(answer)
    with threaded(app) as url:
        op = _op(url, server={"retries": 1, "backoff_s": 0.01, "timeout_s": 0.3})
        with pytest.raises(RunError, match=f"reward server {url} .* after 2 attempts; the last: {re.escape(last)}"):
            op(_rows(MATH))
    assert app.state.calls == [8, 8]


def test_a_flaky_server_is_bridged_by_retries_and_a_refusal_is_not_retried(rewards):
    flaky = _fake(lambda n, k: (500, b"restarting") if k <= 2 else (200, {"scores": [0.5] * n}))
    with threaded(flaky) as url:
        op = _op(url, server={"retries": 2, "backoff_s": 0.01})
        assert op(_rows(MATH)).column(C.SCORE).to_pylist() == [0.5] * 8
        assert op.last_metrics()["score/server_retries"] == 2
    refusing = _fake(lambda n, k: (404, b"Not Found"))
    with threaded(refusing) as url:
        with pytest.raises(RunError, match="refused the request with HTTP 404"):
            _op(url, server={"retries": 5, "on_error": "mask"})(_rows(MATH))
    assert refusing.state.calls == [8]


@pytest.mark.slow  # two server start-ups, seconds each
def test_serve_reward_answers_as_in_process_and_a_killed_server_is_an_error_until_restarted(rewards):
    port = free_port()
    rows = _rows(MATH * 2)
    local = _op("rewards.py:compute_score")(rows)
    proc = serve_reward("rewards.py:compute_score", port, rewards, "--concurrency", "2")
    op = _op(f"http://127.0.0.1:{port}", server={"batch_size": 4, "retries": 1, "backoff_s": 0.01})
    try:
        assert op(rows).equals(local)
        stop(proc)  # SIGKILL
        with pytest.raises(RunError, match=f"reward server http://127.0.0.1:{port} .* could not reach it"):
            op(rows)
        proc = serve_reward("rewards.py:compute_score", port, rewards)
        assert op(rows).equals(local)  # the same client, a new server
    finally:
        stop(proc)


@pytest.mark.parametrize("args, message", [
    (["nosuch.py:fn"], "nosuch.py does not exist"),
    (["rewards.py:nope"], "module 'rewards.py' has no attribute 'nope'"),
    (["builtin:nope"], "'builtin:nope' is not a built-in reward: use builtin:addition"),
    (["http://127.0.0.1:8000"], "is an address: serve-reward serves a function"),
    (["builtin:math", "--concurrency", "0"], "--concurrency: must be a whole number 1-1024"),
    (["builtin:math", "--port", "PORT_IN_USE"], "cannot serve on 127.0.0.1:PORT_IN_USE"),
])
def test_bad_serve_reward_input_exits_2_with_a_clear_error(rewards, capsys, args, message):
    import socket

    from dapo_flow.cli import main

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        try:
            status = main(["serve-reward", *(a.replace("PORT_IN_USE", port) for a in args)])
        except SystemExit as exc:  # argparse's own errors
            status = exc.code
    assert status == 2
    assert message.replace("PORT_IN_USE", port) in capsys.readouterr().err


def test_only_loopback_serves_without_a_warning():
    assert host_warning("127.0.0.1") is None and host_warning("localhost") is None and host_warning("::1") is None
    assert "anyone who can reach it" in host_warning("0.0.0.0")


def test_a_masked_row_takes_its_groups_mean():
    from dapo_flow.algos import fill_from_group

    filled = fill_from_group(["a", "a", "a", "b", "b"], np.array([1.0, 5.0, -1.0, 2.0, 3.0]),
                             np.array([False, True, False, True, True]), empty=-1.0)
    assert filled.tolist() == [1.0, 0.0, -1.0, -1.0, -1.0]
