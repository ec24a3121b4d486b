"""Routing replay on builtin:tiny-moe through the hf policy: the rollout records every token's
experts (prompt and response), and a logprob pass that replays them on weights that route
differently (a perturbed copy: a trainer a step ahead, an engine of other numerics) matches the
rollout's logprobs better than its own routing does; the padded and packed layouts replay alike."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

# slow: the fast tier stays within its 4 minutes without building tiny-moe (algos/ tests its math there)
pytestmark = [pytest.mark.slow, pytest.mark.models("tiny-moe")]

PROMPTS = ["12+34=", "7+5=", "40+41=", "3+99="]


@pytest.fixture(scope="module")
def moe_dir() -> Path:
    from dapo_flow.models import resolve_model

    return resolve_model("builtin:tiny-moe", progress=False)


@pytest.fixture(scope="module")
def rollout(moe_dir: Path):
    from dapo_flow.models.hf import HFPolicy
    from dapo_flow.models.sampling import SamplingConfig

    policy = HFPolicy(moe_dir)
    prompts = policy.tokenizer(PROMPTS)["input_ids"]
    out = policy.generate(prompts, SamplingConfig(n=4, max_tokens=8, seed=3, record_routes=True))
    return prompts, out


def _mean_mismatch(logp: torch.Tensor, rollout_lp: list[list[float]]) -> float:
    total = sum(float(np.abs(logp[i, :len(r)].numpy() - np.array(r)).sum()) for i, r in enumerate(rollout_lp))
    return total / sum(map(len, rollout_lp))


def test_the_rollout_records_each_prompt_and_fed_response_tokens_experts(rollout):
    prompts, out = rollout
    assert out.routes is not None and len(out.routes) == len(out.response_ids)
    for s, (route, response) in enumerate(zip(out.routes, out.response_ids)):
        prompt = prompts[s // 4]
        assert route.shape == (len(prompt) + len(response), 2, 2) and route.dtype == np.int16
        fed = route[: len(prompt) + len(response) - 1]  # every token but the last was fed to the model
        assert (fed >= 0).all() and (fed < 4).all()
        assert (np.sort(fed, -1)[..., 0] != np.sort(fed, -1)[..., 1]).all()  # k distinct experts


def _perturbed(moe_dir: Path, **kwargs):
    """The policy with its routers' weights moved by 10% relative noise (seeded), as a router a
    step ahead of the rollout's: about 1% of the (token, layer, k) choices change, and the gate
    weights of the others move too (which replay keeps: they come from the current router)."""
    from dapo_flow.models.hf import HFPolicy

    policy = HFPolicy(moe_dir, **kwargs)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in policy.model.named_parameters():
            if ".mlp.gate." in name:
                param.mul_(1 + 0.1 * torch.randn(param.shape, generator=gen))
    return policy


def test_replay_brings_a_perturbed_trainers_logprobs_closer_to_the_rollouts(moe_dir: Path, rollout):
    from dapo_flow.models.moe import ReplayTally

    prompts, out = rollout
    rows = [prompts[i] for i in out.prompt_index]
    policy = _perturbed(moe_dir)
    own, _, _ = policy.response_logprobs(rows, out.response_ids)
    tally = ReplayTally()
    replayed, _, _ = policy.response_logprobs(rows, out.response_ids, routes=out.routes, tally=tally)
    without, with_replay = _mean_mismatch(own, out.logprobs), _mean_mismatch(replayed, out.logprobs)
    assert 0.9 < tally.agreement < 1.0  # the perturbed router chooses otherwise for some tokens
    assert with_replay < 0.6 * without, (with_replay, without)  # measured: 0.0062 vs 0.0145


def test_replaying_on_the_rollouts_own_weights_changes_nothing(moe_dir: Path, rollout):
    from dapo_flow.models.hf import HFPolicy
    from dapo_flow.models.moe import ReplayTally

    prompts, out = rollout
    rows = [prompts[i] for i in out.prompt_index]
    policy, tally = HFPolicy(moe_dir), ReplayTally()
    own, _, _ = policy.response_logprobs(rows, out.response_ids)
    replayed, _, _ = policy.response_logprobs(rows, out.response_ids, routes=out.routes, tally=tally)
    assert tally.agreement == 1.0  # the KV-cached decode and the whole-sequence forward route alike
    torch.testing.assert_close(replayed, own, rtol=0, atol=0)
    assert _mean_mismatch(replayed, out.logprobs) < 1e-5


def test_packed_passes_replay_as_padded_ones(moe_dir: Path, rollout):
    prompts, out = rollout
    rows = [prompts[i] for i in out.prompt_index]
    padded = _perturbed(moe_dir).response_logprobs(rows, out.response_ids, routes=out.routes, micro_batch_size=5)[0]
    packed = _perturbed(moe_dir, pack=True).response_logprobs(rows, out.response_ids, routes=out.routes,
                                                              micro_batch_size=5)[0]
    torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-5)


def test_weights_loaded_mid_rollout_rerecord_the_sequence_so_far(moe_dir: Path):
    """A partial rollout recomputes its cache with the new weights (hf.py): their routing of the
    prompt and the tokens so far replaces the old weights', so the record is the new weights'
    own routing throughout (and every later token's too)."""
    from dapo_flow.models.hf import HFPolicy
    from dapo_flow.models.moe import ReplayTally
    from dapo_flow.models.sampling import SamplingConfig
    from weight_swaps import swap_after_forward

    policy = HFPolicy(moe_dir)
    rng = np.random.default_rng(0)
    new_weights = {k: v + rng.normal(0, 0.1, v.shape).astype(np.float32) for k, v in policy.named_weights().items()}
    new = HFPolicy(moe_dir)
    new.load_weights(new_weights, version=1)
    prompts = policy.tokenizer(PROMPTS)["input_ids"]
    record = swap_after_forward(policy, 3, new_weights, version=1)  # after the prefill and two decode steps
    out = policy.generate(prompts, SamplingConfig(n=4, max_tokens=8, seed=3, record_routes=True))
    record["thread"].join()
    assert any(len(set(v)) > 1 for v in out.versions), "no sample outlived the swap: the test would not test it"
    rows = [prompts[i] for i in out.prompt_index]
    as_new, as_old = ReplayTally(), ReplayTally()
    new.response_logprobs(rows, out.response_ids, routes=out.routes, tally=as_new)
    HFPolicy(moe_dir).response_logprobs(rows, out.response_ids, routes=out.routes, tally=as_old)
    assert as_new.agreement == 1.0 and as_old.agreement < 1.0
