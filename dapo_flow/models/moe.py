"""A mixture-of-experts model's routers: which modules they are, their logits in a forward, and
where each sequence's tokens sit among them.

Hugging Face's Qwen2/Qwen3-MoE return router logits only through ``output_router_logits``,
which changes the forward's outputs (and, with labels, the loss). Hooks on the router modules
read them from any forward instead, unchanged: the padded one, the packed one and the chunked
output head alike, also with the model sharded by FSDP2 (the hooks sit on the layers' own
submodules, inside the sharded units' forwards).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch


@dataclass(frozen=True)
class Routing:
    """A model's routing: experts per layer, experts per token, and its router modules (layer order)."""

    num_experts: int
    top_k: int
    routers: tuple[torch.nn.Module, ...]


def routing_of(model: torch.nn.Module) -> Routing | None:
    """The model's routers: the ``gate`` of every block that also holds ``experts`` (HF's sparse
    MoE blocks), in layer order; None for a dense model."""
    routers = tuple(module.gate for module in model.modules()
                    if hasattr(module, "experts") and isinstance(getattr(module, "gate", None), torch.nn.Module))
    if not routers:
        return None
    config = model.config
    return Routing(num_experts=int(config.num_experts), top_k=int(config.num_experts_per_tok), routers=routers)


@contextmanager
def router_logits_recorded(routing: Routing) -> Iterator[list[torch.Tensor]]:
    """Inside the block, every router's logits are appended to the yielded list as its forward
    runs (with their autograd graph: a loss on them trains the routers). Shape: each (T, E),
    T = the forward's flat token positions (batch x length)."""
    seen: list[torch.Tensor] = []

    def record(_module, _inputs, output) -> None:
        # HF 5.x routers return (logits, top-k weights, top-k indices); older ones a Linear's logits
        seen.append(output[0] if isinstance(output, tuple) else output)

    handles = [router.register_forward_hook(record) for router in routing.routers]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def token_rows(prompt_ids: list[list[int]], response_ids: list[list[int]], packed: bool) -> torch.Tensor:
    """The row of each flat token position of a forward over these rows, -1 at padding, in the
    layout :meth:`HFPolicy.pack` makes (prompts left-padded, responses right-padded to at least
    one column) or, ``packed``, the one :func:`~dapo_flow.models.packing.pack_rows` makes.
    Shape: (T,) long."""
    from dapo_flow.models.packing import first_fit_bins

    lengths = [len(p) + len(r) for p, r in zip(prompt_ids, response_ids, strict=True)]
    if packed:
        capacity = max(lengths, default=1)
        bins = first_fit_bins(lengths, capacity)
        out = torch.full((len(bins), capacity), -1, dtype=torch.long)
        for b, members in enumerate(bins):
            offset = 0
            for i in members:
                out[b, offset:offset + lengths[i]] = i
                offset += lengths[i]
        return out.reshape(-1)
    width_p = max(map(len, prompt_ids), default=0)
    width_r = max(1, max(map(len, response_ids), default=1))
    out = torch.full((len(prompt_ids), width_p + width_r), -1, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        out[i, width_p - len(p):width_p + len(r)] = i
    return out.reshape(-1)
