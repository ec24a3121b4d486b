"""A mixture-of-experts policy in training groups: a 2-worker FSDP2 group and a 2-worker DDP group
on Ray make the update one unsharded worker makes on builtin:tiny-moe, its load-balancing loss
trained on (per sequence, so the workers' shares add up to one worker's loss) and its router
metrics the whole group's."""

from __future__ import annotations

import numpy as np
import pytest

from dapo_flow.graph.spec import GraphSpec
from dapo_flow.runtime.executors import LocalExecutor, RayExecutor
from dapo_flow.runtime.worker import NodeSetup, StageSetup
from group_batches import BATCHES

pytestmark = [pytest.mark.slow, pytest.mark.models("tiny-moe")]

STAGE = "model:policy"
# a balance weight far above Qwen3-MoE's 0.001, so that a term the group got wrong would show
UPDATE = {"lr": 1e-3, "micro_batch_size": 3, "ppo_epochs": 2, "router_aux_loss_coef": 0.1}
COMPARED = ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "moe/aux_loss", "moe/router_entropy",
            "moe/load_max", "moe/load_expert_0", "moe/load_expert_3")


def _graph(model_path, workers: int, strategy: str | None) -> GraphSpec:
    return GraphSpec.model_validate({
        "name": "moe-group", "models": {"policy": {"path": str(model_path),
                                                   "train": {"workers": workers, "strategy": strategy}}},
        "data": {"train": {"source": "builtin:addition"}},
        "nodes": [{"id": "train", "op": "update", "model": "policy", "inputs": ["prompts"], "params": UPDATE}],
    })


def _setup(workers: int, strategy: str) -> StageSetup:
    return StageSetup(
        name=STAGE, nodes=(NodeSetup(id="train", op="update", params=UPDATE,
                                     impl="dapo_flow.operators.update:Update", model="policy"),),
        models=("policy",), trainable=("policy",), scores=("policy",), num_threads=1,
        model_paths={}, strategy=strategy, workers=workers)


def _train(ex) -> tuple[list[dict], dict]:
    """Each step's metrics (the update's row and its router metrics), then the weights."""
    steps = []
    for table in BATCHES:
        _, info = ex.get(ex.call(STAGE, "run_chain", ["train"], table))
        steps.append(dict(info.report[0][1]))
    return steps, ex.get(ex.call(STAGE, "export_weights", "policy"))


@pytest.fixture(scope="module")
def moe_path():
    from dapo_flow.models import resolve_model

    return resolve_model("builtin:tiny-moe", progress=False)


@pytest.fixture(scope="module")
def one_worker(moe_path):
    ex = LocalExecutor(_graph(moe_path, 1, None), {STAGE: _setup(1, "none")}, seed=0)
    try:
        return _train(ex)
    finally:
        ex.shutdown()


@pytest.mark.parametrize("strategy", ["fsdp2", "ddp"])
def test_two_workers_make_the_moe_update_one_worker_makes(ray_cluster, moe_path, one_worker, strategy):
    one_metrics, one_weights = one_worker
    two = RayExecutor(_graph(moe_path, 2, strategy), {STAGE: _setup(2, strategy)}, seed=0,
                      resources={STAGE: (1.0, 0.0)})
    try:
        two_metrics, two_weights = _train(two)
    finally:
        two.shutdown()
    for x, y in zip(one_metrics, two_metrics, strict=True):
        for key in COMPARED:
            assert x[key] == pytest.approx(y[key], rel=1e-4, abs=1e-6), key
    loads = [one_metrics[0][f"moe/load_expert_{e}"] for e in range(4)]
    assert sum(loads) == pytest.approx(1.0) and one_metrics[0]["moe/aux_loss"] >= 2.0  # k = 2 at best
    assert one_weights.keys() == two_weights.keys()
    worst = max(float(np.abs(one_weights[k] - two_weights[k]).max()) for k in one_weights)
    assert worst <= 1e-5, worst
    start = _start_weights(moe_path)
    for name in ("model.layers.0.mlp.gate.weight", "model.layers.1.mlp.experts.gate_up_proj"):
        assert not np.allclose(one_weights[name], start[name]), name  # routers and experts both trained


def _start_weights(path) -> dict:
    """The model's weights as loaded (the file holds each expert apart; the model fuses them)."""
    from transformers import AutoModelForCausalLM

    return {k: v.numpy() for k, v in AutoModelForCausalLM.from_pretrained(path).state_dict().items()}
