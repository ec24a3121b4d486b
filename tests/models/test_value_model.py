"""A value model (`head: value`): loaded from a causal-LM directory with a new zero head or from a
critic's own directory; values read at the position before each response token, independent of
the batch's padding; builtin:tiny-adder-critic is tiny-adder's backbone."""

from __future__ import annotations

import json

import pytest
import torch

from dapo_flow.errors import ModelError
from dapo_flow.models import model_head, resolve_model
from dapo_flow.models.heads import value_head
from dapo_flow.models.hf import HFPolicy


@pytest.fixture(scope="module")
def critic(tiny_adder_path):
    return HFPolicy(tiny_adder_path, head="value", trainable=True)


def _rows(tok):
    prompts = [tok.encode(p) for p in ("1+2=", "10+32=", "7+7=")]
    responses = [tok.encode(r)[1:] for r in ("3", "42", "14")]  # no BOS inside a response
    return prompts, responses


def test_a_value_head_on_a_causal_lm_starts_at_zero(critic):
    prompts, responses = _rows(critic.tokenizer)
    values, mask = critic.response_values(prompts, responses)
    assert values.shape == mask.shape == (3, max(map(len, responses)))
    assert torch.equal(values, torch.zeros_like(values))
    assert mask.sum(1).tolist() == [len(r) for r in responses]


def test_values_are_read_before_each_token_and_do_not_depend_on_padding(critic):
    """V_t is the head's output at the last position of prompt + response[:t] (the state token
    t is sampled from), in a padded batch as alone."""
    prompts, responses = _rows(critic.tokenizer)
    torch.manual_seed(0)
    head = value_head(critic.model)
    with torch.no_grad():
        head.weight.normal_(0, 1.0)
    try:
        values, mask = critic.response_values(prompts, responses, micro_batch_size=2)
        for i, (p, r) in enumerate(zip(prompts, responses)):
            for t in range(len(r)):
                ids = torch.tensor([p + r[:t]])
                with torch.no_grad():
                    alone = critic.model(input_ids=ids).logits[0, -1, 0]
                assert abs(float(values[i, t]) - float(alone)) < 1e-5 * max(1.0, abs(float(alone))), (i, t)
        assert float(values[~mask].abs().sum()) == 0.0
        grad_values, _ = critic.response_values(prompts, responses, grad=True)
        assert grad_values.requires_grad and torch.allclose(grad_values.detach(), values, atol=1e-6)
    finally:
        with torch.no_grad():
            head.weight.zero_()


def test_a_causal_lm_loaded_as_such_has_no_values(tiny_adder_path):
    policy = HFPolicy(tiny_adder_path)
    with pytest.raises(ModelError, match="head: value"):
        policy.response_values([[1, 2]], [[3]])


@pytest.mark.models("tiny-adder-critic")
def test_builtin_critic_is_the_policys_backbone_under_a_zero_value_head(tiny_adder_path):
    critic_dir = resolve_model("builtin:tiny-adder-critic", progress=False)
    config = json.loads((critic_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForTokenClassification"]
    assert model_head("builtin:tiny-adder-critic") == model_head(str(critic_dir)) == "value"
    assert model_head("builtin:tiny-adder") == "lm" and model_head("builtin:tiny-adder", "value") == "value"
    critic = HFPolicy(critic_dir, head="value")
    policy = HFPolicy(tiny_adder_path)
    backbone = policy.model.model.state_dict()
    for name, tensor in critic.model.model.state_dict().items():
        assert torch.equal(tensor, backbone[name]), name
    assert float(value_head(critic.model).weight.abs().sum()) == 0.0
    # a critic's directory (as a checkpoint writes it) keeps its trained head
    with torch.no_grad():
        value_head(critic.model).weight.fill_(0.5)
    out = critic.save(critic_dir.parent / "critic-copy-for-test")
    try:
        reloaded = HFPolicy(out, head="value")
        assert torch.all(value_head(reloaded.model).weight == 0.5)
        assert "lm_head.weight" not in dict(reloaded.iter_weights())
    finally:
        import shutil

        shutil.rmtree(out, ignore_errors=True)
