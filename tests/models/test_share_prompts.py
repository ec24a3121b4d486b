"""`train.share_prompts`: each distinct prompt of a pass run once, its rows' responses on its KV
cache, gives the padded path's logprobs, entropy and gradients (to float rounding), on Qwen2- and
Llama-style models; settings it cannot run with are refused."""

from __future__ import annotations

import random

import pytest
import torch

from dapo_flow.errors import ModelError
from dapo_flow.models.hf import HFPolicy

from test_packing import model_dir  # noqa: F401  (the fixture: a random Qwen2 / Llama model)


def _groups(seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """Three prompts of 2-6 tokens, interleaved, with ragged responses of 0-7 tokens (one empty,
    one of a single token): prompts padded to another width than the pass's rows would be."""
    rng = random.Random(seed)
    distinct = [[rng.randrange(3, 30) for _ in range(n)] for n in (2, 6, 4)]
    prompts = [distinct[i % 3] for i in range(10)]
    responses = [[rng.randrange(3, 30) for _ in range(rng.randint(2, 7))] for _ in range(10)]
    responses[3], responses[5] = [], [7]
    return prompts, responses


def test_shared_prompt_logprobs_entropy_and_gradients_are_the_padded_ones(model_dir):  # noqa: F811
    prompts, responses = _groups()
    out = []
    for share in (False, True):
        policy = HFPolicy(model_dir, trainable=True, share_prompts=share)
        logp, ent, mask = policy.response_logprobs(prompts, responses, with_entropy=True, grad=True,
                                                   temperature=0.7)
        loss = -(logp * mask).sum() / mask.sum() - 0.01 * (ent * mask).sum() / mask.sum()
        loss.backward()
        out.append((logp.detach(), ent.detach(), mask, {n: p.grad.clone() for n, p in policy.model.named_parameters()}))
    (logp_a, ent_a, mask_a, grad_a), (logp_b, ent_b, mask_b, grad_b) = out
    assert torch.equal(mask_a, mask_b)
    assert mask_b.sum(1).tolist() == [len(r) for r in responses]
    torch.testing.assert_close(logp_b, logp_a, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent_b, ent_a, rtol=0, atol=1e-5)
    for name in grad_a:
        torch.testing.assert_close(grad_b[name], grad_a[name], rtol=0, atol=1e-5, msg=name)


def test_share_prompts_refuses_settings_it_cannot_run_with(tiny_adder_path):
    for clash in ({"pack": True}, {"logprob_chunk_tokens": 4}, {"grad_checkpointing": True}):
        with pytest.raises(ModelError, match=f"share_prompts.*{next(iter(clash))}"):
            HFPolicy(tiny_adder_path, trainable=True, share_prompts=True, **clash)


def test_an_update_trains_the_same_weights_with_shared_prompts(tiny_adder_path):
    from dapo_flow.graph.spec import ModelSpec

    from test_mixed_precision import _batch, _problems, _update, _with_old_logp

    weights = []
    for share in (False, True):
        spec = ModelSpec(path="builtin:tiny-adder", train={"share_prompts": share})
        policy = HFPolicy(tiny_adder_path, trainable=True, share_prompts=share)
        batch = _with_old_logp(policy, _batch(policy, _problems(12)))  # each prompt twice: right and wrong
        row = _update(policy, spec, micro_batch_size=5)(batch).to_pylist()[0]
        weights.append((row, {n: p.detach().clone() for n, p in policy.model.named_parameters()}))
    (row_a, a), (row_b, b) = weights
    assert row_b["actor/pg_loss"] == pytest.approx(row_a["actor/pg_loss"], abs=1e-6)
    assert row_b["actor/grad_norm"] == pytest.approx(row_a["actor/grad_norm"], rel=1e-5)
    # AdamW's first step moves each weight by about lr (1e-3) whatever its gradient's size, so a
    # gradient entry near zero (layer 0's k_proj: softmax ignores a shift common to a query's
    # keys) moves by its rounding's share of lr: measured 1.0e-4 there, the gradients themselves
    # agreeing to 1e-6 (the test above checks them to 1e-5); everywhere else under 2e-5
    worst = {name: float((b[name] - a[name]).abs().max()) for name in a}
    assert max(worst.values()) <= 2.5e-4, sorted(worst.items(), key=lambda kv: -kv[1])[:3]
    assert sum(worst.values()) / len(worst) <= 2e-5


@pytest.mark.parametrize("other", [{"pack": True}, {"logprob_chunk_tokens": 4}, {"grad_checkpointing": True},
                                   {"sequence_parallel": 2, "strategy": "fsdp2", "workers": 2}])
def test_validate_refuses_share_prompts_with_a_setting_it_cannot_run_with(other):
    from pydantic import ValidationError

    from dapo_flow.graph.spec import TrainSpec

    with pytest.raises(ValidationError, match=f"share_prompts .* {next(iter(other))} does not take yet"):
        TrainSpec(share_prompts=True, **other)
    TrainSpec(share_prompts=True)  # alone it is fine
