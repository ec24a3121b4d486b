"""Partial rollouts in the hf engine: weights loaded while a generation is in flight take over
from its next token, each token records the version that sampled it, and its logprob is that
version's (teacher-forced) logprob, so an importance ratio against it is against the sampler."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from dapo_flow.models.hf import HFPolicy
from dapo_flow.models.sampling import SamplingConfig
from dapo_flow.models.weight_gate import WeightGate
from weight_swaps import assert_each_token_is_its_versions, swap_after_forward


@pytest.mark.parametrize("swap_after", [1, 3])  # after the prefill (token 0 is the new weights'), or mid-way
def test_weights_loaded_mid_generation_sample_the_rest_of_it(tiny_adder_path, swap_after):
    old = HFPolicy(tiny_adder_path, seed=0)
    rng = np.random.default_rng(0)
    new_weights = {k: v + rng.normal(0, 0.3, v.shape).astype(np.float32) for k, v in old.named_weights().items()}
    new = HFPolicy(tiny_adder_path, seed=0)
    new.load_weights(new_weights, version=7)
    assert new.weights_version == 7

    policy = HFPolicy(tiny_adder_path, seed=0)
    record = swap_after_forward(policy, swap_after, new_weights, version=7)
    prompts = [policy.tokenizer.encode(f"{a}+{b}=") for a, b in [(12, 34), (5, 9), (70, 21), (3, 3)]]
    cfg = SamplingConfig(n=4, temperature=1.5, max_tokens=8, seed=1)
    out = policy.generate(prompts, cfg)
    record["thread"].join()
    out.check(len(prompts), cfg, policy.eos_ids)
    assert policy.weights_version == 7

    spans = assert_each_token_is_its_versions(out, prompts, cfg, {0: old, 7: new}, first_new=swap_after - 1)
    if swap_after > 1:
        assert spans > 0, "no sample outlived the swap: the test would not test it"


def test_without_a_load_every_token_is_the_engines_version(tiny_adder_path):
    policy = HFPolicy(tiny_adder_path, seed=0)
    policy.set_weights_version(3)
    out = policy.generate([policy.tokenizer.encode("1+2=")], SamplingConfig(n=3, max_tokens=6, seed=2))
    assert out.versions == [[3] * len(ids) for ids in out.response_ids]
    assert out.token_versions(9) == out.versions


def test_a_load_waits_for_the_step_in_flight_and_the_next_step_for_the_load():
    gate, order = WeightGate(), []
    entered = threading.Event()

    def load():
        entered.wait()
        with gate.loading(version=1):
            order.append("load")

    loader = threading.Thread(target=load)
    loader.start()
    with gate.step() as version:
        entered.set()
        deadline = time.monotonic() + 10
        while gate.waiting_loads == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        order.append(("step", version))  # the load waits: this step's weights do not change under it
    with gate.step() as version:  # the waiting load goes first
        order.append(("step", version))
    loader.join()
    assert order == [("step", 0), "load", ("step", 1)]
