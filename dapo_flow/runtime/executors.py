"""Executors: where stage workers live. `local` keeps them in this process (debugging,
fast tests); `ray` makes each actor stage a long-lived Ray actor for the whole run.

Both expose the same three calls: `call(stage, method, *args) -> handle`,
`get(handle)`, `shutdown()`. A local handle is the finished value; a Ray handle is an
ObjectRef, so the driver can queue work on an actor and keep going (streaming).
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from dapo_flow.errors import RunError
from dapo_flow.runtime.worker import StageSetup, StageWorker
from dapo_flow.spec import GraphSpec

CALL_TIMEOUT_S = float(os.environ.get("DAPO_FLOW_CALL_TIMEOUT", "900"))


class LocalExecutor:
    name = "local"

    def __init__(self, graph: GraphSpec, setups: Mapping[str, StageSetup], seed: int,
                 resources: Mapping[str, tuple[float, float]] | None = None):
        self.workers = {name: StageWorker(graph, s, seed) for name, s in setups.items()}

    def call(self, stage: str, method: str, *args: Any) -> Any:
        return getattr(self.workers[stage], method)(*args)

    def get(self, handle: Any) -> Any:
        return handle

    def shutdown(self) -> None:
        self.workers.clear()


class RayExecutor:
    name = "ray"

    def __init__(self, graph: GraphSpec, setups: Mapping[str, StageSetup], seed: int,
                 resources: Mapping[str, tuple[float, float]], address: str | None = None):
        import ray

        self._ray = ray
        self.owns_cluster = not ray.is_initialized()
        if self.owns_cluster:
            # token auth (default in Ray 2.60) is pointless for an embedded local cluster
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            ray.init(
                address=address or os.environ.get("RAY_ADDRESS"),
                include_dashboard=False,
                log_to_driver=True,
                logging_level="ERROR",
                configure_logging=True,
            )
        remote_cls = ray.remote(StageWorker)
        self.actors = {}
        for name, setup in setups.items():
            cpus, gpus = resources.get(name, (1.0, 0.0))
            self.actors[name] = remote_cls.options(
                num_cpus=cpus, num_gpus=gpus, name=None, max_restarts=0
            ).remote(graph, setup, seed)
        # surface load errors (bad model path...) now, with the actor's message
        self.get([a.ready.remote() for a in self.actors.values()])

    def call(self, stage: str, method: str, *args: Any) -> Any:
        return getattr(self.actors[stage], method).remote(*args)

    def get(self, handle: Any) -> Any:
        ray = self._ray
        try:
            return ray.get(handle, timeout=CALL_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError as exc:
            raise RunError(
                f"an actor did not answer within {CALL_TIMEOUT_S:.0f} s (hung weight sync or "
                "generation?); raise DAPO_FLOW_CALL_TIMEOUT if the model is just slow"
            ) from exc
        except ray.exceptions.RayActorError as exc:
            raise RunError(f"an actor died: {_root_cause(exc)}; resume with --resume") from exc
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if getattr(exc, "cause", None) is not None else exc
            if isinstance(cause, Exception) and type(cause).__module__.startswith("dapo_flow"):
                raise cause from None
            raise RunError(f"an operator failed inside an actor: {_root_cause(exc)}") from exc

    def shutdown(self) -> None:
        for actor in self.actors.values():
            self._ray.kill(actor)
        self.actors.clear()
        if self.owns_cluster:
            self._ray.shutdown()


def _root_cause(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[-1] if text else type(exc).__name__
