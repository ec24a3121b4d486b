"""Token logprobs and entropy from logits (the trainer's and the update's one implementation), and
a generative verifier's verdict from token logprobs."""

from __future__ import annotations

import torch
from torch import Tensor

from dapo_flow.algos.errors import AlgoError

_LOGSUMEXP_CHUNK = 1 << 24  # elements per logsumexp chunk: bounds the exp() temporary to 64 MiB


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Categorical entropy, verl_F.entropy_from_logits: logsumexp(z) - sum(softmax(z) * z).
    Shape: (..., vocab) -> (...)."""
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - torch.sum(probs * logits, dim=-1)


def lowest_token_probability(logp: Tensor, mask: Tensor) -> Tensor:
    """Per row, the lowest probability among its response tokens: a generative verifier's
    verdict on a response (a causal LM that would write the right answer gives each of its
    tokens a high probability, and a wrong token a low one); 0 for a row with no tokens, which
    has nothing to accept. Shape: logp (B, R) log-probabilities, mask (B, R) -> (B,) float32."""
    if logp.shape != mask.shape or logp.dim() != 2:
        raise AlgoError(f"logp {tuple(logp.shape)} and mask {tuple(mask.shape)} must be the same (B, R) shape")
    valid = mask.bool()
    lowest = torch.where(valid, logp.float(), torch.full_like(logp, float("inf"), dtype=torch.float32)).amin(dim=1)
    return torch.where(valid.any(dim=1), lowest.clamp(max=0.0).exp(), torch.zeros_like(lowest))


def logprobs_from_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """log softmax(logits)[label] as gather minus logsumexp, never materialising log_softmax.

    logsumexp runs in row chunks (its exp temporary stays <= 64 MiB) and in float32 for
    bf16/fp16 logits (verl falls back to log_softmax there for stability); the result is then
    float32. Shape: logits (..., vocab), labels (...) int -> (...).
    """
    if labels.shape != logits.shape[:-1]:
        raise AlgoError(f"labels shape {tuple(labels.shape)} != logits shape[:-1] {tuple(logits.shape[:-1])}")
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    acc = logits.dtype if logits.dtype in (torch.float32, torch.float64) else torch.float32
    picked = flat.gather(-1, labels.reshape(-1, 1).long()).squeeze(-1).to(acc)
    return (picked - _logsumexp(flat, acc)).reshape(labels.shape)


def _logsumexp(flat: Tensor, acc: torch.dtype) -> Tensor:
    """logsumexp over the last dim in row chunks (the exp temporary <= 64 MiB), in ``acc``.
    Shape: (N, vocab) -> (N,)."""
    rows = max(1, _LOGSUMEXP_CHUNK // max(flat.shape[-1], 1))
    if flat.shape[0] <= rows:
        return torch.logsumexp(flat.to(acc), dim=-1)
    return torch.cat([torch.logsumexp(c.to(acc), dim=-1) for c in flat.split(rows)])


def vocab_logprobs(logits: Tensor, *, top_k: int = 0, ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """log softmax(logits) at K tokens per position: the ``top_k`` most likely (a teacher's
    top-K for distillation), or the given ``ids`` (a student's logprobs at its teacher's top-K,
    differentiable). Gathers K columns and subtracts one logsumexp per position, so no second
    (..., vocab) tensor is made. Exactly one of ``top_k`` > 0 and ``ids`` is given.
    Shape: logits (..., vocab); ids (..., K) int -> ids (..., K) int64, logp (..., K) float32
    (float64 for float64 logits), top-K in decreasing order."""
    if (top_k > 0) == (ids is not None):
        raise AlgoError("vocab_logprobs takes exactly one of top_k > 0 and ids")
    vocab = logits.shape[-1]
    acc = logits.dtype if logits.dtype in (torch.float32, torch.float64) else torch.float32
    if ids is None:
        if top_k > vocab:
            raise AlgoError(f"top_k {top_k} exceeds the vocabulary ({vocab} tokens)")
        picked, ids = logits.topk(top_k, dim=-1)
    else:
        if ids.shape[:-1] != logits.shape[:-1]:
            raise AlgoError(f"ids shape {tuple(ids.shape)} does not match logits shape {tuple(logits.shape)} "
                            "but for the last dim")
        ids = ids.long()
        picked = logits.gather(-1, ids)
    lse = _logsumexp(logits.reshape(-1, vocab), acc).reshape(logits.shape[:-1] + (1,))
    return ids, picked.to(acc) - lse


def chunked_linear_logprobs(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    chunk_tokens: int,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Token logprobs (and entropy) of a linear output head, ``chunk_tokens`` tokens at a time:
    ``logits = (hidden @ weight.T + bias).float() / temperature``, then
    :func:`logprobs_from_logits` and :func:`entropy_from_logits` per chunk, so at most
    (chunk_tokens, vocab) logits exist at once instead of (tokens, vocab).

    With gradients, no chunk's logits are kept for the backward: each chunk's are recomputed
    there, one chunk at a time (:class:`_ChunkedLinearLogprobs`); the values and gradients are
    those of the whole (tokens, vocab) computation up to float rounding. The fused path
    (:func:`_fused_forward`, :func:`_fused_backward`) takes a float32 head outside autocast and a
    bf16 / fp16 head or bf16 autocast alike: one float32 chunk buffer reused, the logits'
    gradient written in place from the saved logsumexp and entropy; in low precision the head's
    matmuls run in that precision and the logits are cast to float32 per chunk, as autocast
    runs the whole computation. Other mixes (a bf16 head over float32 hidden states outside
    autocast) take the generic path: autograd through each recomputed chunk.
    Shape: hidden (N, h), weight (V, h), bias (V,) or None, labels (N,) int -> logp (N,) float32,
    entropy (N,) float32 or None.
    """
    if chunk_tokens < 1:
        raise AlgoError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if hidden.ndim != 2 or labels.shape != hidden.shape[:1]:
        raise AlgoError(f"hidden {tuple(hidden.shape)} must be (tokens, hidden) and labels "
                        f"{tuple(labels.shape)} (tokens,)")
    needs_grad = any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    if torch.is_grad_enabled() and needs_grad:
        return _ChunkedLinearLogprobs.apply(hidden, weight, bias, labels, temperature, chunk_tokens, with_entropy)
    compute = _low_precision_compute(hidden, weight, bias)
    if compute is not None or _fused_applies(hidden, weight, bias):
        logp, _, ent = _fused_forward(hidden, weight, bias, labels, temperature, chunk_tokens, with_entropy, compute)
        return logp, ent
    parts = [_linear_logprobs(hidden[s:e], weight, bias, labels[s:e], temperature, with_entropy)
             for s, e in _chunks(hidden.shape[0], chunk_tokens)]
    logp = torch.cat([p[0] for p in parts])
    return logp, torch.cat([p[1] for p in parts]) if with_entropy else None


def _chunks(n: int, size: int) -> list[tuple[int, int]]:
    """[start, end) bounds of consecutive chunks of ``size`` covering ``range(n)`` (one empty
    chunk when n is 0, so that the outputs still exist and carry a graph)."""
    return [(s, min(s + size, n)) for s in range(0, n, size)] or [(0, 0)]


def _linear_logprobs(hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor,
                     temperature: float, with_entropy: bool) -> tuple[Tensor, Tensor | None]:
    """One chunk, in the unchunked path's order of operations. Shape: (c, h) -> (c,), (c,) or None."""
    logits = torch.nn.functional.linear(hidden, weight, bias).float() / temperature  # (c, V)
    return logprobs_from_logits(logits, labels), entropy_from_logits(logits) if with_entropy else None


class _ChunkedLinearLogprobs(torch.autograd.Function):
    """:func:`chunked_linear_logprobs` with gradients. The forward keeps only its inputs (the
    hidden states, the head's weight and bias, the labels); the backward recomputes each chunk's
    logits, takes their gradient through the same logprob / entropy functions (autograd on the
    chunk alone), and applies the head's backward by hand: the hidden states' gradient chunk by
    chunk into one (N, h) tensor, the weight's summed over chunks in float32. An output that
    gets no gradient (entropy only logged) is not differentiated: no buffers, no work.

    Under ``torch.autocast`` (mixed precision) the backward recomputes the chunks in the
    forward's autocast state (as ``torch.amp.custom_bwd`` does), so their logits are the
    forward's bf16 ones and the head's backward matmuls run in bf16, as the unchunked path's."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temperature, chunk_tokens, with_entropy):
        ctx.save_for_backward(hidden, weight, bias, labels)
        ctx.temperature, ctx.chunk_tokens = temperature, chunk_tokens
        device = hidden.device.type
        ctx.autocast = (device, torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else None
        ctx.set_materialize_grads(False)
        ctx.compute = _low_precision_compute(hidden, weight, bias)  # bf16 head or autocast: its dtype
        ctx.fused = ctx.compute is not None or _fused_applies(hidden, weight, bias)
        if ctx.fused:  # one reused float32 chunk buffer, logsumexp (and entropy) kept
            logp, lse, ent = _fused_forward(hidden, weight, bias, labels, temperature, chunk_tokens, with_entropy,
                                            ctx.compute)
            ctx.save_for_backward(hidden, weight, bias, labels, lse, ent)
            return logp, ent
        parts = [_linear_logprobs(hidden[s:e], weight, bias, labels[s:e], temperature, with_entropy)
                 for s, e in _chunks(hidden.shape[0], chunk_tokens)]
        logp = torch.cat([p[0] for p in parts])
        return logp, torch.cat([p[1] for p in parts]) if with_entropy else None

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        if ctx.fused:
            return _fused_backward(ctx, grad_logp, grad_entropy)
        if ctx.autocast is None:
            return _ChunkedLinearLogprobs._backward(ctx, grad_logp, grad_entropy)
        device, dtype = ctx.autocast
        with torch.autocast(device_type=device, dtype=dtype):
            return _ChunkedLinearLogprobs._backward(ctx, grad_logp, grad_entropy)

    @staticmethod
    def _backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, labels = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        acc = torch.float32 if weight.dtype in (torch.float16, torch.bfloat16) else weight.dtype
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_bias else None
        for s, e in _chunks(hidden.shape[0], ctx.chunk_tokens):
            h = hidden[s:e]
            grad_logits = _logits_grad(h, weight, bias, labels[s:e], ctx.temperature,
                                       None if grad_logp is None else grad_logp[s:e],
                                       None if grad_entropy is None else grad_entropy[s:e])  # (c, V)
            if grad_hidden is not None:
                if grad_logits.dtype == weight.dtype == grad_hidden.dtype:
                    torch.mm(grad_logits, weight, out=grad_hidden[s:e])
                else:  # autocast: bf16 logits' gradient, the matmul in bf16, stored in hidden's dtype
                    grad_hidden[s:e] = grad_logits @ weight
            if grad_weight is not None:
                if grad_weight.dtype == grad_logits.dtype:
                    grad_weight.addmm_(grad_logits.T, h)
                else:  # bf16/fp16 head: sum the chunks' products in float32, as one matmul would
                    grad_weight.add_(grad_logits.T @ h)
            if grad_bias is not None:
                grad_bias.add_(grad_logits.sum(0))
            del grad_logits  # before the next chunk's logits exist
        cast = lambda g, like: None if g is None else g.to(like.dtype)  # noqa: E731
        return grad_hidden, cast(grad_weight, weight), cast(grad_bias, bias), None, None, None, None


def _logits_grad(hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, temperature: float,
                 grad_logp: Tensor | None, grad_entropy: Tensor | None) -> Tensor:
    """One chunk's logits recomputed and the gradient reaching them from logp and entropy (a
    function of its own, so the chunk's buffers are freed once autograd is done with them).
    Shape: hidden (c, h), labels / grads (c,) -> (c, V) in the head's dtype."""
    logits = torch.nn.functional.linear(hidden, weight, bias).detach().requires_grad_()  # (c, V)
    outputs, grads = [], []
    with torch.enable_grad():
        scaled = logits.float() / temperature
        if grad_logp is not None:
            outputs.append(logprobs_from_logits(scaled, labels))
            grads.append(grad_logp)
        if grad_entropy is not None:
            outputs.append(entropy_from_logits(scaled))
            grads.append(grad_entropy)
        del scaled  # autograd keeps what it needs, and frees it as it goes
        return torch.autograd.grad(outputs, logits, grads)[0]


# --- the fused float32 path ----------------------------------------------------------------
# The same values and gradients as the generic path, with the (chunk, vocab) work done in place in
# buffers allocated once per call (fresh buffers per chunk cost a page fault per 4 KiB on CPU):
# the forward keeps each position's logsumexp (and entropy), so the backward turns a recomputed
# chunk of logits into their gradient in two passes over it instead of autograd's graph:
#   d logp / dz = onehot(label) - p,   d entropy / dz = -p * (log p + entropy),   z = logits / T.


def _fused_applies(hidden: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """float32 (or float64) head and hidden states of one dtype, outside autocast; a bf16 head
    or autocast takes the generic path (its logits are bf16, cast per chunk)."""
    dtype = weight.dtype
    return (dtype in (torch.float32, torch.float64) and hidden.dtype == dtype
            and (bias is None or bias.dtype == dtype) and not torch.is_autocast_enabled(hidden.device.type))


def _low_precision_compute(hidden: Tensor, weight: Tensor, bias: Tensor | None) -> torch.dtype | None:
    """The dtype the head's matmuls run in when it is not the float32 path's: bf16 / fp16
    autocast's over float32 (or low-precision) tensors, or a bf16 / fp16 head whose hidden states
    (and bias) share its dtype; else None."""
    device = hidden.device.type
    low = (torch.bfloat16, torch.float16)
    if torch.is_autocast_enabled(device):
        cast = torch.get_autocast_dtype(device)
        tensors = [t for t in (hidden, weight, bias) if t is not None]
        return cast if cast in low and all(t.dtype in (torch.float32, *low) for t in tensors) else None
    if weight.dtype in low and hidden.dtype == weight.dtype and (bias is None or bias.dtype == weight.dtype):
        return weight.dtype
    return None


def _logits_into(out: Tensor, hidden: Tensor, weight: Tensor, bias: Tensor | None, temperature: float,
                 compute: torch.dtype | None = None) -> Tensor:
    """z = (hidden @ weight.T + bias) / temperature written into ``out``; with ``compute`` the
    matmul runs in that dtype (``weight`` and ``bias`` already in it) and its result is cast
    into ``out``'s. Shape: (c, h) -> (c, V)."""
    if compute is not None:
        out.copy_(torch.nn.functional.linear(hidden.to(compute), weight, bias))
    elif bias is None:
        torch.mm(hidden, weight.T, out=out)
    else:
        torch.addmm(bias, hidden, weight.T, out=out)
    return out.div_(temperature) if temperature != 1.0 else out


def _head_in(weight: Tensor, bias: Tensor | None, compute: torch.dtype | None) -> tuple[Tensor, Tensor | None]:
    """The head's weight and bias as its matmuls take them (cast once per call, as autocast
    casts them once per forward)."""
    if compute is None:
        return weight, bias
    return weight.to(compute), None if bias is None else bias.to(compute)


def _fused_forward(hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, temperature: float,
                   chunk_tokens: int, with_entropy: bool, compute: torch.dtype | None = None
                   ) -> tuple[Tensor, Tensor, Tensor | None]:
    """logp, logsumexp and entropy (or None) of every position, one chunk at a time in reused
    buffers. ``compute``: the low-precision dtype of the head's matmuls (then the buffers and
    results are float32). Shape: hidden (N, h), labels (N,) -> (N,) each, in the head's dtype
    (float32 with ``compute``)."""
    n, vocab = hidden.shape[0], weight.shape[0]
    dtype = hidden.dtype if compute is None else torch.float32
    w, b = _head_in(weight, bias, compute)
    with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):  # casts are explicit
        logp = hidden.new_empty(n, dtype=dtype)
        lse = hidden.new_empty(n, dtype=dtype)
        ent = hidden.new_empty(n, dtype=dtype) if with_entropy else None
        rows = max(1, min(chunk_tokens, n))
        z_buf = hidden.new_empty(rows, vocab, dtype=dtype)
        e_buf = hidden.new_empty(rows, vocab, dtype=dtype) if with_entropy else None
        for s, e in _chunks(n, chunk_tokens):
            z = _logits_into(z_buf[: e - s], hidden[s:e], w, b, temperature, compute)
            picked = z.gather(1, labels[s:e, None].long()).squeeze(1)
            top = z.amax(1, keepdim=True)  # (c, 1): exp never overflows
            shifted = z.sub_(top)  # z - top <= 0, in place
            if with_entropy:  # e = exp(z - top); entropy = log sum(e) - sum(e * (z - top)) / sum(e)
                ex = torch.exp(shifted, out=e_buf[: e - s])
                total = ex.sum(1)
                ez = shifted.mul_(ex).sum(1)  # z is spent; torch's sum, not a BLAS dot: its
                # cascade keeps a 150k-term sum at float32's rounding (a dot product's was 25x that)
                ent[s:e] = total.log() - ez / total
            else:
                total = shifted.exp_().sum(1)
            lse[s:e] = top.squeeze(1) + total.log()
            logp[s:e] = picked - lse[s:e]
    return logp, lse, ent


def _fused_backward(ctx, grad_logp: Tensor | None, grad_entropy: Tensor | None):
    """The gradients of hidden, weight and bias: per chunk, recompute z into a reused buffer and
    turn it in place into d loss / d logits, then the head's three matmuls."""
    if grad_logp is None and grad_entropy is None:  # neither output reached the loss
        return None, None, None, None, None, None, None
    hidden, weight, bias, labels, lse, ent = ctx.saved_tensors
    need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
    temperature, compute = ctx.temperature, ctx.compute
    n, vocab = hidden.shape[0], weight.shape[0]
    # low precision: the logits' gradient in float32, cast to the matmuls' dtype (as autograd
    # casts it to the bf16 logits'); the weight's and bias's summed over chunks in float32
    acc = lse.dtype
    grad_hidden = torch.empty_like(hidden) if need_hidden else None
    grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_weight else None
    grad_bias = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_bias else None
    w, b = _head_in(weight, bias, compute)
    rows = max(1, min(ctx.chunk_tokens, n))
    g_buf = hidden.new_empty(rows, vocab, dtype=acc)
    p_buf = hidden.new_empty(rows, vocab, dtype=acc) if grad_entropy is not None else None
    with torch.autocast(hidden.device.type, enabled=False):  # casts are explicit
        for s, e in _chunks(n, ctx.chunk_tokens):
            c, h = e - s, hidden[s:e]
            g = _logits_into(g_buf[:c], h, w, b, temperature, compute).sub_(lse[s:e, None])  # log p
            if grad_entropy is None:  # -g_logp * p
                g.exp_().mul_(grad_logp[s:e, None].neg())
            else:  # -p * (g_logp + g_ent * (log p + entropy))
                p = torch.exp(g, out=p_buf[:c])
                g.add_(ent[s:e, None]).mul_(grad_entropy[s:e, None])
                if grad_logp is not None:
                    g.add_(grad_logp[s:e, None])
                g.mul_(p).neg_()
            if grad_logp is not None:  # + g_logp at the label
                g.scatter_add_(1, labels[s:e, None].long(), grad_logp[s:e, None].to(g.dtype))
            if temperature != 1.0:
                g.div_(temperature)
            if compute is not None:  # the head's backward in its matmuls' precision
                g, h = g.to(compute), h.to(compute)
            if grad_hidden is not None:
                if compute is None:
                    torch.mm(g, w, out=grad_hidden[s:e])
                else:  # a 16-bit product, stored in the hidden states' dtype
                    grad_hidden[s:e] = g @ w
            if grad_weight is not None:
                if compute is None:
                    grad_weight.addmm_(g.T, h)
                else:  # the chunks' 16-bit products summed in float32, as one matmul would
                    grad_weight.add_(g.T @ h)
            if grad_bias is not None:
                grad_bias.add_(g.sum(0))
    cast = lambda g, like: None if g is None else g.to(like.dtype)  # noqa: E731
    return grad_hidden, cast(grad_weight, weight), cast(grad_bias, bias), None, None, None, None
