"""Ulysses sequence parallelism (verl's ``ulysses_sequence_parallel_size``): one sequence's
tokens split across the k workers of a sequence-parallel group.

Every layer but attention treats tokens independently, so each worker runs them on its own
slice of the sequence (1/k of the activations). Attention needs every token: before it, an
all-to-all turns "my tokens, every head" into "every token, my heads/k of the heads"; the
worker computes ordinary attention on those heads, and a second all-to-all turns the result
back into "my tokens, every head" for the output projection. So k must divide both the query
and the key/value heads (a worker's query heads then read exactly its key/value heads).

Position ids are the sequence's global ones (a worker's slice of them), so rotary embeddings
are those of the unsplit forward; the attention mask is built once from the whole sequence's
positions (:func:`segment_causal_mask`) and used after the all-to-all, where every token is
there. The output head runs on a worker's slice; :func:`gather_sequence` puts per-token
values (logprobs, entropy) back together, whole, on every worker of the group.

Gradients: a worker's backward covers the computation it did, so each parameter's gradient is
the sum over the group's workers (an all-reduce, or a sharded model's reduce-scatter).
:func:`dapo_flow.models.hf.split_logprobs_of` is a causal LM's logprobs this way. gloo (CPU)
and NCCL both implement ``all_to_all_single`` (checked with torch 2.13's gloo).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

# --- the sequence dimension: padding, slices -----------------------------------------------------

def padded_length(length: int, k: int) -> int:
    """The smallest multiple of ``k`` that holds ``length`` tokens."""
    return -(-length // k) * k


def pad_sequence(x: torch.Tensor, k: int, *, dim: int = 1, value: float | int = 0) -> torch.Tensor:
    """``x`` padded with ``value`` at the end of ``dim`` to a multiple of ``k``.
    Shape: (..., L, ...) -> (..., padded_length(L, k), ...)."""
    extra = padded_length(x.shape[dim], k) - x.shape[dim]
    if extra == 0:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_full(shape, value)], dim=dim)


def split_sequence(x: torch.Tensor, k: int, rank: int, *, dim: int = 1, value: float | int = 0) -> torch.Tensor:
    """Worker ``rank``'s contiguous slice of ``dim`` after padding to a multiple of ``k``.
    Shape: (..., L, ...) -> (..., padded_length(L, k) // k, ...)."""
    return pad_sequence(x, k, dim=dim, value=value).chunk(k, dim=dim)[rank]


def segment_causal_mask(position_ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Which key each query may attend to, for rows (or packed bins of rows) whose positions
    restart: a new segment starts wherever a position is not the previous one + 1 (transformers'
    rule for packed sequences), and a query sees earlier-or-equal keys of its own segment that
    ``keep`` holds (left/right padding is not kept). Every query also sees itself, so a padding
    query attends to something: a fully masked row would give NaN, and NaN times a zero weight
    would spread to real tokens. Shape: position_ids, keep (B, L) -> (B, 1, L, L) bool."""
    step = torch.ones_like(position_ids, dtype=torch.bool)
    step[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    segment = step.cumsum(-1)  # (B, L)
    length = position_ids.shape[1]
    idx = torch.arange(length, device=position_ids.device)
    causal = idx[:, None] >= idx[None, :]  # (L, L)
    same = segment[:, :, None] == segment[:, None, :]  # (B, L, L)
    allowed = causal & same & keep.bool()[:, None, :]
    return (allowed | torch.eye(length, dtype=torch.bool, device=position_ids.device))[:, None]


# --- collectives with their gradients --------------------------------------------------------------

def _exchange(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: Any) -> torch.Tensor:
    """One all-to-all: ``x``'s ``scatter_dim`` cut in k pieces, piece j sent to worker j; the k
    pieces received (one from each worker, in rank order) joined along ``gather_dim``.
    Shape: scatter_dim of size n*k -> n; gather_dim of size m -> m*k."""
    k = dist.get_world_size(group)
    pieces = torch.stack(x.chunk(k, dim=scatter_dim))  # (k, ...): all_to_all_single cuts dim 0
    received = torch.empty_like(pieces)
    dist.all_to_all_single(received, pieces.contiguous(), group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, scatter_dim: int, gather_dim: int, group: Any) -> torch.Tensor:
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _exchange(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        scatter_dim, gather_dim = ctx.dims
        # the exchange is a permutation of elements across workers: its adjoint is the reverse one
        return _exchange(grad.contiguous(), gather_dim, scatter_dim, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: Any) -> torch.Tensor:
    """:func:`_exchange` with its gradient (the reverse exchange)."""
    return _AllToAll.apply(x, scatter_dim, gather_dim, group)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # every worker of the group computes the same loss of the whole gathered tensor, so each
        # holds the whole gradient already: its own slice is its part (summing would count it k times)
        rank = dist.get_rank(ctx.group)
        return grad.chunk(dist.get_world_size(ctx.group), dim=ctx.dim)[rank].contiguous(), None, None


def gather_sequence(x: torch.Tensor, group: Any, *, dim: int = 1) -> torch.Tensor:
    """The group's slices joined along ``dim`` in rank order, on every worker; the gradient of
    a loss every worker computes alike flows back to each worker's own slice.
    Shape: (..., l, ...) -> (..., l * k, ...)."""
    return _GatherSequence.apply(x, dim, group)


# --- attention ---------------------------------------------------------------------------------

ATTENTION = "ulysses_"  # + the model's own implementation: the name a split model's attention runs under
_GROUPS: dict[int, Any] = {}  # id(model config) -> the sequence-parallel group its attention splits over


def ulysses_attention(inner: Callable) -> Callable:
    """The attention function a model runs once :func:`install` split it (transformers'
    attention interface), around ``inner``, the model's own (sdpa, eager).

    A forward of a worker's slice of whole sequences passes the whole sequences' mask
    (:func:`segment_causal_mask`), more rows than the query has: heads are exchanged for tokens,
    ``inner`` runs on whole sequences, and the result is exchanged back. Any other forward (a
    logprob pass without gradients, generation) passes its own mask and runs ``inner`` as the
    model would. The choice is made by the shapes, not by a flag, so a backward that recomputes
    the forward (activation checkpointing), after every context has closed, splits as it did.
    Shape: query (b, H, l, d), key/value (b, Hkv, l, d), l = L/k; mask (b, 1, L, L) bool
    -> (b, l, H, d), the layout transformers' functions return."""

    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, Any]:
        if attention_mask is None or attention_mask.shape[-2] == query.shape[2]:
            return inner(module, query, key, value, attention_mask, **kwargs)
        group = _GROUPS[id(module.config)]
        q, k, v = (all_to_all(t, 1, 2, group) for t in (query, key, value))  # (b, H/k, L, d)
        out, weights = inner(module, q, k, v, attention_mask, **kwargs)  # (b, L, H/k, d)
        return all_to_all(out, 1, 2, group), weights  # (b, l, H, d)

    return attention


def check_heads(config: Any, k: int) -> None:
    """k must divide the query and the key/value heads (each worker attends with whole heads)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % k or kv_heads % k:
        raise ValueError(f"sequence parallelism over {k} workers splits attention heads: {heads} query and "
                         f"{kv_heads} key/value heads are not both multiples of {k}")


def install(model: torch.nn.Module, group: Any) -> None:
    """``model``'s attention splits over ``group`` whenever a forward passes it a slice of whole
    sequences (:func:`ulysses_attention`), for the model's life or until :func:`uninstall`."""
    import sys

    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config = model.config
    check_heads(config, dist.get_world_size(group))
    own = config._attn_implementation
    if own not in ("sdpa", "eager"):
        raise ValueError(f"sequence parallelism runs the model's attention on whole sequences with an explicit "
                         f"mask: sdpa or eager, not {own!r}")
    # eager lives in the model family's module, not in the shared registry
    inner = (ALL_ATTENTION_FUNCTIONS[own] if own == "sdpa"
             else sys.modules[type(model).__module__].eager_attention_forward)
    AttentionInterface.register(ATTENTION + own, ulysses_attention(inner))
    AttentionMaskInterface.register(ATTENTION + own, ALL_MASK_ATTENTION_FUNCTIONS[own])  # unsplit forwards' masks
    _GROUPS[id(config)] = group
    config._attn_implementation = ATTENTION + own


def uninstall(model: torch.nn.Module) -> None:
    """The model's own attention back."""
    config = model.config
    if config._attn_implementation.startswith(ATTENTION):
        config._attn_implementation = config._attn_implementation[len(ATTENTION):]
    _GROUPS.pop(id(config), None)


def slice_inputs(input_ids: torch.Tensor, position_ids: torch.Tensor, keep: torch.Tensor, group: Any
                 ) -> dict[str, torch.Tensor]:
    """A worker's forward inputs for its slice of whole sequences: its ids and (global) positions,
    and the whole (padded) sequences' mask, which tells :func:`ulysses_attention` to split.
    Shape: input_ids, position_ids, keep (B, L) -> input_ids, position_ids (B, l), attention_mask
    (B, 1, k*l, k*l), l = padded_length(L, k) / k."""
    k, rank = dist.get_world_size(group), dist.get_rank(group)
    mask = segment_causal_mask(pad_sequence(position_ids, k), pad_sequence(keep.bool(), k, value=False))
    return {"input_ids": split_sequence(input_ids, k, rank), "position_ids": split_sequence(position_ids, k, rank),
            "attention_mask": mask}
