"""Training groups over NCCL at world 1: a DDP replica and an FSDP2 shard, each the only worker
of its process group, make the update a plain worker makes on the GPU; the FSDP2 group's sharded
checkpoint (weights and optimizer state, written over NCCL) resumes on a plain worker.

World 1 is what one GPU allows; the group's collectives (the broadcast of the weights, the
gradients' all-reduce, FSDP2's all-gathers and reduce-scatters, the global token counts) all
run, over one rank. More ranks: tests/runtime/test_training_group.py (gloo, on Ray)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from group_batches import BATCHES

pytestmark = pytest.mark.gpu

STAGE = "model:policy"
UPDATE = {"lr": 1e-3, "micro_batch_size": 3, "ppo_epochs": 2, "clip_high": 0.28}
UPDATE_OP = "dapo_flow.operators.update:Update"  # where a worker imports the node's class from
#: each model's update: the mixture of experts with its load-balancing loss trained on
UPDATES = {"tiny-adder": UPDATE, "tiny-moe": {**UPDATE, "router_aux_loss_coef": 0.1}}


def _graph(model_path, strategy: str | None, update: dict = UPDATE):
    from dapo_flow.graph.spec import GraphSpec

    return GraphSpec.model_validate({
        "name": "group", "models": {"policy": {"path": str(model_path), "train": {"workers": 1, "strategy": strategy}}},
        "data": {"train": {"source": "builtin:addition"}},
        "nodes": [{"id": "train", "op": "update", "model": "policy", "inputs": ["prompts"], "params": update}],
    })


def _worker(model_path, strategy: str, model_paths: dict | None = None, update: dict = UPDATE):
    """The stage worker of a training group of one (``strategy`` ddp or fsdp2: it joins a process
    group of world size 1 as the executors start group members), or a plain one (``none``)."""
    from dapo_flow.core.ports import free_port
    from dapo_flow.runtime.worker import GroupMember, NodeSetup, StageSetup, StageWorker

    setup = StageSetup(name=STAGE, nodes=(NodeSetup(id="train", op="update", params=update, impl=UPDATE_OP, model="policy"),),
                       models=("policy",), trainable=("policy",), scores=("policy",),
                       model_paths=model_paths or {}, strategy=strategy, workers=1)
    if strategy != "none":
        setup = replace(setup, group=GroupMember(0, 1, "127.0.0.1", free_port()))
    return StageWorker(_graph(model_path, None if strategy == "none" else strategy, update), setup, seed=0)


METRICS = ("actor/pg_loss", "actor/grad_norm", "actor/clipfrac", "actor/ppo_kl", "actor/entropy")


def _train(worker, batches) -> list[dict]:
    """Each step's metrics: the update's row and what it reports besides (a MoE's router metrics)."""
    rows = []
    for table in batches:
        out, info = worker.run_chain(["train"], table)
        rows.append({**info.report[0][1], **out.to_pylist()[0]})
    return rows


def _same(a: dict, b: dict, atol: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    worst = max(float(np.abs(a[k] - b[k]).max()) for k in a)
    assert worst <= atol, worst


def _same_metrics(a: list[dict], b: list[dict]) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for key in METRICS + tuple(k for k in x if k.startswith("moe/")):
            assert x[key] == pytest.approx(y[key], rel=1e-4, abs=1e-6), key


def _plain(builtin, model: str) -> tuple[list[dict], dict]:
    """What a plain worker (no process group) makes of BATCHES: metrics, weights."""
    worker = _worker(builtin(model), "none", update=UPDATES[model])
    try:
        return _train(worker, BATCHES), worker.export_weights("policy")
    finally:
        worker.close()


@pytest.mark.parametrize("model", [pytest.param("tiny-adder"), pytest.param("tiny-moe", marks=pytest.mark.models("tiny-moe"))])
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_a_group_of_one_over_nccl_makes_the_plain_workers_update(builtin, device, strategy, model):
    import torch.distributed as dist

    plain = _plain(builtin, model)
    worker = _worker(builtin(model), strategy, update=UPDATES[model])
    try:
        assert dist.get_backend() == ("nccl" if device.type == "cuda" else "gloo")
        policy = worker.resources["policy"].policy
        assert (policy.sharded, policy.replicated) == (strategy == "fsdp2", strategy == "ddp")
        assert {p.device.type for p in policy.model.parameters()} == {device.type}
        metrics, weights = _train(worker, BATCHES), worker.export_weights("policy")
    finally:
        worker.close()
    assert not dist.is_initialized()  # the worker left its group
    _same_metrics(plain[0], metrics)
    _same(plain[1], weights)


def test_an_fsdp2_checkpoint_written_over_nccl_resumes_on_a_plain_worker(builtin, tmp_path):
    path = builtin("tiny-adder")
    group = _worker(path, "fsdp2")
    try:
        _train(group, BATCHES[:1])
        group.save_models(str(tmp_path))
        states = group.op_states()
        continued = _train(group, BATCHES[1:]), group.export_weights("policy")
    finally:
        group.close()
    assert (tmp_path / "policy" / "dcp" / ".metadata").is_file()
    assert "optimizer" not in states["train"]  # in the shards, beside the weights
    one = _worker(path, "none", {"policy": str(tmp_path / "policy")})
    try:
        one.load_op_states(states)
        resumed = _train(one, BATCHES[1:]), one.export_weights("policy")
    finally:
        one.close()
    _same_metrics(continued[0], resumed[0])
    _same(continued[1], resumed[1])
