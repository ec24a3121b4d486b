"""The router math (algos/moe.py): HF's load-balancing loss per sequence, expert loads, entropy;
and the router term of a training pass (training/router.py) on a real Qwen3-MoE: trained on, it
adds coef x its own gradient, which reaches the routers and what feeds them, never the last
layer's experts or the head."""

from __future__ import annotations

import math

import pytest
import torch

from dapo_flow.algos.moe import load_fractions, router_entropy_sum, routing_counts, sequence_balance_loss


def _logits(layers: int, tokens: int, experts: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(tokens, experts, generator=gen) for _ in range(layers)]


def test_one_sequences_loss_is_hugging_faces_load_balancing_loss():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    logits = _logits(layers=3, tokens=7, experts=4)
    counts, probs, tokens = routing_counts(logits, torch.zeros(7, dtype=torch.long), 1, top_k=2)
    ours = sequence_balance_loss(counts, probs, tokens)
    assert tokens.tolist() == [21.0] and counts.sum().item() == 21 * 2
    assert ours.item() == pytest.approx(float(load_balancing_loss_func(tuple(logits), 4, 2)), rel=1e-6)


def test_rows_are_their_own_sequences_and_padding_counts_nowhere():
    logits = _logits(layers=2, tokens=6, experts=4, seed=1)
    rows = torch.tensor([0, 0, -1, 1, 1, 1])  # a padding position between the rows
    counts, probs, tokens = routing_counts(logits, rows, 2, top_k=2)
    per_row = sequence_balance_loss(counts, probs, tokens)
    for row, where in ((0, [0, 1]), (1, [3, 4, 5])):
        alone = routing_counts([x[where] for x in logits], torch.zeros(len(where), dtype=torch.long), 1, top_k=2)
        assert per_row[row].item() == pytest.approx(sequence_balance_loss(*alone).item(), rel=1e-6)


def test_balance_loss_is_k_when_balanced_and_k_times_e_when_collapsed():
    balanced = torch.full((1, 4), 0.5), torch.full((1, 4), 0.25), torch.tensor([1.0])  # top-2 of 4, one token
    assert sequence_balance_loss(*balanced).item() == pytest.approx(2.0)
    collapsed = torch.tensor([[2.0, 0.0, 0.0, 0.0]]), torch.tensor([[1.0, 0.0, 0.0, 0.0]]), torch.tensor([1.0])
    assert sequence_balance_loss(*collapsed).item() == pytest.approx(8.0)  # k * E (f sums to k)


def test_router_entropy_and_load_fractions():
    uniform = [torch.zeros(5, 4)]
    rows = torch.tensor([0, 0, 0, -1, -1])
    assert router_entropy_sum(uniform, rows).item() == pytest.approx(3 * math.log(4))
    loads = load_fractions(torch.tensor([[3.0, 1.0, 0.0, 0.0], [1.0, 1.0, 2.0, 0.0]]))
    assert loads.tolist() == pytest.approx([0.5, 0.25, 0.25, 0.0])


def _tiny_qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=18, hidden_size=32, head_dim=16, num_attention_heads=2, num_key_value_heads=2,
        num_hidden_layers=2, intermediate_size=64, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, max_position_embeddings=32, tie_word_embeddings=False))


def _grads(model, router_term, prompts, responses, logprob_loss: bool = True):
    """Gradients of a logprob loss (``logprob_loss``) + the router term's (when it gives one)
    over the rows, in the padded layout; zeros where none reaches."""
    from dapo_flow.models.hf import left_pad, positions, right_pad

    model.zero_grad(set_to_none=True)
    p_ids, p_mask = left_pad(prompts, 0)
    r_ids, r_mask = right_pad(responses, 0)
    mask = torch.cat([p_mask, r_mask], 1)
    with router_term.recording():
        logits = model(input_ids=torch.cat([p_ids, r_ids], 1), attention_mask=mask, position_ids=positions(mask)).logits
    loss = torch.log_softmax(logits[:, -r_ids.shape[1] - 1:-1], -1).gather(-1, r_ids[..., None]).mean()
    term = router_term.loss(prompts, responses, packed=False, n_seqs=len(prompts))
    loss = loss * logprob_loss
    (loss if term is None else loss + term).backward()
    return {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()}


def test_the_router_term_adds_coef_times_its_gradient_to_the_routers_and_what_feeds_them():
    from dapo_flow.models.moe import routing_of
    from dapo_flow.training.router import RouterTerm

    model = _tiny_qwen3_moe()
    routing = routing_of(model)
    assert routing is not None and len(routing.routers) == 2 and (routing.num_experts, routing.top_k) == (4, 2)
    prompts, responses = [[1, 5, 6, 7], [1, 8, 9]], [[10, 11, 2], [12, 2]]
    dropped = _grads(model, RouterTerm(routing, 0.0), prompts, responses)
    kept = _grads(model, RouterTerm(routing, 0.5), prompts, responses)
    own = _grads(model, RouterTerm(routing, 1.0), prompts, responses, logprob_loss=False)  # the term's alone
    for name in kept:
        torch.testing.assert_close(kept[name] - dropped[name], 0.5 * own[name], rtol=1e-4, atol=1e-7)
    # what the term reaches: both routers, and the layers below the last router
    for name in ("model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight",
                 "model.layers.0.mlp.experts.gate_up_proj", "model.embed_tokens.weight"):
        assert own[name].abs().max() > 0, name
    # what it cannot reach: above the last router
    for name in ("lm_head.weight", "model.norm.weight", "model.layers.1.mlp.experts.down_proj"):
        assert torch.equal(kept[name], dropped[name]), name
