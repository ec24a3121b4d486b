"""FSDP2 over gloo with real processes (tests/models/fsdp_worker.py is one rank): the update does
not depend on the number of workers, token-budget micro-batches equal one pass, chunked logprobs
equal unchunked ones on a sharded model, and sharded checkpoints resume at another world size with
the same result."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dapo_flow.core.ports import free_port

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("fsdp_worker.py")


def _launch(tmp: Path, name: str, world: int, jobs: dict[str, dict], timeout: float = 300) -> dict[str, dict]:
    """Start `world` ranks that run `jobs` (a name and its keys each) one after another in one
    process group; each job's results (rank 0's file) by its name."""
    outs = {job: tmp / f"{job}.pt" for job in jobs}
    config = tmp / f"{name}.json"
    config.write_text(json.dumps({"world": world, "port": free_port(),
                                  "jobs": [{"out": str(outs[job]), **keys} for job, keys in jobs.items()]}))
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(config), str(rank)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(world)]
    try:
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:  # a rank past the timeout, or left waiting on one that was
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    return {job: torch.load(out) for job, out in outs.items()}


def _same_params(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0, msg=k)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The runs of every test but the last, in three launches (starting the processes costs far
    more than the runs): at world 1, three steps saving a sharded checkpoint after step 2; at
    world 2, the same, the token-budget run, HFPolicy's logprob path whole and chunked (untied and
    tied), and the world-1 checkpoint resumed; at world 1 again, the world-2 checkpoint resumed.
    Each run builds its model and optimizer afresh (torch.manual_seed(0)), as a launch of its own."""
    tmp = tmp_path_factory.mktemp("fsdp")
    results = _launch(tmp, "world_1", 1, {"w1": dict(steps=3, save=str(tmp / "ckpt_1"), save_after=2)})
    results |= _launch(tmp, "world_2", 2, {
        "w2": dict(steps=3, save=str(tmp / "ckpt_2"), save_after=2),
        "w2_budget": dict(steps=3, max_tokens=5),
        **{f"{kind}_{tie}": dict(steps=2, chunk=chunk, tie=tie)
           for tie in (False, True) for kind, chunk in (("whole", None), ("chunked", 3))},
        "resume_1_2": dict(steps=1, load=str(tmp / "ckpt_1")),
    })
    results |= _launch(tmp, "world_1_again", 1, {"resume_2_1": dict(steps=1, load=str(tmp / "ckpt_2"))})
    return tmp, results


def test_two_workers_make_the_update_one_worker_makes(runs):
    _, results = runs
    one, two = results["w1"], results["w2"]
    assert abs(one["losses"][0] - two["losses"][0]) <= 1e-6 * max(1.0, abs(one["losses"][0]))
    _same_params(one["params"], two["params"], atol=1e-5)


def test_token_budget_micro_batches_make_the_same_update(runs):
    _, results = runs
    _same_params(results["w2_budget"]["params"], results["w2"]["params"], atol=1e-5)


@pytest.mark.parametrize("tie", [False, True])
def test_chunked_logprobs_make_the_same_update_on_a_sharded_model(runs, tie):
    """HFPolicy's logprob path with an entropy bonus at world 2: the chunks run inside the root's
    forward, where FSDP2 has gathered the lm_head (or the tied embedding) it multiplies by."""
    _, results = runs
    whole, chunked = results[f"whole_{tie}"], results[f"chunked_{tie}"]
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
def test_a_sharded_checkpoint_resumes_at_another_world_size(runs, saved_at, resumed_at):
    tmp, results = runs
    assert len(list((tmp / f"ckpt_{saved_at}").rglob("*.distcp"))) == saved_at  # a shard file per rank
    resumed = results[f"resume_{saved_at}_{resumed_at}"]  # one step from the checkpoint at `resumed_at`
    _same_params(resumed["params"], results["w2"]["params"], atol=1e-6)  # = 3 uninterrupted steps


def test_a_peer_that_never_joins_is_a_clear_error(tmp_path):
    config = tmp_path / "lonely.json"
    config.write_text(json.dumps({"world": 2, "port": free_port(), "timeout": 2,
                                  "jobs": [{"out": str(tmp_path / "x.pt"), "steps": 1}]}))
    proc = subprocess.run([sys.executable, str(WORKER), str(config), "0"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0
    assert "could not form its process group" in proc.stderr and "did every worker start" in proc.stderr


MEMBER_BUSY_ELSEWHERE = """
import sys, time, torch, torch.distributed as dist
from dapo_flow.models import fsdp
rank, port = int(sys.argv[1]), int(sys.argv[2])
fsdp.init_group(rank, 2, "127.0.0.1", port, timeout_s=2)
if rank == 0:
    time.sleep(4)  # rank 0 sending weights to engines still generating, say
x = torch.ones(3) * (rank + 1)
dist.all_reduce(x)
assert x.tolist() == [3.0, 3.0, 3.0], x
fsdp.destroy_group()
print("ok")
"""


def test_a_collective_waits_for_a_member_busy_elsewhere_longer_than_the_join_timeout():
    """Members must join within the join timeout (2 s here); a collective then waits for a
    member busy elsewhere for longer (4 s), as the others gather a sharded weight with a rank 0
    that first waits for rollout engines to finish generating (fsdp.COLLECTIVE_TIMEOUT_S)."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", MEMBER_BUSY_ELSEWHERE, str(rank), str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(2)]
    try:
        logs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], logs
