"""`train.lora`: LoRA adapters through peft. Only the adapters train (AdamW state is theirs
alone); what leaves the trainer is the merged model under the base names, equal to peft's own
merge and loadable by a plain copy; a reference reads the base with the adapters off; the
adapters save in peft's format (PeftModel loads them) and load back exactly."""

from __future__ import annotations

import pytest
import torch

from dapo_flow.errors import ModelError
from dapo_flow.graph.spec import LoraSpec, ModelSpec
from dapo_flow.models import lora as lora_lib
from dapo_flow.models.hf import HFPolicy

from test_mixed_precision import _batch, _problems, _update, _with_old_logp

LORA = LoraSpec(rank=4, alpha=8)


def _tiny_qwen2(out) -> str:
    """A random Qwen2-shaped model (GQA, biased q/k/v) with tiny-adder's tokenizer."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from dapo_flow.models import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model("builtin:tiny-adder"))
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=64, eos_token_id=tok.eos_token_id,
                                         pad_token_id=tok.pad_token_id))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


@pytest.fixture(params=["llama", "qwen2"])
def model_path(request, tiny_adder_path, tmp_path) -> str:
    return str(tiny_adder_path) if request.param == "llama" else _tiny_qwen2(tmp_path / "qwen2")


def _randomise_adapters(policy: HFPolicy, seed: int = 1) -> None:
    """Non-zero B (fresh adapters are the identity: lora_B starts at zero)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


IDS = torch.tensor([[1, 5, 7, 9, 11, 3, 4]])


def test_only_the_adapters_train_and_fresh_ones_change_nothing(model_path):
    base = HFPolicy(model_path, trainable=True)
    adapted = HFPolicy(model_path, trainable=True, lora=LORA)
    trained = {n for n, p in adapted.model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert lora_lib.trainable_count(adapted.model) < 0.5 * lora_lib.trainable_count(base.model)
    # every linear of the decoder is adapted (all-linear), the output head is not
    assert any(".self_attn.q_proj." in n for n in trained) and any(".mlp.down_proj." in n for n in trained)
    assert not any("lm_head" in n for n in trained)
    torch.testing.assert_close(_logits(adapted.model, IDS), _logits(base.model, IDS), rtol=0, atol=0)


def test_named_target_modules_and_unknown_ones(tiny_adder_path):
    policy = HFPolicy(tiny_adder_path, trainable=True, lora=LoraSpec(rank=2, target_modules=["q_proj", "v_proj"]))
    adapted = {n.rsplit(".lora_", 1)[0] for n, p in policy.model.named_parameters() if p.requires_grad}
    assert adapted and all(n.endswith(("q_proj", "v_proj")) for n in adapted)
    with pytest.raises(ModelError, match="target_modules"):
        HFPolicy(tiny_adder_path, trainable=True, lora=LoraSpec(rank=2, target_modules=["qkv_proj"]))


def test_the_merged_weights_load_into_a_plain_copy_that_computes_the_adapted_model(model_path):
    policy = HFPolicy(model_path, trainable=True, lora=LORA)
    _randomise_adapters(policy)
    merged = dict(policy.iter_weights())
    plain = HFPolicy(model_path)
    assert set(merged) == set(plain.model.state_dict()) | {"lm_head.weight"}
    assert [m.name for m in policy.weight_manifest()] == list(merged)
    assert [tuple(m.shape) for m in policy.weight_manifest()] == [tuple(v.shape) for v in merged.values()]
    plain.load_weights(merged.items())  # what a rollout copy or vLLM receives
    torch.testing.assert_close(_logits(plain.model, IDS), _logits(policy.model, IDS), rtol=1e-5, atol=1e-5)
    assert policy.named_weights().keys() == merged.keys()


def test_adapters_save_in_peft_format_and_load_back_exactly(model_path, tmp_path):
    from peft import PeftModel

    policy = HFPolicy(model_path, trainable=True, lora=LORA)
    _randomise_adapters(policy)
    out = policy.save(tmp_path / "ckpt")
    assert lora_lib.is_adapter_dir(out) and lora_lib.base_of(out) == str(policy.path)
    assert not (out / "model.safetensors").exists()  # the adapters only, not the base again
    # peft reads it as its own: the same function as the policy's
    peft_model = PeftModel.from_pretrained(HFPolicy(model_path).model, str(out))
    torch.testing.assert_close(_logits(peft_model, IDS), _logits(policy.model, IDS), rtol=1e-5, atol=1e-5)
    # ... and its merge_and_unload is what the policy's weight sync sends
    merged = peft_model.merge_and_unload().state_dict()
    for name, value in policy.iter_weights():
        if name in merged:
            torch.testing.assert_close(value, merged[name], rtol=1e-6, atol=1e-6)
    # a policy made from the checkpoint's adapters is the saved one, bit for bit
    loaded = HFPolicy(model_path, trainable=True, lora=LORA, adapters=out)
    torch.testing.assert_close(_logits(loaded.model, IDS), _logits(policy.model, IDS), rtol=0, atol=0)
    with pytest.raises(ModelError, match="rank"):
        HFPolicy(model_path, trainable=True, lora=LoraSpec(rank=8), adapters=out)


def test_the_base_weights_are_the_model_without_its_adapters(model_path):
    base = HFPolicy(model_path)
    policy = HFPolicy(model_path, trainable=True, lora=LORA)
    _randomise_adapters(policy)
    flags = {n: p.requires_grad for n, p in policy.model.named_parameters()}
    assert not torch.allclose(_logits(policy.model, IDS), _logits(base.model, IDS))
    with policy.base_weights():
        torch.testing.assert_close(_logits(policy.model, IDS), _logits(base.model, IDS), rtol=0, atol=0)
    assert {n: p.requires_grad for n, p in policy.model.named_parameters()} == flags
    full = HFPolicy(model_path, trainable=True)
    with full.base_weights():  # without LoRA: the policy itself
        torch.testing.assert_close(_logits(full.model, IDS), _logits(base.model, IDS), rtol=0, atol=0)


def test_the_logprob_nodes_reference_pass_reads_the_base_and_leaves_the_adapters_on(model_path):
    """The `logprob` operator with role ref on a LoRA policy whose adapters have moved: its
    ref_logp are the base model's own logprobs (the adapters off for the pass), an actor pass
    before and after it reads the adapted model (the adapters back on)."""
    from types import SimpleNamespace

    from dapo_flow.core import columns as C
    from dapo_flow.core.contract import OpContext
    from dapo_flow.operators.logprob import Logprob, Params

    base = HFPolicy(model_path)
    policy = HFPolicy(model_path, trainable=True, lora=LORA)
    _randomise_adapters(policy)
    batch = _batch(policy, _problems(4))

    def node(role: str):
        return Logprob(Params(role=role, with_entropy=False), OpContext(role, model=SimpleNamespace(policy=policy)))

    adapted = node("actor")(batch).column(C.OLD_LOGP).to_pylist()
    ref = node("ref")(batch).column(C.REF_LOGP).to_pylist()
    again = node("actor")(batch).column(C.OLD_LOGP).to_pylist()
    logp, _, mask = base.response_logprobs(batch.column(C.PROMPT_IDS).to_pylist(),
                                           batch.column(C.RESPONSE_IDS).to_pylist())
    want = [row[m].tolist() for row, m in zip(logp, mask.bool())]
    assert [len(r) for r in ref] == [len(r) for r in want]
    torch.testing.assert_close(torch.tensor(sum(ref, [])), torch.tensor(sum(want, [])), rtol=0, atol=1e-6)
    assert again == adapted  # the adapters are on again after the reference pass
    assert max(abs(a - b) for a, b in zip(sum(adapted, []), sum(want, []))) > 1e-3  # and they matter


def test_an_update_trains_the_adapters_only_and_keeps_state_for_them_only(tiny_adder_path):
    spec = ModelSpec(path="builtin:tiny-adder", train={"lora": {"rank": 4, "alpha": 8}})
    policy = HFPolicy(tiny_adder_path, trainable=True, lora=spec.train.lora)
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    batch = _with_old_logp(policy, _batch(policy, _problems(8)))
    update = _update(policy, spec)
    update(batch)  # lora_B starts at zero, so the first step moves B only (A's gradient is B^T ...)
    changed = {n for n, p in policy.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(".lora_B." in n for n in changed)
    update(_with_old_logp(policy, batch.drop_columns(["old_logp"])))
    changed = {n for n, p in policy.model.named_parameters() if not torch.equal(p, before[n])}
    assert any(".lora_A." in n for n in changed) and all(".lora_" in n for n in changed)
    state = update.trainer.optimizer.state
    assert len(state) == sum(1 for n, p in policy.model.named_parameters() if ".lora_" in n)


def test_a_value_head_is_refused(tiny_adder_path):
    with pytest.raises(ModelError, match="lora"):  # a new head must train in full (validate says so first)
        HFPolicy(tiny_adder_path, trainable=True, lora=LORA, head="value")


def test_lora_settings_are_checked():
    with pytest.raises(ValueError, match="rank"):
        LoraSpec(rank=0)
    with pytest.raises(ValueError, match="at least one module"):
        LoraSpec(rank=4, target_modules=[])


def test_the_adapters_dropout_applies_in_gradient_passes_only(tiny_adder_path):
    policy = HFPolicy(tiny_adder_path, trainable=True, lora=LoraSpec(rank=4, dropout=0.5))
    assert not any(m.training for m in policy.model.modules())  # injected modules follow the model's eval
    _randomise_adapters(policy)
    prompts, responses = [[1, 5, 6, 7]], [[8, 9, 3]]
    grads = [policy.response_logprobs(prompts, responses, grad=True)[0].detach() for _ in range(4)]
    assert any(not torch.equal(grads[0], g) for g in grads[1:])  # dropout: a new mask each pass
    assert not any(m.training for m in policy.model.modules())  # off again after
    scored = [policy.response_logprobs(prompts, responses)[0] for _ in range(2)]
    assert torch.equal(scored[0], scored[1])  # rollout and old logprobs see no dropout
