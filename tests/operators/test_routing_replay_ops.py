"""Routing replay through the operators on builtin:tiny-moe: `generate` adds the rollout's expert
choices (`routed_experts`) only for a model trained with `train.routing_replay`; a recomputing
`logprob` node replays them and reports the routers' agreement and the logprob mismatch with and
without replay; `update` replays them (on the rollout's own weights: the very step it takes
without replay) and reports the agreement."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest
import torch

from dapo_flow.core import columns as C
from dapo_flow.core.contract import OpContext
from dapo_flow.graph.spec import ModelSpec
from replay_steps import update_step

# slow: the fast tier stays within its 4 minutes without building tiny-moe (algos/ tests its math there)
pytestmark = [pytest.mark.slow, pytest.mark.models("tiny-moe")]


@pytest.fixture(scope="module")
def moe_dir():
    from dapo_flow.models import resolve_model

    return resolve_model("builtin:tiny-moe", progress=False)


def _model(path, replay: bool, **kwargs) -> SimpleNamespace:
    from dapo_flow.models.hf import HFPolicy

    policy = HFPolicy(path, **kwargs)
    spec = ModelSpec(path=str(path), train={"routing_replay": replay})
    return SimpleNamespace(policy=policy, generator=policy, tokenizer=policy.tokenizer, spec=spec,
                           weights_version=0)


def _rollout(path, replay: bool) -> pa.Table:
    from dapo_flow.operators.generate import Generate, Params

    model = _model(path, replay)
    prompts = [model.tokenizer.encode(f"{7 * i}+{i + 1}=") for i in range(4)]
    batch = pa.table({C.PROMPT_ID: pa.array([f"p{i}" for i in range(4)]), C.PROMPT_IDS: pa.array(prompts, C.TOKENS)})
    return Generate(Params(n=3, max_tokens=6), OpContext("rollout", seed=1, model=model))(batch)


@pytest.fixture(scope="module")
def rows(moe_dir) -> pa.Table:
    return _rollout(moe_dir, replay=True)


def test_generate_adds_the_routes_only_under_routing_replay(moe_dir, rows):
    assert rows.schema.field(C.ROUTED_EXPERTS).type == C.SCHEMA[C.ROUTED_EXPERTS]
    for route, prompt, response in zip(rows.column(C.ROUTED_EXPERTS).to_pylist(),
                                       rows.column(C.PROMPT_IDS).to_pylist(), rows.column(C.RESPONSE_IDS).to_pylist()):
        assert len(route) == (len(prompt) + len(response)) * 2 * 2  # tokens x layers x top-2
        assert min(route[:-4]) >= 0 and max(route) < 4  # all but the last token's recorded
    assert C.ROUTED_EXPERTS not in _rollout(moe_dir, replay=False).column_names


def _perturb_routers(policy) -> None:
    """The routers' weights moved by 30% relative noise (seeded): ~3% of these rows' choices change."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in policy.model.named_parameters():
            if ".mlp.gate." in name:
                param.mul_(1 + 0.3 * torch.randn(param.shape, generator=gen))


def test_a_recomputing_logprob_node_replays_and_reports_agreement_and_mismatch(moe_dir, rows):
    from dapo_flow.operators.logprob import Logprob, Params

    model = _model(moe_dir, replay=True)
    _perturb_routers(model.policy)  # a trainer whose routers moved since the rollout
    op = Logprob(Params(with_entropy=False), OpContext("old_logp", model=model))
    out = op(rows)
    metrics = op.last_metrics()
    assert 0.9 < metrics["rollout/routing_agreement"] < 1.0
    assert metrics["rollout/logp_mismatch"] < metrics["rollout/logp_mismatch_unreplayed"]
    # the replayed old logprobs are the column: their mismatch is the one reported
    old = np.concatenate(out.column(C.OLD_LOGP).to_pylist())
    rollout = np.concatenate(rows.column(C.ROLLOUT_LOGP).to_pylist())
    assert np.abs(old - rollout).mean() == pytest.approx(metrics["rollout/logp_mismatch"], rel=1e-5)


def _update(path, rows: pa.Table, replay: bool) -> tuple[dict, dict]:
    return update_step(_model(path, replay, trainable=True), rows, micro_batch_size=4)


def test_update_replays_the_rollouts_routes(moe_dir, rows):
    replayed, after_replay = _update(moe_dir, rows, replay=True)
    plain, after_plain = _update(moe_dir, rows, replay=False)
    assert replayed["moe/routing_agreement"] == 1.0 and "moe/routing_agreement" not in plain
    for name, weight in after_plain.items():  # the rollout's own routing, replayed: the same step
        torch.testing.assert_close(after_replay[name], weight, rtol=0, atol=0, msg=name)
