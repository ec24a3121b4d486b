"""update on a mixture-of-experts policy (builtin:tiny-moe): the router metrics it reports, the
same from padded and packed micro-batches and under gradient checkpointing (the router logits
are read from each layout's own token positions); the load-balancing term moving the routers
only when set; and an error for the term on a dense model."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest
import torch

from dapo_flow.core import columns as C
from dapo_flow.core.contract import OpContext
from dapo_flow.errors import ModelError
from dapo_flow.graph.spec import ModelSpec
from dapo_flow.operators.update import Params, Update

# slow: the fast tier stays within its 4 minutes without building tiny-moe (algos/ tests its math there)
pytestmark = [pytest.mark.slow, pytest.mark.models("tiny-moe")]


@pytest.fixture(scope="module")
def moe_dir():
    from dapo_flow.models import resolve_model

    return resolve_model("builtin:tiny-moe", progress=False)


def _batch(tokenizer, eos: int) -> pa.Table:
    """Prompts and responses of different lengths (padding and packing both have work to do)."""
    rows = 6
    prompts = [tokenizer.encode(f"{7 * i}+{i + 1}=") for i in range(rows)]
    responses = [tokenizer.encode(str(8 * i + 1 + i % 2))[: 1 + i % 3] + [eos] for i in range(rows)]
    return pa.table({
        C.PROMPT_IDS: pa.array(prompts, C.TOKENS),
        C.RESPONSE_IDS: pa.array(responses, C.TOKENS),
        C.OLD_LOGP: pa.array([[-1.0] * len(r) for r in responses], C.TOKEN_FLOATS),
        C.ADVANTAGE: pa.array(np.linspace(-1, 1, rows, dtype=np.float32)),
    })


def _update(path, coef: float, **policy_kwargs) -> tuple[dict, dict]:
    """One RL step (one optimizer step of micro-batches of 4 rows, no grad-norm clip: a weight's
    first AdamW step then depends on its own gradient alone); its router metrics and the weights after."""
    from dapo_flow.models.hf import HFPolicy

    policy = HFPolicy(path, trainable=True, **policy_kwargs)
    ctx = OpContext("train", model=SimpleNamespace(policy=policy, spec=ModelSpec(path=str(path))))
    op = Update(Params(lr=1e-2, micro_batch_size=4, grad_clip=1e9, router_aux_loss_coef=coef), ctx)
    op(_batch(policy.tokenizer, policy.eos_id))
    return op.last_metrics(), {k: v.detach().clone() for k, v in policy.model.state_dict().items()}


def test_router_metrics_are_the_same_padded_packed_and_checkpointed(moe_dir):
    padded, padded_weights = _update(moe_dir, 0.1)
    assert sum(padded[f"moe/load_expert_{e}"] for e in range(4)) == pytest.approx(1.0)
    assert 1.0 <= padded["moe/load_max"] <= 4.0 and 0.0 < padded["moe/router_entropy"] <= np.log(4)
    assert padded["moe/aux_loss"] >= 2.0  # k = 2 at perfect balance
    for variant in ({"pack": True}, {"grad_checkpointing": True}):
        metrics, weights = _update(moe_dir, 0.1, **variant)
        assert metrics == pytest.approx(padded, rel=1e-5), variant
        # the routers' step (where the term's gradient goes) as the padded pass's
        for name in ("model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight"):
            torch.testing.assert_close(weights[name], padded_weights[name], rtol=1e-4, atol=1e-6)


def test_the_balance_term_moves_the_routers_only_when_set(moe_dir):
    dropped, without = _update(moe_dir, 0.0)
    kept, with_term = _update(moe_dir, 1.0)
    # the first pass's routing is the same model's: the reported loss does not depend on the weight
    assert kept["moe/aux_loss"] == pytest.approx(dropped["moe/aux_loss"], rel=1e-6)
    gate = "model.layers.0.mlp.gate.weight"
    assert not torch.equal(with_term[gate], without[gate])
    # above the last router nothing feeds the term: the head's gradient, so its step, is the same
    torch.testing.assert_close(with_term["lm_head.weight"], without["lm_head.weight"], rtol=0, atol=1e-7)


def test_a_balance_term_on_a_dense_model_is_an_error(tiny_adder_path):
    from dapo_flow.models.hf import HFPolicy

    policy = HFPolicy(tiny_adder_path, trainable=True)
    ctx = OpContext("train", model=SimpleNamespace(policy=policy, spec=ModelSpec(path=str(tiny_adder_path))))
    with pytest.raises(ModelError, match="router_aux_loss_coef is 0.5 but the model has no experts"):
        Update(Params(router_aux_loss_coef=0.5), ctx)
    assert Update(Params(), ctx).last_metrics() == {}
