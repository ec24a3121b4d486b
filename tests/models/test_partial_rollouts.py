"""Partial rollouts in the hf engine: weights loaded while a generation is in flight take over
from its next token, each token records the version that sampled it, and its logprob is that
version's (teacher-forced) logprob, so an importance ratio against it is against the sampler."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from dapo_flow.models.hf import HFPolicy
from dapo_flow.models.sampling import SamplingConfig
from dapo_flow.models.weight_gate import WeightGate


def _swap_after_forward(policy: HFPolicy, call: int, weights: dict, version: int) -> dict:
    """Make ``policy.load_weights(weights, version)`` happen, from another thread, right after
    the model's ``call``-th forward returns (before the next decode step starts: the load is
    waiting at the gate by then). Returns a record of the forwards' count and the load thread."""
    record = {"forwards": 0, "thread": None}
    forward = policy.model.forward

    def counted(*args, **kwargs):
        out = forward(*args, **kwargs)
        record["forwards"] += 1
        if record["forwards"] == call:
            loader = threading.Thread(target=policy.load_weights, args=(weights,), kwargs={"version": version})
            loader.start()
            record["thread"] = loader
            deadline = time.monotonic() + 10
            while policy.gate.waiting_loads == 0 and time.monotonic() < deadline:
                time.sleep(0.001)
            assert policy.gate.waiting_loads == 1, "the load did not reach the gate"
        return out

    policy.model.forward = counted
    return record


@pytest.mark.parametrize("swap_after", [1, 3])  # after the prefill (token 0 is the new weights'), or mid-way
def test_weights_loaded_mid_generation_sample_the_rest_of_it(tiny_adder_path, swap_after):
    old = HFPolicy(tiny_adder_path, seed=0)
    rng = np.random.default_rng(0)
    new_weights = {k: v + rng.normal(0, 0.3, v.shape).astype(np.float32) for k, v in old.named_weights().items()}
    new = HFPolicy(tiny_adder_path, seed=0)
    new.load_weights(new_weights, version=7)
    assert new.weights_version == 7

    policy = HFPolicy(tiny_adder_path, seed=0)
    record = _swap_after_forward(policy, swap_after, new_weights, version=7)
    prompts = [policy.tokenizer.encode(f"{a}+{b}=") for a, b in [(12, 34), (5, 9), (70, 21), (3, 3)]]
    cfg = SamplingConfig(n=4, temperature=1.5, max_tokens=8, seed=1)
    out = policy.generate(prompts, cfg)
    record["thread"].join()
    out.check(len(prompts), cfg, policy.eos_ids)
    assert policy.weights_version == 7

    first_new = swap_after - 1  # forward k gave the logits of token k-1: the new weights recompute them
    spans = 0
    rows = [prompts[i] for i in out.prompt_index]
    old_lp, _, _ = old.response_logprobs(rows, out.response_ids, temperature=cfg.temperature)
    new_lp, _, _ = new.response_logprobs(rows, out.response_ids, temperature=cfg.temperature)
    for s, (ids, lps, versions) in enumerate(zip(out.response_ids, out.logprobs, out.versions)):
        assert versions == [0 if t < first_new else 7 for t in range(len(ids))], (s, versions)
        spans += len(set(versions)) > 1
        for t, v in enumerate(versions):
            want = (new_lp if v == 7 else old_lp)[s, t].item()
            assert lps[t] == pytest.approx(want, abs=1e-4), (s, t, v)
    if swap_after > 1:
        assert spans > 0, "no sample outlived the swap: the test would not test it"
    # and the two versions differ where they meet: the test tells them apart
    assert not torch.allclose(old_lp[:, first_new:], new_lp[:, first_new:], atol=1e-3)


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
