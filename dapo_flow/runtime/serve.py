"""`dapo-flow serve GRAPH`: the endpoint alone on a graph's model (or a checkpoint of it), for
trying a harness before training it. The model is the one the graph's first generating node
samples with (or ``model``), loaded as the graph declares it (dtype, device); the call format is
the one that node's op declares (``Sampling.call_format``: `harness-generate`'s and `agent-generate`'s
``format``), else ``hermes``.
Requests sample with their own settings and record nothing. ``replicas`` > 1 loads the model that
many times, each copy behind an endpoint of its own on a free loopback port (on its own GPU where
the process sees enough), and serves them all at one address through a router
(:mod:`dapo_flow.endpoint.router`): episodes stick to a replica, other requests go to the least busy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dapo_flow.endpoint.router import Backend, Router
from dapo_flow.endpoint.server import LOOPBACK, Endpoint
from dapo_flow.errors import DapoFlowError


class ServedModel:
    """What `serve` started: the address clients use (``base_url``, ``token``, ``model_name``) and
    what ``close`` stops (the router, then every replica's endpoint)."""

    def __init__(self, endpoints: list[Endpoint], router: Router | None):
        self.endpoints, self.router = endpoints, router
        front = router or endpoints[0]
        self.base_url, self.token = front.base_url, front.token
        self.model_name = endpoints[0].served.model_name

    def close(self) -> None:
        if self.router is not None:
            self.router.close()
        for endpoint in self.endpoints:
            endpoint.close()


def serve(plan: Any, *, model: str | None = None, checkpoint: str | None = None, host: str = LOOPBACK,
          port: int = 0, replicas: int = 1) -> ServedModel:
    """The graph's model served (``plan``: a compiled graph's plan), started."""
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
    call_format = gen.sampling().call_format if gen is not None and gen.model == name else "hermes"
    if replicas == 1:
        policy = HFPolicy(path, dtype=spec.dtype, device=model_device(spec))
        return ServedModel([Endpoint(policy, model_name=name, call_format=call_format, host=host, port=port).start()], None)
    endpoints: list[Endpoint] = []
    try:
        for device in replica_devices(model_device(spec), replicas):
            policy = HFPolicy(path, dtype=spec.dtype, device=device)
            endpoints.append(Endpoint(policy, model_name=name, call_format=call_format).start())
        router = Router([Backend(e.base_url, e.token) for e in endpoints], model_name=name, host=host, port=port)
        return ServedModel(endpoints, router.start())
    except BaseException:
        for endpoint in endpoints:
            endpoint.close()
        raise


def replica_devices(device: str, replicas: int) -> list[str]:
    """Where each replica runs: GPU i for replica i when ``device`` is CUDA and this process sees
    ``replicas`` GPUs, else all on ``device`` (CPU replicas share the process's threads)."""
    if device == "cuda":
        import torch

        if torch.cuda.device_count() >= replicas:
            return [f"cuda:{i}" for i in range(replicas)]
    return [device] * replicas
