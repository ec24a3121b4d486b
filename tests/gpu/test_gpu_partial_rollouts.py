"""Partial rollouts on CUDA: weights loaded mid-generation take over from the next token also
where the engine looks at the device only every `host_sync_every` tokens (the swap is the host's
decision, made between decode steps, without a device sync); each token's logprob is its
version's, teacher-forced on the device."""

from __future__ import annotations

import numpy as np
import pytest

from dapo_flow.models.hf import HFPolicy
from dapo_flow.models.sampling import SamplingConfig
from weight_swaps import assert_each_token_is_its_versions, swap_after_forward

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("swap_after", [3, 18])  # inside the first block of host syncs, and after it
def test_weights_loaded_mid_generation_on_the_device(device, builtin, swap_after):
    path = builtin("tiny-adder")
    old = HFPolicy(path, device=str(device), seed=0)
    rng = np.random.default_rng(0)
    new_weights = {k: v + rng.normal(0, 0.3, v.shape).astype(np.float32) for k, v in old.named_weights().items()}
    new = HFPolicy(path, device=str(device), seed=0)
    new.load_weights(new_weights, version=1)
    policy = HFPolicy(path, device=str(device), seed=0)
    record = swap_after_forward(policy, swap_after, new_weights, version=1)
    prompts = [policy.tokenizer.encode(f"{a}+{b}=") for a, b in [(12, 34), (5, 9), (70, 21), (3, 3)]]
    cfg = SamplingConfig(n=16, temperature=10.0, max_tokens=40, seed=1)  # near-uniform: rows outlive the swap
    out = policy.generate(prompts, cfg)
    record["thread"].join()
    out.check(len(prompts), cfg, policy.eos_ids)
    spans = assert_each_token_is_its_versions(out, prompts, cfg, {0: old, 1: new}, first_new=swap_after - 1,
                                              atol=2e-4)
    assert spans > 0, "no sample outlived the swap: the test would not test it"
