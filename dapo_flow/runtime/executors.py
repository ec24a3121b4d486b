"""Executors: where stage workers live. `local` keeps them in this process (debugging,
fast tests); `ray` makes each actor stage a long-lived Ray actor for the whole run.

Each satisfies :class:`Executor`: `call(stage, method, *args) -> handle`, `get(handle)`,
`shutdown()`. A local handle is the finished value; a Ray handle is an ObjectRef, so the
driver can queue work on an actor and keep going (streaming). :data:`EXECUTORS` is the
registry `--executor` chooses from: adding one is a class plus one line there.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping, Protocol, runtime_checkable

import pyarrow as pa

from dapo_flow.errors import RunError
from dapo_flow.runtime.worker import StageSetup, StageWorker
from dapo_flow.graph.spec import GraphSpec

RESUME_HINT = "`dapo-flow run GRAPH --resume` continues from the last checkpoint"
DEFAULT_CALL_TIMEOUT_S = 900.0
STARTUP_TIMEOUT_S = 900.0  # actors load models (and may wait for resources) before the first call


def call_timeout() -> float:
    """Seconds to wait for one actor call: $DAPO_FLOW_CALL_TIMEOUT, read at call time."""
    return float(os.environ.get("DAPO_FLOW_CALL_TIMEOUT", DEFAULT_CALL_TIMEOUT_S))


@runtime_checkable
class Executor(Protocol):
    """Hosts the actor stages of a run: ``__init__(graph, setups, seed, resources, address=None)``
    builds every stage's :class:`StageWorker` (``resources``: stage -> (cpus, gpus))."""

    name: str
    #: reads a list of parquet files (or one file) into one table on the executor's side;
    #: None: the driver reads them with pyarrow
    read_parquet: Callable[[Any], pa.Table] | None

    def call(self, stage: str, method: str, *args: Any) -> Any:
        """Start ``StageWorker.method(*args)`` on ``stage``; a handle for :meth:`get`."""

    def get(self, handle: Any) -> Any:
        """The result of a call (raises its error; a RunError when an actor died or hung)."""

    def shutdown(self) -> None:
        """Release every worker (and a cluster the executor started)."""


class LocalExecutor:
    name = "local"
    read_parquet = None  # prompts are read with pyarrow in-process

    def __init__(self, graph: GraphSpec, setups: Mapping[str, StageSetup], seed: int,
                 resources: Mapping[str, tuple[float, float]] | None = None, address: str | None = None):
        self.workers = {name: StageWorker(graph, s, seed) for name, s in setups.items()}

    def call(self, stage: str, method: str, *args: Any) -> Any:
        return getattr(self.workers[stage], method)(*args)

    def get(self, handle: Any) -> Any:
        return handle

    def shutdown(self) -> None:
        for worker in self.workers.values():
            worker.close()  # a vLLM engine holds its KV cache until closed
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
        try:
            for name, setup in setups.items():
                cpus, gpus = resources.get(name, (1.0, 0.0))
                self.actors[name] = remote_cls.options(
                    num_cpus=cpus, num_gpus=gpus, name=None, max_restarts=0
                ).remote(graph, setup, seed)
            # surface load errors (bad model path...) now, with the actor's message; a short
            # call timeout (a test's, a fast model's) must not cut model loading short
            self.get([a.ready.remote() for a in self.actors.values()],
                     timeout=max(call_timeout(), STARTUP_TIMEOUT_S))
        except BaseException:
            self.shutdown()  # else the actors and the cluster outlive a failed start in-process
            raise

    def call(self, stage: str, method: str, *args: Any) -> Any:
        return getattr(self.actors[stage], method).remote(*args)

    def read_parquet(self, files) -> pa.Table:
        """Prompts read with Ray Data (parallel reads of one file, or of a folder's shards given
        as a name-ordered list), rows kept in that order so Ray and local runs see the same prompts."""
        ctx = self._ray.data.DataContext.get_current()
        ctx.execution_options.preserve_order = True
        paths = [str(f) for f in files] if isinstance(files, list) else str(files)
        ds = self._ray.data.read_parquet(paths)
        tables = [t for t in self._ray.get(ds.to_arrow_refs()) if t.num_rows]
        if tables:
            return pa.concat_tables(tables)
        schema = ds.schema()  # None when no file holds a row group
        return schema.base_schema.empty_table() if schema is not None else pa.table({})

    def get(self, handle: Any, timeout: float | None = None) -> Any:
        ray = self._ray
        timeout = call_timeout() if timeout is None else timeout
        try:
            return ray.get(handle, timeout=timeout)
        except ray.exceptions.GetTimeoutError as exc:
            raise RunError(
                f"{self._who(handle)} did not answer within {timeout:g} s (hung weight sync or "
                "generation? not enough CPUs/GPUs for the actors?); raise DAPO_FLOW_CALL_TIMEOUT "
                f"if the model is just slow. {RESUME_HINT}"
            ) from exc
        except ray.exceptions.RayActorError as exc:
            raise RunError(f"{self._who(handle)} died: {_root_cause(exc)}. {RESUME_HINT}") from exc
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if getattr(exc, "cause", None) is not None else exc
            if isinstance(cause, Exception) and type(cause).__module__.startswith("dapo_flow"):
                raise cause from None
            raise RunError(f"an operator failed inside an actor: {_root_cause(exc)}") from exc

    def _who(self, handle: Any) -> str:
        """'the actor of stage X' for a single call's handle, for messages."""
        try:
            actor_id = handle.task_id().actor_id()
            return next(f"the actor of stage '{s}'" for s, a in self.actors.items()
                        if a._actor_id == actor_id)
        except Exception:  # a list of handles, or a private Ray attribute gone: no name
            return "an actor"

    def shutdown(self) -> None:
        for actor in self.actors.values():
            self._ray.kill(actor)
        self.actors.clear()
        if self.owns_cluster:
            self._ray.shutdown()


def _root_cause(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[-1] if text else type(exc).__name__


#: `--executor` choices: name -> class satisfying :class:`Executor`
EXECUTORS: dict[str, type] = {"local": LocalExecutor, "ray": RayExecutor}


def executor_class(name: str) -> type:
    """The registered executor ``name``; a clear error listing the choices otherwise."""
    try:
        return EXECUTORS[name]
    except KeyError:
        raise RunError(f"unknown executor '{name}': use one of {', '.join(EXECUTORS)}") from None
