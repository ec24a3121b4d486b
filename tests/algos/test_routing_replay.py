"""Routing replay's math (algos/moe.py): the recorded experts in place of a router's own top-k,
gate weights recomputed from the current logits as the router computes its own, the agreement of
the two routings, the logprob mismatch; and on a real Qwen3-MoE forward (models/moe.py's hooks):
replaying its own choices changes no bit, replaying others' routes through them with gradients
reaching the router."""

from __future__ import annotations

import pytest
import torch

from dapo_flow.algos.moe import (logprob_mismatch_sum, replayed_choices, replayed_gate_weights,
                                 routing_agreement_counts)


def test_replayed_gate_weights_are_the_softmax_over_the_chosen_experts_renormalised():
    logits = torch.tensor([[1.0, 2.0, 0.5, -1.0], [0.0, 0.0, 3.0, 1.0]])
    choices = torch.tensor([[3, 0], [1, 2]])
    probs = torch.softmax(logits, -1)
    direct = torch.stack([probs[0, [3, 0]], probs[1, [1, 2]]])
    torch.testing.assert_close(replayed_gate_weights(logits, choices, norm_topk_prob=False), direct)
    torch.testing.assert_close(replayed_gate_weights(logits, choices, norm_topk_prob=True),
                               direct / direct.sum(-1, keepdim=True))


def test_replaying_a_routers_own_top_k_gives_its_own_weights_bit_for_bit():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    torch.manual_seed(0)
    router = Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=3,
                                               norm_topk_prob=True))
    torch.nn.init.normal_(router.weight)
    logits, weights, own = router(torch.randn(11, 16))
    assert torch.equal(replayed_gate_weights(logits, own, norm_topk_prob=True), weights)


def test_recorded_choices_replace_the_routers_where_recorded_and_gradients_reach_the_logits():
    own = torch.tensor([[0, 1], [2, 3], [1, 0]])
    recorded = torch.tensor([[3, 2], [-1, -1], [0, 1]])  # the middle token has no record: keeps its own
    assert replayed_choices(own, recorded).tolist() == [[3, 2], [2, 3], [0, 1]]
    logits = torch.randn(3, 4, requires_grad=True)
    replayed_gate_weights(logits, replayed_choices(own, recorded), True)[:, 0].sum().backward()
    assert logits.grad.abs().sum() > 0


def test_agreement_counts_recorded_choices_the_router_also_makes_as_sets():
    own = torch.tensor([[0, 1], [2, 3], [1, 0], [0, 1]])
    recorded = torch.tensor([[1, 0], [2, 0], [-1, -1], [2, 3]])  # same set; one of two; none recorded; none
    agreed, total = routing_agreement_counts(own, recorded)
    assert (int(agreed), int(total)) == (3, 6)


def test_logprob_mismatch_sums_absolute_differences_over_the_mask():
    a, b = torch.tensor([[-1.0, -2.0, 5.0]]), torch.tensor([[-1.5, -1.0, 0.0]])
    assert logprob_mismatch_sum(a, b, torch.tensor([[True, True, False]])).item() == pytest.approx(1.5)


def _tiny_qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=18, hidden_size=32, head_dim=16, num_attention_heads=2, num_key_value_heads=2,
        num_hidden_layers=2, intermediate_size=64, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, max_position_embeddings=32, tie_word_embeddings=False, norm_topk_prob=True)).eval()


def _inputs():
    from dapo_flow.models.hf import left_pad, positions, right_pad

    prompts, responses = [[1, 5, 6, 7], [1, 8, 9]], [[10, 11, 2], [12, 2]]
    p_ids, p_mask = left_pad(prompts, 0)
    r_ids, r_mask = right_pad(responses, 0)
    mask = torch.cat([p_mask, r_mask], 1)
    return dict(input_ids=torch.cat([p_ids, r_ids], 1), attention_mask=mask, position_ids=positions(mask))


def _own_routing():
    """A tiny Qwen3-MoE, its inputs, its routing, its logits and its own choices (T, L, k)."""
    from dapo_flow.models.moe import routing_of, routing_recorded

    model, inputs = _tiny_qwen3_moe(), _inputs()
    routing = routing_of(model)
    with torch.no_grad(), routing_recorded(routing) as seen:
        plain = model(**inputs).logits
    return model, inputs, routing, plain, torch.stack(seen, dim=1)


def test_replaying_a_models_own_routing_gives_bit_identical_logits():
    from dapo_flow.models.moe import routing_replayed

    model, inputs, routing, plain, choices = _own_routing()
    with torch.no_grad(), routing_replayed(routing, choices) as tally:
        replayed = model(**inputs).logits
    assert torch.equal(replayed, plain)
    assert tally.agreement == 1.0 and tally.recorded == choices.numel()


def test_replaying_other_routes_sends_tokens_there_and_trains_the_router():
    from dapo_flow.models.moe import routing_recorded, routing_replayed

    model, inputs, routing, plain, own = _own_routing()
    # every token to the two experts it did not choose (4 experts, top-2)
    chosen = torch.zeros(*own.shape[:2], routing.num_experts).scatter_(-1, own, 1.0)
    others = chosen.argsort(dim=-1, stable=True)[..., :routing.top_k]
    with routing_replayed(routing, others) as tally, routing_recorded(routing) as routed:
        logits = model(**inputs).logits
    assert not torch.allclose(logits, plain)
    assert tally.agreement == 0.0 and tally.recorded == others.numel()
    # a hook registered after the replay sees what the block is handed: the recorded experts
    assert torch.equal(torch.stack(routed, dim=1), others)
    logits.sum().backward()  # the replayed gate weights come from the router's logits
    for layer in model.model.layers:
        assert layer.mlp.gate.weight.grad.abs().sum() > 0
