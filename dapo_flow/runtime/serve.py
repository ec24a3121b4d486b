"""`dapo-flow serve GRAPH`: the endpoint alone on a graph's model (or a checkpoint of it), for
trying a harness before training it. The model is the one the graph's first generating node
samples with (or ``model``), loaded as the graph declares it (dtype, device); the call format is
that node's ``format`` when it has one (`harness-generate`, `agent-generate`), else ``hermes``.
Requests sample with their own settings and record nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dapo_flow.endpoint.server import LOOPBACK, Endpoint
from dapo_flow.errors import DapoFlowError


def serve(plan: Any, *, model: str | None = None, checkpoint: str | None = None, host: str = LOOPBACK,
          port: int = 0) -> Endpoint:
    """A started :class:`Endpoint` over the graph's model (``plan``: a compiled graph's plan)."""
    from dapo_flow.models import resolve_model
    from dapo_flow.models.hf import HFPolicy
    from dapo_flow.runtime.resources import model_device

    gen = plan.first("generate")
    name = model or (gen.model if gen is not None else None)
    models = plan.spec.models
    if name not in models:
        choices = ", ".join(models) or "none"
        raise DapoFlowError(f"no model to serve: {'--model ' + name + ' is not in the graph' if name else 'the graph has no generating node'}"
                            f"\n    fix: pass --model NAME (the graph's models: {choices})")
    spec = models[name]
    path = Path(checkpoint) if checkpoint else resolve_model(spec.path)
    if checkpoint and not (path / "config.json").is_file():
        raise DapoFlowError(f"--checkpoint {checkpoint}: not a Hugging Face model directory (no config.json)\n"
                            "    fix: a step_* checkpoint's model folder, or `dapo-flow export` a checkpoint first")
    policy = HFPolicy(path, dtype=spec.dtype, device=model_device(spec))
    call_format = getattr(gen.params, "format", "hermes") if gen is not None and gen.model == name else "hermes"
    return Endpoint(policy, model_name=name, call_format=call_format, host=host, port=port).start()
