"""HFPolicy: sampling contract, logprob recomputation, batch invariance, weights round trip."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from dapo_flow.errors import ModelError
from dapo_flow.models.hf import HFPolicy
from dapo_flow.models.sampling import Rollouts, SamplingConfig
from dapo_flow.data.tasks import AdditionTask


@pytest.fixture(scope="module")
def policy(tiny_adder_path: Path) -> HFPolicy:
    return HFPolicy(tiny_adder_path)


@pytest.fixture(scope="module")
def prompts(policy: HFPolicy) -> list[list[int]]:
    val = AdditionTask().problems("val")[:64]
    return policy.tokenizer([p.prompt for p in val])["input_ids"]


def flat(rows: list[list[float]]) -> np.ndarray:
    return np.concatenate([np.asarray(r, dtype=np.float32) for r in rows])


def check_contract(out: Rollouts, num_prompts: int, cfg: SamplingConfig, eos: int) -> None:
    out.check(num_prompts, cfg, [eos])
    assert out.prompt_index.dtype == np.int32 and out.sample_idx.dtype == np.int32
    assert all(lp <= 0 for lps in out.logprobs for lp in lps)
    assert out.tokens_generated == sum(map(len, out.response_ids)) and out.seconds > 0


def test_contract_check_catches_violations():
    cfg = SamplingConfig(n=1, max_tokens=3)
    good = Rollouts(*Rollouts.layout(2, 1), response_ids=[[5, 2], [5, 6, 7]], logprobs=[[-1.0, -1.0], [-1.0] * 3],
                    truncated=np.array([False, True]))
    good.check(2, cfg, [2])
    bad = [
        (dict(truncated=np.array([True, True])), "truncated=True"),
        (dict(response_ids=[[2, 5], [5, 6, 7]]), "EOS only last"),
        (dict(logprobs=[[-1.0], [-1.0] * 3]), "1 logprobs"),
        (dict(prompt_index=np.array([1, 0], dtype=np.int32)), "contiguous"),
    ]
    for change, match in bad:
        broken = Rollouts(**{**good.__dict__, **change})
        with pytest.raises(ValueError, match=match):
            broken.check(2, cfg, [2])


def test_generate_contract(policy, prompts):
    cfg = SamplingConfig(n=3, max_tokens=6)
    check_contract(policy.generate(prompts[:10], cfg), 10, cfg, policy.eos_id)


def test_truncation(policy, prompts):
    cfg = SamplingConfig(n=2, max_tokens=1, temperature=0.0)
    out = policy.generate(prompts[:8], cfg)
    check_contract(out, 8, cfg, policy.eos_id)
    assert out.truncated.all()  # greedy never answers with a bare EOS


def test_seeded_determinism(policy, prompts):
    cfg = SamplingConfig(n=4, max_tokens=6, seed=5)
    a, b = policy.generate(prompts[:16], cfg), policy.generate(prompts[:16], cfg)
    assert a.response_ids == b.response_ids and a.logprobs == b.logprobs
    c = policy.generate(prompts[:16], SamplingConfig(n=4, max_tokens=6, seed=6))
    assert c.response_ids != a.response_ids


def test_greedy_and_degenerate_truncation_agree(policy, prompts):
    greedy = policy.generate(prompts[:16], SamplingConfig(n=1, temperature=0.0, max_tokens=6))
    top1 = policy.generate(prompts[:16], SamplingConfig(n=2, top_k=1, max_tokens=6, seed=3))
    nucleus = policy.generate(prompts[:16], SamplingConfig(n=2, top_p=1e-6, max_tokens=6, seed=4))
    expected = [r for r in greedy.response_ids for _ in range(2)]
    assert top1.response_ids == expected and nucleus.response_ids == expected


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_rollout_logprobs_match_recomputation(policy, prompts, temperature):
    out = policy.generate(prompts, SamplingConfig(n=4, temperature=temperature, max_tokens=8, seed=1))
    rows = [prompts[i] for i in out.prompt_index]
    logp, ent, mask = policy.response_logprobs(rows, out.response_ids, temperature=temperature)
    assert ent is None and mask.dtype == torch.bool
    assert mask.sum(1).tolist() == [len(r) for r in out.response_ids]
    # KV-cached decoding vs one full forward: float32 rounding only (~1e-6 relative)
    np.testing.assert_allclose(logp[mask].numpy(), flat(out.logprobs), atol=1e-5, rtol=1e-5)
    assert (logp[~mask] == 0).all()


def test_greedy_logprobs_are_temperature_one(policy, prompts):
    out = policy.generate(prompts[:8], SamplingConfig(n=1, temperature=0.0, max_tokens=6))
    logp, _, mask = policy.response_logprobs(prompts[:8], out.response_ids, temperature=0.0)
    np.testing.assert_allclose(logp[mask].numpy(), flat(out.logprobs), atol=1e-5, rtol=1e-5)


def test_batch_composition_invariance(policy):
    tok = policy.tokenizer
    def chars(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    alone = ([tok("3+4=")["input_ids"]], [chars("7") + [policy.eos_id]])
    others = ([tok("12+34=")["input_ids"], tok("1+1=")["input_ids"]], [chars("461"), [5]])
    solo, solo_ent, _ = policy.response_logprobs(*alone, with_entropy=True)
    mixed, mixed_ent, mask = policy.response_logprobs(
        [others[0][0], alone[0][0], others[0][1]], [others[1][0], alone[1][0], others[1][1]], with_entropy=True,
        micro_batch_size=2,  # the row also sits in a different micro-batch than its neighbours
    )
    width = solo.shape[1]
    np.testing.assert_allclose(mixed[1, :width].numpy(), solo[0].numpy(), atol=1e-5)
    np.testing.assert_allclose(mixed_ent[1, :width].numpy(), solo_ent[0].numpy(), atol=1e-5)
    assert not mask[1, width:].any()


def test_pack_layout(policy):
    batch = policy.pack([[1, 5], [1, 6, 7, 8]], [[9, 2], [10]])
    pad = policy.pad_id
    assert batch["input_ids"].tolist() == [[pad, pad, 1, 5, 9, 2], [1, 6, 7, 8, 10, pad]]
    assert batch["attention_mask"].tolist() == [[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]]
    assert batch["position_ids"].tolist() == [[0, 0, 0, 1, 2, 3], [0, 1, 2, 3, 4, 4]]
    assert batch["response_mask"].tolist() == [[True, True], [True, False]]
    assert int(batch["response_start"]) == 4


def test_grad_pass_matches_and_backprops(tiny_adder_path, prompts):
    trainable = HFPolicy(tiny_adder_path, trainable=True)
    out = trainable.generate(prompts[:8], SamplingConfig(n=2, max_tokens=6))
    rows = [prompts[i] for i in out.prompt_index]
    logp, ent, mask = trainable.response_logprobs(rows, out.response_ids, grad=True, with_entropy=True)
    assert logp.requires_grad and ent is not None
    (logp[mask].sum() + ent[mask].sum()).backward()
    assert all(p.grad is not None for p in trainable.model.parameters())
    no_grad, _, _ = trainable.response_logprobs(rows, out.response_ids, micro_batch_size=3)
    np.testing.assert_allclose(logp.detach().numpy(), no_grad.numpy(), atol=1e-6)


def test_named_weights_round_trip(tiny_adder_path, prompts):
    policy = HFPolicy(tiny_adder_path)
    weights = policy.named_weights()
    assert "lm_head.weight" in weights and all(v.dtype == np.float32 for v in weights.values())
    greedy = SamplingConfig(n=1, temperature=0.0, max_tokens=6)
    before = policy.generate(prompts, greedy).response_ids
    rng = np.random.default_rng(0)
    noisy = {k: v + rng.normal(0, 0.05, v.shape).astype(np.float32) for k, v in weights.items()}
    policy.load_weights(noisy)
    assert all(np.array_equal(policy.named_weights()[k], noisy[k]) for k in noisy)
    assert policy.generate(prompts, greedy).response_ids != before
    policy.load_weights(weights)
    assert policy.generate(prompts, greedy).response_ids == before
    weights["model.norm.weight"] = weights["model.norm.weight"][:3]  # named_weights gave copies
    with pytest.raises(ModelError, match="shape"):
        policy.load_weights(weights)
    with pytest.raises(ModelError, match="missing"):
        policy.load_weights({"lm_head.weight": weights["lm_head.weight"]})


def test_tied_embeddings_export_lm_head(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from dapo_flow.models.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=1, tie_word_embeddings=True, architectures=["LlamaForCausalLM"])
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    policy = HFPolicy(tmp_path)
    weights = policy.named_weights()
    np.testing.assert_array_equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])
    weights = {k: v * 0.5 for k, v in weights.items()}
    policy.load_weights(weights)
    assert np.array_equal(policy.named_weights()["lm_head.weight"], weights["model.embed_tokens.weight"])


def test_save_reloads_identically(policy, prompts, tmp_path):
    out = policy.generate(prompts[:8], SamplingConfig(n=2, max_tokens=6))
    rows = [prompts[i] for i in out.prompt_index]
    again = HFPolicy(policy.save(tmp_path / "saved"))
    np.testing.assert_array_equal(
        again.response_logprobs(rows, out.response_ids)[0].numpy(),
        policy.response_logprobs(rows, out.response_ids)[0].numpy(),
    )


def test_errors(tiny_adder_path, policy):
    with pytest.raises(ModelError, match="unknown dtype 'fp8'"):
        HFPolicy(tiny_adder_path, dtype="fp8")
    with pytest.raises(ModelError, match="empty prompt"):
        policy.generate([[]], SamplingConfig(n=1))
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(n=1, top_p=0.0)


def test_a_batch_of_the_rl_step_size_samples_every_row(policy, prompts):
    """64 prompts x 8 samples x up to 8 tokens (the RL step size the TRL reference runs at; its
    speed is benchmarks/generation.py's): every sample, counted as it was generated."""
    cfg = SamplingConfig(n=8, max_tokens=8, seed=0)
    out = policy.generate(prompts, cfg)
    assert len(out) == len(prompts) * 8 and sorted(set(out.prompt_index)) == list(range(len(prompts)))
    assert out.tokens_generated == sum(map(len, out.response_ids)) > 0
    assert all(1 <= len(r) <= 8 for r in out.response_ids) and out.tokens_per_second > 0


def test_the_hf_policy_is_both_engines_of_the_hybrid_backend(policy, tiny_adder_path):
    from dapo_flow.models.engines import BACKENDS, RolloutEngine, TrainablePolicy

    assert isinstance(policy, TrainablePolicy) and isinstance(policy, RolloutEngine)
    hf = BACKENDS["hf"]
    assert hf.generates_with_trainer
    assert hf.factory()(tiny_adder_path, dtype="float32", device="cpu", seed=0, trainer=policy) is policy
    frozen = hf.factory()(tiny_adder_path, dtype="float32", device="cpu", seed=0)
    assert isinstance(frozen, HFPolicy) and frozen is not policy


def test_gradient_checkpointing_gives_the_same_gradients_and_leaves_rollout_alone(tiny_adder_path, prompts):
    responses = [[5, 6, 7], [8, 9], [4, 4, 4, 4]]
    grads = []
    for checkpointing in (False, True):
        policy = HFPolicy(tiny_adder_path, trainable=True, grad_checkpointing=checkpointing)
        calls, layer = [], policy.model.model.layers[0]
        forward = layer.forward
        layer.forward = lambda *a, **k: (calls.append(1), forward(*a, **k))[1]  # hooks skip recomputes
        logp, _, mask = policy.response_logprobs(prompts[:3], responses, grad=True)
        (-(logp * mask).sum()).backward()
        assert len(calls) == (2 if checkpointing else 1)  # recomputed in the backward pass
        grads.append({n: p.grad.clone() for n, p in policy.model.named_parameters()})
        assert not policy.model.training  # back in eval mode: generation keeps its KV cache
        greedy = SamplingConfig(n=1, temperature=0.0, max_tokens=8)
        assert policy.generate(prompts[:4], greedy).response_ids == HFPolicy(tiny_adder_path).generate(
            prompts[:4], greedy).response_ids
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-6, rtol=1e-5, msg=name)
