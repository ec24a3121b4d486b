"""Chunked logprobs on CUDA against the naive computation (every position's logits at once): the
fused path in float32 and in low precision (a bf16 head, or float32 weights under bf16
autocast: bf16 matmuls, float32 logits per chunk), values and gradients, entropy in the loss;
and HFPolicy's chunked path equal to its unchunked one on the GPU."""

from __future__ import annotations

import pytest
import torch

from dapo_flow.algos import logprobs as lp

pytestmark = pytest.mark.gpu

N, HIDDEN, VOCAB = 1000, 128, 4160  # positions; tiny-chat's padded vocabulary
TEMPERATURE = 0.7


def _inputs(device, dtype=torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, HIDDEN, generator=gen)
    weight = torch.randn(VOCAB, HIDDEN, generator=gen) / HIDDEN**0.5
    bias = torch.randn(VOCAB, generator=gen) * 0.1
    labels = torch.randint(0, VOCAB, (N,), generator=gen)
    w_logp, w_ent = torch.randn(N, generator=gen), torch.randn(N, generator=gen)
    as_leaf = lambda t: t.to(device, dtype).requires_grad_()  # noqa: E731
    return (as_leaf(hidden), as_leaf(weight), as_leaf(bias), labels.to(device), w_logp.to(device),
            w_ent.to(device))


def _naive(hidden, weight, bias, labels):
    """Every position's logits at once: what a model's output head and log-softmax give."""
    logits = torch.nn.functional.linear(hidden, weight, bias).float() / TEMPERATURE
    return lp.logprobs_from_logits(logits, labels), lp.entropy_from_logits(logits)


def _chunked(chunk: int):
    def fn(hidden, weight, bias, labels):
        return lp.chunked_linear_logprobs(hidden, weight, labels, bias=bias, chunk_tokens=chunk,
                                          temperature=TEMPERATURE, with_entropy=True)
    return fn


def _run(fn, inputs, autocast: bool = False) -> list[torch.Tensor]:
    """logp, entropy and the gradients of hidden, weight and bias of an entropy-bonus loss."""
    hidden, weight, bias, labels, w_logp, w_ent = inputs
    ctx = torch.autocast(hidden.device.type, dtype=torch.bfloat16) if autocast else torch.autocast(
        hidden.device.type, enabled=False)
    with ctx:
        logp, ent = fn(hidden, weight, bias, labels)
        ((logp * w_logp).sum() + 0.1 * (ent * w_ent).sum()).backward()
    return [logp.detach().double(), ent.detach().double(), *(t.grad.double() for t in (hidden, weight, bias))]


def _float64_reference(device, dtype=torch.float32) -> list[torch.Tensor]:
    """The naive computation in float64 on the same (``dtype``-rounded) inputs."""
    inputs = [t.detach().double().requires_grad_() if t.is_floating_point() and t.requires_grad else t
              for t in _inputs(device, dtype)]
    hidden, weight, bias, labels, w_logp, w_ent = inputs
    logits = torch.nn.functional.linear(hidden, weight, bias) / TEMPERATURE  # float64 throughout
    logp, ent = lp.logprobs_from_logits(logits, labels), lp.entropy_from_logits(logits)
    ((logp * w_logp.double()).sum() + 0.1 * (ent * w_ent.double()).sum()).backward()
    return [logp.detach(), ent.detach(), hidden.grad, weight.grad, bias.grad]


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


@pytest.mark.parametrize("chunk", [7, 128, 100_000])
def test_the_fused_float32_path_gives_the_naive_values_and_gradients(device, chunk):
    inputs = _inputs(device)
    assert lp._fused_applies(*inputs[:3])  # float32 head, outside autocast
    exact = _float64_reference(device)
    naive, chunked = _run(_naive, _inputs(device)), _run(_chunked(chunk), inputs)
    for name, n, c, e in zip(("logp", "entropy", "hidden", "weight", "bias"), naive, chunked, exact):
        # both float32 results within float32 rounding of the float64 one (they sum in other orders)
        assert _error(n, e) < 1e-5 and _error(c, e) < 1e-5, (name, _error(n, e), _error(c, e))


@pytest.mark.parametrize("case", ["bf16-head", "autocast"])
def test_the_low_precision_path_is_as_close_to_exact_as_the_naive_one(device, case):
    """bf16 logits: both paths are bf16 computations, so each is held to the float64 result
    within what the naive one's own bf16 rounding costs (cuBLAS may round a chunk's products
    otherwise than the whole matmul's)."""
    dtype, autocast = (torch.bfloat16, False) if case == "bf16-head" else (torch.float32, True)
    inputs = _inputs(device, dtype)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        assert not lp._fused_applies(*inputs[:3]) and lp._low_precision_compute(*inputs[:3]) == torch.bfloat16
    exact = _float64_reference(device, dtype)
    naive, chunked = _run(_naive, _inputs(device, dtype), autocast), _run(_chunked(128), inputs, autocast)
    for name, n, c, e in zip(("logp", "entropy", "hidden", "weight", "bias"), naive, chunked, exact):
        err_n, err_c = _error(n, e), _error(c, e)
        assert err_n < 5e-2, (name, err_n)  # a bf16 computation at all
        assert err_c <= 1.5 * err_n + 1e-6, (name, err_n, err_c)


def test_hf_policy_chunked_equals_unchunked_on_the_gpu(builtin, device):
    from dapo_flow.models.hf import HFPolicy

    prompts = [[1, 5, 6, 7], [1, 8], [1, 9, 9, 9, 9, 9], [1, 4]]
    responses = [[5, 6, 7, 8, 9], [8, 9], [4, 4, 4, 4, 2, 3, 4], [3]]
    out = {}
    for chunk in (None, 3):
        policy = HFPolicy(builtin("tiny-adder"), device=str(device), trainable=True, logprob_chunk_tokens=chunk)
        logp, ent, mask = policy.response_logprobs(prompts, responses, temperature=0.7, with_entropy=True, grad=True)
        assert logp.device.type == device.type
        (-(logp * mask).sum() / mask.sum() - 0.01 * (ent * mask).sum() / mask.sum()).backward()
        scored = policy.response_logprobs(prompts, responses, temperature=0.7, with_entropy=True, micro_batch_size=3)
        assert all(t.device.type == "cpu" for t in scored)  # results without gradients come back to the host
        out[chunk] = logp.detach().cpu(), ent.detach().cpu(), scored, {
            n: p.grad.cpu() for n, p in policy.model.named_parameters()}
    (logp, ent, scored, grads), (c_logp, c_ent, c_scored, c_grads) = out[None], out[3]
    torch.testing.assert_close(c_logp, logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(c_ent, ent, atol=1e-5, rtol=0)
    torch.testing.assert_close(c_scored[0], scored[0], atol=1e-5, rtol=0)
    for name, want in grads.items():
        assert _error(c_grads[name].double(), want.double()) < 1e-4, name


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_top_k_distillation_logprobs_on_the_gpu_equal_the_cpus(builtin, device, pack):
    """A teacher's top-K (host results) and a student's gradient pass at those ids (results on
    the GPU, the ids moved there by the policy's to_device) give the CPU's values."""
    from dapo_flow.algos import topk_forward_kl
    from dapo_flow.models.hf import HFPolicy

    prompts, responses = [[1, 5, 6, 7], [1, 8], [1, 9, 9, 9]], [[5, 6, 7, 8], [8, 9], [4]]
    _, _, mask, (ids, top) = HFPolicy(builtin("tiny-adder")).response_logprobs(prompts, responses, top_k=4)
    teacher = HFPolicy(builtin("tiny-adder"), device=str(device), pack=pack)
    got = teacher.response_logprobs(prompts, responses, top_k=4, micro_batch_size=2)[3]
    assert all(t.device.type == "cpu" for t in got)
    torch.testing.assert_close(got[1], top, atol=1e-5, rtol=0)
    student = HFPolicy(builtin("tiny-adder"), device=str(device), trainable=True, pack=pack)
    _, _, s_mask, (_, at) = student.response_logprobs(prompts, responses, grad=True, at_ids=student.to_device(ids))
    assert at.device.type == device.type and at.requires_grad
    torch.testing.assert_close(at.detach().cpu(), top, atol=1e-5, rtol=0)
    topk_forward_kl(at, student.to_device(top) - 0.1, s_mask).sum().backward()
    assert all(p.grad is not None for p in student.model.parameters() if p.requires_grad)
