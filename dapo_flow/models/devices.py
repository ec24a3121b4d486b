"""Where tensors cross between the host and a model's device: the only place that does.

Operators work on host arrays (numpy, from Arrow). A model computes on its device (CPU, CUDA).
Host arrays go to the model's device through :func:`to_device`; results come back through
:func:`to_host`. An operator that combined a host tensor with a model output itself would run
on CPU and crash on CUDA ("Expected all tensors to be on the same device"), so none does: the
policy hands out inference results on the host (:class:`dapo_flow.models.hf.HFPolicy`) and
moves a training operator's host arrays to its device (``HFPolicy.to_device``).

Values are nested dicts / lists / tuples of numpy arrays and tensors; anything else passes
through unchanged.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def to_device(value: Any, device: torch.device | str) -> Any:
    """``value`` with every numpy array and tensor on ``device`` (arrays as tensors, sharing
    host memory where the device is the host). Shape-preserving."""
    device = torch.device(device)
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value).to(device)
    if isinstance(value, torch.Tensor):
        return value.to(device)
    return _map(value, lambda v: to_device(v, device))


def to_host(value: Any) -> Any:
    """``value`` with every tensor detached and on the CPU (an optimizer's state, a model's
    outputs): what the driver, Arrow and the disk can take whatever device produced it."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    return _map(value, to_host)


def prepare_device(device: torch.device | str) -> None:
    """Process-wide settings a model on ``device`` computes under, set before its first forward.

    CUDA: scaled-dot-product attention without the cuDNN backend. cuDNN builds an execution
    plan for every new (batch, sequence length) shape, ~0.1 s each; RL changes lengths every
    step (decoding grows the KV cache one token at a time; each batch pads to its own longest
    row), so on an H200 a 16 x 8 x 256-token rollout took 35 s with it against 7 s once its
    plans were built. Flash attention (no mask) and memory-efficient attention (masks) build
    nothing per shape. Process-wide rather than a context: gradient checkpointing recomputes a
    layer in the backward pass, outside any context, and must pick the forward's backend."""
    if torch.device(device).type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)


def host_floats(values: dict[str, Any]) -> dict[str, float]:
    """Scalar statistics (python numbers or 0-dim tensors on any device) as python floats, the
    device's ones read in a single transfer instead of one synchronisation each."""
    keys = [k for k, v in values.items() if isinstance(v, torch.Tensor)]
    out = {k: float(v) for k, v in values.items() if not isinstance(v, torch.Tensor)}
    if keys:
        stacked = torch.stack([values[k].detach().float().reshape(()) for k in keys]).tolist()
        out.update(zip(keys, stacked))
    return {k: out[k] for k in values}


def _map(value: Any, fn) -> Any:
    if isinstance(value, dict):
        return {k: fn(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(fn(v) for v in value)
    return value
