"""run.partial_rollouts on Ray: a rollout actor (here two replicas) takes a weight sync while its
generate call is in flight, through a concurrency group of its own; the call goes on with the
new weights, and its tokens say which weights sampled them."""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa
import pytest

from dapo_flow.graph.edits import edit_file, parse_cli_edits
from dapo_flow.graph.plan import Cluster
from dapo_flow.runtime.executors import RayExecutor
from dapo_flow.runtime.setup import stage_setups

STAGE = "rollout:policy"


@pytest.mark.slow  # two actors loading a model (~15 s)
@pytest.mark.shared_ray
def test_a_weight_sync_reaches_replicas_in_the_middle_of_their_generate_call(tmp_path, small_graph, tiny_adder_path):
    import ray

    from dapo_flow.models.hf import HFPolicy

    edits = [("set", "placement.mode=disaggregated"), ("set", "run.rollout_mode=async"),
             ("set", "run.partial_rollouts=true"), ("set", "models.policy.rollout.replicas=2")]
    placed = edit_file(small_graph(tmp_path), parse_cli_edits(edits)).compile(Cluster(cpus=2))
    policy = HFPolicy(tiny_adder_path)
    texts = [f"{a}+{b}=" for a, b in zip(range(3, 35), range(40, 200, 5))]
    prompts = pa.table({"prompt_id": [f"p{i}" for i in range(len(texts))], "prompt_text": texts,
                        "prompt_ids": pa.array([policy.tokenizer.encode(t) for t in texts], pa.list_(pa.int32())),
                        "ground_truth": ["0"] * len(texts), "data_source": ["addition"] * len(texts)})
    rng = np.random.default_rng(0)
    new = {k: v + rng.normal(0, 0.3, v.shape).astype(np.float32) for k, v in policy.named_weights().items()}

    ex = RayExecutor(placed.plan.spec, {STAGE: stage_setups(placed)[STAGE]}, seed=0, resources={STAGE: (1.0, 0.0)})
    try:
        # ~4 s of decoding per replica (16 prompts x 128 samples x up to 56 tokens: near-uniform
        # sampling keeps some rows going); the sync goes in well into it (an actor under load may
        # start its call late: the assertions below hold whichever replica the sync meets)
        generating = ex.rows(STAGE, "run_variant", "rollout", [prompts],
                             {"n": 128, "max_tokens": 56, "temperature": 10.0})
        time.sleep(1.5)
        ex.get(ex.call(STAGE, "import_weights_live", "policy", new, 5))  # into every replica
        _, not_ready = ray.wait(list(generating.table.parts), num_returns=2, timeout=0)
        assert not_ready, "the generate calls ended before the sync: nothing was tested"
        table = ex.fetch(generating.table)
    finally:
        ex.shutdown()
    versions = table.column("rollout_version").to_pylist()
    spanning = sum(len(set(v)) > 1 for v in versions)
    assert spanning > 0, "no response spans the sync: it did not reach a generate call in flight"
    assert all(v == sorted(v) and set(v) <= {0, 5} for v in versions)


@pytest.mark.slow  # a Ray run (~20 s)
@pytest.mark.shared_ray
def test_an_async_run_with_partial_rollouts_syncs_over_the_weight_bus_on_ray(workdir, small_graph):
    """The whole run on Ray: each sync goes over the weight bus (joined by the actor's main
    thread, received in its concurrency group's), and the tokens' versions are what the driver's
    syncs named: never older than their batch, within the staleness bound."""
    from rich.console import Console

    from dapo_flow.runtime import execute
    from dapo_flow.tracking import read_run

    edits = [("set", "placement.mode=disaggregated"), ("set", "run.rollout_mode=async"),
             ("set", "run.partial_rollouts=true")]
    placed = edit_file(small_graph(workdir, steps=4, ckpt=0), parse_cli_edits(edits)).compile(Cluster(cpus=2))
    assert placed.plan.spec.models["policy"].rollout.weight_sync == "broadcast"
    summary = execute(placed, executor="ray", console=Console(file=open(workdir / "log.txt", "w")))
    run = read_run(summary["tracking_uri"], summary["run_id"])
    assert run["status"] == "FINISHED"
    history = run["history"]
    batch = [v for _, v in history["rollout/staleness"]]
    tokens = [v for _, v in history["rollout/token_staleness_max"]]
    assert len(batch) == 4 and all(0 <= t <= b <= 1 for t, b in zip(tokens, batch)), (tokens, batch)
    oldest = [v for _, v in history["batch/rollout_version_min"]]
    # step i+1 trains weights of version i on tokens at most 1 version older (the staleness bound)
    assert oldest[0] == 0 and all(max(0, i - 1) <= v <= i for i, v in enumerate(oldest)), oldest
    assert len([c for c in summary["call_log"] if c[0] == "sync"]) == 4
