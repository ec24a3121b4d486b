"""`train.lora` in a graph: its settings checked where they are written, a reference on the
trained model allowed only under LoRA (it reads the base), `explain` saying what trains, and
the memory estimate pricing the adapters' state only, with peft's parameter count."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from dapo_flow.errors import GraphError
from dapo_flow.graph.explain import explain
from dapo_flow.graph.edits import edit_file, parse_cli_edits
from dapo_flow.graph.memory import ModelShape, estimate_training, lora_param_count
from dapo_flow.graph.plan import Cluster

ROOT = Path(__file__).resolve().parents[1]
GRPO = ROOT / "graphs" / "grpo.yaml"
REF = [("insert", "ref_logp:logprob:after=old_logp:model=policy"), ("set", "ref_logp.role=ref"),
       ("set", "train.kl_coef=0.001")]


def _compile(edits: list[tuple[str, str]]):
    return edit_file(GRPO, parse_cli_edits(edits)).compile(Cluster(cpus=2))


def test_lora_settings_are_problems_at_their_own_keys():
    with pytest.raises(GraphError) as info:
        _compile([("set", "models.policy.train.lora.rank=0"), ("set", "models.policy.train.lora.dropout=1.5"),
                  ("set", "models.policy.train.lora.target_modules=[]")])
    text = str(info.value)
    for key in ("lora.rank", "lora.dropout", "lora.target_modules"):
        assert f"models.policy.train.{key}" in text
    assert "name at least one module" in text


def test_a_reference_on_the_trained_model_needs_lora():
    with pytest.raises(GraphError, match="(?s)a reference model must stay frozen.*train.lora"):
        _compile(REF)
    placed = _compile(REF + [("set", "models.policy.train.lora.rank=8")])
    assert "ref_logp" in [n.id for n in placed.plan.nodes]
    text = explain(placed)
    assert "LoRA rank 8 alpha 16 on all-linear: 23.6k trained parameters" in text
    assert "base weights (frozen)" in text and "LoRA adapters" in text


LLAMA = dict(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj"], ["down_proj"]])
def test_the_adapters_counted_are_peft_s(targets):
    from transformers import LlamaConfig, LlamaForCausalLM

    from dapo_flow.models.lora import add_adapters, trainable_count

    model = LlamaForCausalLM(LlamaConfig(**LLAMA))
    add_adapters(model, SimpleNamespace(rank=8, alpha=16.0, target_modules=targets, dropout=0.0), trainable=True)
    assert lora_param_count(ModelShape.from_config(LLAMA), 8, targets) == trainable_count(model)


def test_lora_prices_gradients_and_adamw_state_of_the_adapters_only():
    shape = ModelShape.from_config(LLAMA)
    kw = dict(micro_batch_tokens=256, response_tokens_per_micro_batch=128, on_gpu=False)
    full = {t.name: t.bytes for t in estimate_training(shape, **kw).terms}
    lora = lora_param_count(shape, 8, "all-linear")
    adapted = {t.name: t.bytes for t in estimate_training(shape, lora_params=lora, **kw).terms}
    assert adapted["base weights (frozen)"] == full["parameters"]
    assert adapted["gradients"] == adapted["LoRA adapters"] == lora * 4
    assert adapted["AdamW moments"] == 2 * lora * 4 < full["AdamW moments"] / 2
    # a bf16 base under mixed precision stays bf16 (only the adapters are float32 masters)
    bf16 = {t.name: t.bytes for t in estimate_training(shape, lora_params=lora, dtype="bfloat16",
                                                       mixed_precision="bf16", **kw).terms}
    assert bf16["base weights (frozen)"] == shape.num_params() * 2 and "bf16 weight copies (autocast)" not in bf16


def test_lora_on_a_value_model_is_refused_at_its_key():
    edits = [("set", "models.critic.train.lora.rank=8")]
    with pytest.raises(GraphError, match="(?s)models.critic.train.lora.*value head.*without train.lora"):
        edit_file(ROOT / "graphs" / "ppo.yaml", parse_cli_edits(edits)).compile(Cluster(cpus=2))
