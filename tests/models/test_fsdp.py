"""FSDP2 over gloo with real processes (tests/models/fsdp_worker.py is one rank): the update does
not depend on the number of workers, token-budget micro-batches equal one pass, chunked logprobs
equal unchunked ones on a sharded model, and sharded checkpoints resume at another world size with
the same result."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("fsdp_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tmp: Path, name: str, world: int, timeout: float = 120, **cfg) -> dict:
    out = tmp / f"{name}.pt"
    config = tmp / f"{name}.json"
    config.write_text(json.dumps({"world": world, "port": _free_port(), "out": str(out), **cfg}))
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(config), str(rank)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(world)]
    logs = [p.communicate(timeout=timeout)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    return torch.load(out) if out.exists() else {"logs": logs}


def _same_params(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0, msg=k)


@pytest.fixture(scope="module")
def three_steps(tmp_path_factory):
    """Three steps at world 1 and at world 2, each saving a sharded checkpoint after step 2."""
    tmp = tmp_path_factory.mktemp("fsdp")
    return (tmp, _run(tmp, "w1", 1, steps=3, save=str(tmp / "ckpt_1"), save_after=2),
            _run(tmp, "w2", 2, steps=3, save=str(tmp / "ckpt_2"), save_after=2))


def test_two_workers_make_the_update_one_worker_makes(three_steps):
    _, one, two = three_steps
    assert abs(one["losses"][0] - two["losses"][0]) <= 1e-6 * max(1.0, abs(one["losses"][0]))
    _same_params(one["params"], two["params"], atol=1e-5)


def test_token_budget_micro_batches_make_the_same_update(three_steps):
    tmp, _, two = three_steps
    budgeted = _run(tmp, "w2_budget", 2, steps=3, max_tokens=5)
    _same_params(budgeted["params"], two["params"], atol=1e-5)


@pytest.mark.parametrize("tie", [False, True])
def test_chunked_logprobs_make_the_same_update_on_a_sharded_model(tmp_path, tie):
    """HFPolicy's logprob path with an entropy bonus at world 2: the chunks run inside the root's
    forward, where FSDP2 has gathered the lm_head (or the tied embedding) it multiplies by."""
    whole = _run(tmp_path, "whole", 2, steps=2, chunk=None, tie=tie)
    chunked = _run(tmp_path, "chunked", 2, steps=2, chunk=3, tie=tie)
    for a, b in zip(whole["losses"], chunked["losses"]):
        assert abs(a - b) <= 1e-6 * max(1.0, abs(a))
    # the weights after two AdamW steps (lr 1e-3) within 1% of one step, as the world-size tests:
    # Adam divides by the gradient's running RMS, so a near-zero gradient's float rounding (the
    # chunks sum the head's product in another order) moves its weight by more than its own size
    # (AVX-512 kernels: one weight of 8192 moved 2.1e-6)
    _same_params(chunked["params"], whole["params"], atol=1e-5)
    for a, b in zip(whole["scored"], chunked["scored"]):  # logp, entropy without gradients
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0)


@pytest.mark.parametrize("saved_at, resumed_at", [(2, 1), (1, 2)])
def test_a_sharded_checkpoint_resumes_at_another_world_size(three_steps, saved_at, resumed_at):
    tmp, _, two = three_steps
    ckpt = tmp / f"ckpt_{saved_at}"
    assert any(ckpt.iterdir())  # every rank wrote its shards there
    resumed = _run(tmp, f"resume_{saved_at}_{resumed_at}", resumed_at, steps=1, load=str(ckpt))
    _same_params(resumed["params"], two["params"], atol=1e-6)  # = 3 uninterrupted steps


def test_a_peer_that_never_joins_is_a_clear_error(tmp_path):
    config = tmp_path / "lonely.json"
    config.write_text(json.dumps({"world": 2, "port": _free_port(), "out": str(tmp_path / "x.pt"),
                                  "steps": 1, "timeout": 5}))
    proc = subprocess.run([sys.executable, str(WORKER), str(config), "0"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0
    assert "could not form its process group" in proc.stderr and "did every worker start" in proc.stderr
