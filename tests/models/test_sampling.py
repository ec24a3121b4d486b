"""Per-sample random streams: a prompt's samples depend on its seed only, never on the batch
it shares, the chunking, or the engine / replica / worker that runs it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dapo_flow.models.hf import HFPolicy
from dapo_flow.models.sampling import SamplingConfig, sample_keys, uniforms
from dapo_flow.operators.generate import prompt_seed


def test_uniforms_are_uniform_and_independent_across_steps_and_rows():
    keys = sample_keys(list(range(500)), 8)  # 4000 rows
    u0, u1 = uniforms(keys, 0), uniforms(keys, 1)
    assert u0.min() >= 0 and u0.max() < 1
    assert abs(u0.mean() - 0.5) < 0.02 and abs(u0.var() - 1 / 12) < 0.005
    assert abs(np.corrcoef(u0, u1)[0, 1]) < 0.05  # successive draws of a row
    assert abs(np.corrcoef(u0[:-1], u0[1:])[0, 1]) < 0.05  # neighbouring rows
    assert len(np.unique(keys)) == len(keys)


def test_inverse_cdf_sampling_follows_the_distribution_and_skips_filtered_tokens():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -30.0]]).repeat(20000, 1)
    u = torch.from_numpy(uniforms(sample_keys(list(range(20000)), 1), 0))
    tok, _, finite = HFPolicy._sample(logits, SamplingConfig(n=1, top_k=3), u)
    assert bool(finite)
    freq = np.bincount(tok.numpy(), minlength=5) / len(tok)
    expected = torch.tensor([2.0, 1.0, 0.0]).softmax(-1).numpy()
    np.testing.assert_allclose(freq[:3], expected, atol=0.012)
    assert freq[3:].sum() == 0  # outside top-k: never drawn


def test_a_prompts_samples_do_not_depend_on_its_batch_or_chunking(tiny_adder_path):
    policy = HFPolicy(tiny_adder_path)
    tok = policy.tokenizer
    prompts = [tok(f"{a}+{b}=")["input_ids"] for a, b in ((3, 4), (12, 34), (50, 7), (99, 99), (1, 0))]
    seeds = [prompt_seed(0, 3, f"p{i}") for i in range(len(prompts))]
    cfg = SamplingConfig(n=4, temperature=1.0, max_tokens=6, prompt_seeds=tuple(seeds))
    together = policy.generate(prompts, cfg)
    policy.max_batch_samples = 4  # one prompt per chunk
    for i in (1, 3):
        alone = policy.generate([prompts[i]], SamplingConfig(n=4, temperature=1.0, max_tokens=6,
                                                             prompt_seeds=(seeds[i],)))
        assert alone.response_ids == together.response_ids[4 * i:4 * i + 4]
        for a, b in zip(alone.logprobs, together.logprobs[4 * i:4 * i + 4]):
            np.testing.assert_allclose(a, b, atol=1e-5)
    assert len({tuple(r) for r in together.response_ids}) > 4  # samples differ within and across prompts


def test_prompt_seeds_are_stable_and_distinct():
    assert prompt_seed(0, 0, "a") == prompt_seed(0, 0, "a") == 2 ** 63 - 1 & prompt_seed(0, 0, "a")
    assert len({prompt_seed(s, c, p) for s in range(3) for c in range(3) for p in "abc"}) == 27
    with pytest.raises(ValueError, match="2 prompt seeds for 3 prompts"):
        SamplingConfig(n=1, prompt_seeds=(1, 2)).seeds_for(3)
