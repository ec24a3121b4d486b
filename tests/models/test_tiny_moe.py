"""builtin:tiny-moe: a Qwen3-MoE of 4 experts (top-2) on tiny-adder's task and tokenizer, warm-started
to mixed accuracy, its shape declared before it is built, its routers found."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dapo_flow.models import model_config, reads_tokens_of, resolve_model
from dapo_flow.recipes.tiny_moe import RECIPE, RECIPE_VERSION
from dapo_flow.recipes.warm_start import BUILD_INFO

BAND = (0.20, 0.50)  # sampled (temperature 1) val accuracy: RL needs right and wrong samples, as tiny-adder's

# slow: the fast tier stays within its 4 minutes without building tiny-moe (algos/ tests its math there)
pytestmark = [pytest.mark.slow, pytest.mark.models("tiny-moe")]


@pytest.fixture(scope="module")
def moe_dir() -> Path:
    return resolve_model("builtin:tiny-moe", progress=False)


def test_tiny_moe_is_a_qwen3_moe_of_the_declared_shape_and_tiny_adders_tokenizer(moe_dir: Path,
                                                                                  tiny_adder_path: Path):
    assert moe_dir.name == f"tiny-moe-v{RECIPE_VERSION}"
    built = json.loads((moe_dir / "config.json").read_text())
    declared = model_config("builtin:tiny-moe")
    assert declared == {k: built[k] for k in declared}
    assert built["architectures"] == ["Qwen3MoeForCausalLM"] and built["norm_topk_prob"] is True
    assert (moe_dir / "tokenizer.json").read_bytes() == (tiny_adder_path / "tokenizer.json").read_bytes()
    assert reads_tokens_of("builtin:tiny-moe", "builtin:tiny-adder") is True


def test_tiny_moe_has_mixed_accuracy_and_routes_through_every_layers_experts(moe_dir: Path):
    import torch

    from dapo_flow.models.hf import HFPolicy
    from dapo_flow.models.moe import router_logits_recorded, routing_of

    info = json.loads((moe_dir / BUILD_INFO).read_text())
    assert info["recipe_version"] == RECIPE_VERSION and BAND[0] <= info["val_sampled_accuracy"] <= BAND[1]
    policy = HFPolicy(moe_dir)
    routing = routing_of(policy.model)
    assert routing is not None and (routing.num_experts, routing.top_k) == (RECIPE.num_experts, 2)
    assert len(routing.routers) == RECIPE.num_layers  # every layer sparse
    prompt = policy.tokenizer(["12+34="])["input_ids"]
    with router_logits_recorded(routing) as seen, torch.no_grad():
        policy.model(input_ids=torch.tensor(prompt))
    assert [tuple(x.shape) for x in seen] == [(len(prompt[0]), RECIPE.num_experts)] * RECIPE.num_layers
