"""Chunked logprobs (train.logprob_chunk_tokens): the same values and gradients as the whole
(tokens, vocab) logits, with no chunk's logits kept for the backward. The sharded (FSDP2) case is
in tests/models/test_fsdp.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dapo_flow.algos.errors import AlgoError
from dapo_flow.algos.logprobs import chunked_linear_logprobs, entropy_from_logits, logprobs_from_logits
from dapo_flow.errors import ModelError
from dapo_flow.models.hf import HFPolicy, response_logprobs_of

PROMPTS = [[1, 5, 6, 7], [1, 8], [1, 9, 9, 9, 9, 9], [1, 4]]
RESPONSES = [[5, 6, 7, 8, 9], [8, 9], [4, 4, 4, 4, 2, 3, 4], [3]]


def _inputs(n: int = 37, h: int = 16, vocab: int = 50, dtype=torch.float32, bias: bool = True):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, h, generator=gen) / h**0.5).to(dtype).requires_grad_()
    b = torch.randn(vocab, generator=gen).to(dtype).requires_grad_() if bias else None
    return hidden, weight, b, torch.randint(0, vocab, (n,), generator=gen)


def _whole(hidden, weight, bias, labels, temperature):
    logits = torch.nn.functional.linear(hidden, weight, bias).float() / temperature
    return logprobs_from_logits(logits, labels), entropy_from_logits(logits)


def _grads(*tensors) -> list[torch.Tensor]:
    return [t.grad.clone() for t in tensors if t is not None]


@pytest.mark.parametrize("entropy_in_loss", [False, True])
@pytest.mark.parametrize("chunk", [1, 5, 37, 100])
def test_chunks_give_the_values_and_gradients_of_the_whole(chunk, entropy_in_loss):
    """Against the whole computation in float64: the chunked float32 values and gradients are
    within float32 rounding of it, as close as the whole computation in float32 is (the chunked
    path sums in another order: the two float32 results differ from each other by a few ulps)."""
    gen = torch.Generator().manual_seed(1)
    w_logp, w_ent = torch.randn(37, generator=gen), torch.randn(37, generator=gen)

    def run(fn, dtype):
        hidden, weight, bias, labels = (t.detach().to(dtype).requires_grad_() if t.is_floating_point() else t
                                        for t in _inputs())
        logp, ent = fn(hidden, weight, bias, labels)
        ((logp * w_logp.to(dtype)).sum() + entropy_in_loss * (ent * w_ent.to(dtype)).sum()).backward()
        return [logp.detach(), ent.detach(), *_grads(hidden, weight, bias)]

    def float64_whole(h, w, b, y):  # _whole without its .float(): float64 logits
        logits = torch.nn.functional.linear(h, w, b) / 0.7
        return logprobs_from_logits(logits, y), entropy_from_logits(logits)

    whole = lambda h, w, b, y: _whole(h, w, b, y, 0.7)  # noqa: E731
    exact = run(float64_whole, torch.float64)
    for fn in (whole, lambda h, w, b, y: chunked_linear_logprobs(h, w, y, bias=b, chunk_tokens=chunk,
                                                                 temperature=0.7, with_entropy=True)):
        for got, want in zip(run(fn, torch.float32), exact):
            assert got.dtype == torch.float32
            torch.testing.assert_close(got.double(), want, atol=2e-6 * max(1.0, float(want.abs().max())), rtol=0)


def test_zero_and_negative_upstream_gradients():
    """Tokens a loss mask drops get an upstream gradient of exactly 0 (log 0 = -inf inside the
    fused logp-only backward: their rows must come out 0, not NaN); others are negative."""
    g = torch.tensor([0.0, -1.5, 2.0, 0.0, -0.25] * 7 + [0.0, 3.0])
    hidden, weight, bias, labels = _inputs()
    logp, _ = _whole(hidden, weight, bias, labels, 0.7)
    (logp * g).sum().backward()
    expected = _grads(hidden, weight, bias)
    hidden, weight, bias, labels = _inputs()
    c_logp, _ = chunked_linear_logprobs(hidden, weight, labels, bias=bias, chunk_tokens=4, temperature=0.7)
    (c_logp * g).sum().backward()
    assert (hidden.grad[g == 0] == 0).all()
    for got, want in zip(_grads(hidden, weight, bias), expected):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, atol=2e-6 * float(want.abs().max()), rtol=0)


def test_no_chunk_logits_are_saved_for_the_backward():
    """What autograd keeps: the inputs (hidden, weight, labels), never a (tokens, vocab) tensor."""
    hidden, weight, _, labels = _inputs(n=64, vocab=200, bias=False)
    saved: list[torch.Size] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        logp, ent = chunked_linear_logprobs(hidden, weight, labels, chunk_tokens=8, with_entropy=True)
    assert max(s.numel() for s in saved) == weight.numel()
    (logp.sum() + ent.sum()).backward()
    assert hidden.grad.shape == hidden.shape and weight.grad.shape == weight.shape


def test_bfloat16_head_sums_chunk_gradients_in_float32():
    hidden, weight, _, labels = _inputs(n=64, h=32, vocab=100, dtype=torch.bfloat16, bias=False)
    logp, _ = _whole(hidden, weight, None, labels, 1.0)
    logp.sum().backward()
    expected = _grads(hidden, weight)
    hidden, weight, _, labels = _inputs(n=64, h=32, vocab=100, dtype=torch.bfloat16, bias=False)
    c_logp, _ = chunked_linear_logprobs(hidden, weight, labels, chunk_tokens=4)
    c_logp.sum().backward()
    torch.testing.assert_close(c_logp, logp)  # bf16 logits, float32 after: the same rounding
    assert weight.grad.dtype == torch.bfloat16
    for got, want in zip(_grads(hidden, weight), expected):  # one bf16 rounding, as one matmul
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2 * float(want.abs().max()), rtol=0)


@pytest.mark.parametrize("case", ["bf16-head", "autocast", "autocast-temperature"])
def test_a_bf16_head_and_autocast_take_the_fused_path_with_the_generic_paths_results(case, monkeypatch):
    """Low precision on the fused path: the head's matmuls in bf16, its logits cast to float32
    per chunk, no (tokens, vocab) tensor saved; the values and gradients of the generic path
    (autograd through each recomputed chunk, the unchunked computation's order of operations)
    up to float32 rounding of the logprob math and one bf16 rounding of the logits' gradient."""
    import dapo_flow.algos.logprobs as lp

    dtype = torch.bfloat16 if case == "bf16-head" else torch.float32
    temperature = 0.7 if case.endswith("temperature") else 1.0
    autocast = case.startswith("autocast")

    def run(inputs, fused: bool):
        if not fused:
            monkeypatch.setattr(lp, "_low_precision_compute", lambda *_: None)
        hidden, weight, bias, labels = inputs
        saved: list[torch.Size] = []
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), \
                torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
            if fused:
                assert lp._low_precision_compute(hidden, weight, bias) == torch.bfloat16
            logp, ent = chunked_linear_logprobs(hidden, weight, labels, bias=bias, chunk_tokens=8,
                                                temperature=temperature, with_entropy=True)
        monkeypatch.undo()
        a = torch.linspace(-1, 1, len(logp))
        ((logp * a).sum() + 0.1 * (ent * a.flip(0)).sum()).backward()
        assert max(s.numel() for s in saved) == weight.numel()  # no chunk's logits kept
        return [logp.detach(), ent.detach(), *_grads(hidden, weight, bias)]

    fused = run(_inputs(n=40, h=32, vocab=300, dtype=dtype), fused=True)
    generic = run(_inputs(n=40, h=32, vocab=300, dtype=dtype), fused=False)
    for name, got, want in zip(("logp", "entropy", "hidden", "weight", "bias"), fused, generic):
        assert got.dtype == want.dtype, name
        scale = float(want.abs().max())
        tol = 1e-5 if name in ("logp", "entropy") else 2e-2  # bf16 gradients of the logits
        torch.testing.assert_close(got.float(), want.float(), atol=tol * scale, rtol=0, msg=name)


def test_a_bf16_head_over_float32_hidden_states_outside_autocast_takes_the_generic_path():
    import dapo_flow.algos.logprobs as lp

    hidden, weight, _, labels = _inputs(n=12, h=8, vocab=20, bias=False)
    head = weight.detach().to(torch.bfloat16).requires_grad_()
    assert lp._low_precision_compute(hidden, head, None) is None and not lp._fused_applies(hidden, head, None)


def test_no_tokens_and_bad_arguments():
    hidden, weight, _, labels = _inputs(n=0, bias=False)
    logp, ent = chunked_linear_logprobs(hidden, weight, labels, chunk_tokens=4)
    assert logp.shape == (0,) and ent is None and logp.requires_grad
    (logp.sum() * 0.0).backward()  # a worker's empty pass still reaches the weights
    assert weight.grad is not None
    with pytest.raises(AlgoError, match="chunk_tokens"):
        chunked_linear_logprobs(hidden, weight, labels, chunk_tokens=0)
    with pytest.raises(AlgoError, match="labels"):
        chunked_linear_logprobs(hidden, weight, labels[:, None], chunk_tokens=2)


# --- HFPolicy ------------------------------------------------------------------------------

def _update(policy: HFPolicy, entropy_coef: float) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """A gradient pass as operators/update.py makes it (the entropy kept through backward)."""
    logp, ent, mask = policy.response_logprobs(PROMPTS, RESPONSES, temperature=0.7, with_entropy=True, grad=True)
    loss = -(logp * mask).sum() / mask.sum() - entropy_coef * (ent * mask).sum() / mask.sum()
    loss.backward()
    return logp.detach(), ent.detach(), {n: p.grad.clone() for n, p in policy.model.named_parameters()}


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])
def test_hf_policy_chunked_equals_unchunked(tiny_adder_path: Path, checkpointing, entropy_coef):
    whole = HFPolicy(tiny_adder_path, trainable=True, grad_checkpointing=checkpointing)
    logp, ent, grads = _update(whole, entropy_coef)
    mask = whole.response_logprobs(PROMPTS, RESPONSES)[2]
    for chunk in (1, 3, 1000):
        policy = HFPolicy(tiny_adder_path, trainable=True, grad_checkpointing=checkpointing,
                          logprob_chunk_tokens=chunk)
        c_logp, c_ent, c_grads = _update(policy, entropy_coef)
        torch.testing.assert_close(c_logp, logp, atol=1e-6, rtol=0)
        torch.testing.assert_close(c_ent, ent, atol=1e-6, rtol=0)
        assert (c_logp[~mask] == 0).all() and (c_ent[~mask] == 0).all()
        for name, want in grads.items():
            torch.testing.assert_close(c_grads[name], want, atol=1e-6 * float(want.abs().max()), rtol=0, msg=name)
        # without gradients: inference mode, micro-batches of rows, chunks within them
        for micro in (1, 3):
            n_logp, n_ent, _ = policy.response_logprobs(PROMPTS, RESPONSES, temperature=0.7, with_entropy=True,
                                                        micro_batch_size=micro)
            torch.testing.assert_close(n_logp, logp, atol=1e-6, rtol=0)
            torch.testing.assert_close(n_ent, ent, atol=1e-6, rtol=0)
        assert "forward" not in vars(policy.model.lm_head)  # the head is itself again


def test_the_head_is_restored_when_the_forward_fails(tiny_adder_path: Path):
    policy = HFPolicy(tiny_adder_path)
    batch = policy.pack(PROMPTS[:1], RESPONSES[:1])
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with pytest.raises(RuntimeError, match="out of bounds"):  # a label outside the vocabulary
        response_logprobs_of(policy.model, inputs, batch["response_ids"] + 10_000, batch["response_mask"],
                              chunk_tokens=2)
    assert "forward" not in vars(policy.model.lm_head)
    policy.model.lm_head = torch.nn.Identity()
    with pytest.raises(ModelError, match="linear output head"):
        response_logprobs_of(policy.model, inputs, batch["response_ids"], batch["response_mask"], chunk_tokens=2)


def test_the_setting_reaches_the_policy(tiny_adder_path: Path):
    from pydantic import ValidationError

    from dapo_flow.graph.spec import ModelSpec, TrainSpec
    from dapo_flow.runtime.resources import load_resource

    with pytest.raises(ValidationError):
        TrainSpec(logprob_chunk_tokens=0)
    spec = ModelSpec(path=str(tiny_adder_path), train=TrainSpec(logprob_chunk_tokens=256))
    resource = load_resource("policy", spec, path=None, trainable=True, generates=False, scores=True, seed=0)
    assert resource.policy.logprob_chunk_tokens == 256
