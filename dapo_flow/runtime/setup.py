"""From a placed plan to the per-stage setups workers are built from (pure)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from dapo_flow.graph.plan import DRIVER
from dapo_flow.runtime.worker import NodeSetup, StageSetup



#: ``run`` settings outside a graph's identity: none changes what a step computes, so a run
#: resumes across a change of them.
NOT_IDENTITY = ("steps", "keep_checkpoints", "max_failures", "hang_timeout_s")


#: a model's ``train:`` settings outside the identity: how many workers train it, and how they
#: are placed, change where a step runs, not what it computes (sharded checkpoints load at any
#: world size), so a run resumes on more or fewer workers.
GROUP_KEYS = ("workers", "strategy", "placement_strategy")


def identity(data: dict) -> dict:
    """A graph's dump (``spec.model_dump(mode="json")``) less what is not its identity:
    :data:`NOT_IDENTITY` and each model's :data:`GROUP_KEYS`."""
    data = json.loads(json.dumps(data))  # a deep copy
    for key in NOT_IDENTITY:
        data.get("run", {}).pop(key, None)
    for model in data.get("models", {}).values():
        for key in GROUP_KEYS:
            (model.get("train") or {}).pop(key, None)
    return data


def graph_hash(spec) -> str:
    """Identity of a graph for checkpoints/resume: everything but what :func:`identity` drops."""
    data = identity(spec.model_dump(mode="json"))
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def stage_setups(placed, model_paths: dict[str, str] | None = None, weights_version: int = 0
                 ) -> dict[str, StageSetup]:
    """Each stage's setup; on resume ``model_paths`` (the checkpoint's trained models) and
    ``weights_version`` (the policy version they are at)."""
    plan = placed.plan
    base_dir = str(Path(plan.file).resolve().parent)
    specs = {n.id: n for n in plan.spec.nodes}
    nodes = {n.id: n for n in plan.nodes}
    trained = {n.model for n in plan.nodes if n.role == "train"}
    setups = {}
    for stage in placed.stages:
        members = [nodes[i] for i in stage.nodes]
        setups[stage.name] = StageSetup(
            name=stage.name,
            nodes=tuple(
                NodeSetup(
                    id=n.id, op=n.op, params=n.params.model_dump(mode="json"), model=n.model,
                    impl=specs[n.id].impl or f"{n.op_cls.__module__}:{n.op_cls.__qualname__}",
                    base_dir=base_dir,
                )
                for n in members
            ),
            models=tuple(stage.models),
            trainable=tuple(m for m in stage.models if m in trained and any(
                n.model == m and n.role == "train" for n in members)),
            generates=tuple(m for m in stage.models if any(
                n.model == m and n.role == "generate" for n in members)),
            scores=tuple(m for m in stage.models if any(
                n.model == m and n.role != "generate" for n in members)),
            engine_scored=tuple(m for m in stage.models if m in plan.engine_scored),
            model_paths=dict(model_paths or {}),
            weights_version=weights_version,
            max_model_len=plan.engine_context(),
            backends={m: plan.backends[m] for m in stage.models if m in plan.backends},
            num_threads=_threads(stage),
            strategy=stage.strategy, workers=stage.workers, placement_strategy=stage.placement_strategy,
            workdir=os.getcwd(),
        )
    return setups


def _threads(stage) -> int:
    """Threads for an actor (its worker passes them to :func:`dapo_flow.threads.configure`):
    its whole CPUs, at least 1. Oversubscribing (2 threads on a 2-core box that also runs the
    driver) made steps 6-17x slower under load (benchmarks/step_overhead.py), because the
    threads wait at each other's barriers; on a quiet box it gained the tiny model 1.1-1.3x a
    step at most (benchmarks/README.md, "Threads")."""
    if stage.kind != "actor" or stage.num_gpus > 0:
        return 0
    return max(1, int(stage.num_cpus))


def driver_threads(placed) -> int:
    """Threads for the driver process: its stage's CPUs, at least 1 (it scores, filters and
    glues tables while the model actors compute)."""
    return max(1, int(sum(s.num_cpus for s in placed.stages if s.kind == DRIVER)))
