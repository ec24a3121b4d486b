"""The frozen objects the compiler passes along: ValidGraph -> Plan -> PlacedPlan.

``validate`` turns a loaded file into a :class:`ValidGraph` (every node's operator class,
validated params and Arrow schemas known); ``plan`` orders it and applies the rewrites in
``dapo_flow.graph.rewrites``; ``place`` assigns nodes to the driver or to model actors given
:class:`Cluster` facts. The runtime consumes :class:`PlacedPlan` only.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

import pyarrow as pa
from pydantic import BaseModel

from dapo_flow.graph.spec import GraphSpec

if TYPE_CHECKING:
    from dapo_flow.graph.loader import GraphDoc


@dataclass(frozen=True)
class Cluster:
    """Resources to place on; passed in so ``place`` is testable without Ray."""

    cpus: float
    gpus: float = 0.0
    nodes: int = 1

    @classmethod
    def local(cls) -> "Cluster":
        """This machine. GPUs are counted only when torch is already imported (never
        imported just for this)."""
        gpus = 0
        torch = sys.modules.get("torch")
        if torch is not None:
            try:
                gpus = torch.cuda.device_count()
            except Exception:  # a broken CUDA install: place on CPU
                gpus = 0
        return cls(cpus=float(os.cpu_count() or 1), gpus=float(gpus), nodes=1)


@dataclass(frozen=True)
class ValidGraph:
    """A graph that passed every check: spec plus what the compiler learned per node."""

    spec: GraphSpec
    doc: "GraphDoc"
    op_cls: Mapping[str, type]  # node id -> operator class
    params: Mapping[str, BaseModel]  # node id -> validated Params
    in_schema: Mapping[str, pa.Schema]
    out_schema: Mapping[str, pa.Schema]
    order: tuple[str, ...]  # topological, declaration order among peers; no `prompts`

    @property
    def file(self) -> str:
        return self.doc.file


@dataclass(frozen=True)
class PlanNode:
    id: str
    op: str
    op_cls: type
    params: BaseModel  # validated Params instance
    model: str | None
    inputs: tuple[str, ...]
    in_schema: pa.Schema  # columns this node sees
    out_schema: pa.Schema  # columns it emits (map ops: input + produced)
    cardinality: str
    line: int


@dataclass(frozen=True)
class Plan:
    spec: GraphSpec
    file: str
    nodes: tuple[PlanNode, ...]  # topological order, excluding the implicit `prompts` source
    rollout: tuple[str, ...] = ()  # repeated by dynamic sampling: the group-filter + ancestors
    group_filter: str | None = None
    train: tuple[str, ...] = ()  # the remaining ids, topological
    syncs: tuple[tuple[str, str], ...] = ()  # (update node id, model): sync after the update
    fused: tuple[tuple[str, ...], ...] = ()  # runs of cheap CPU nodes executed together
    # where each key sits in the file, for placement errors; not part of the plan's identity
    doc: "GraphDoc | None" = field(default=None, compare=False, repr=False)

    def node(self, node_id: str) -> PlanNode:
        for n in self.nodes:
            if n.id == node_id:
                return n
        raise KeyError(node_id)


#: The stage (and stage kind) that runs in the driver process: CPU operators no actor hosts.
DRIVER = "driver"


@dataclass(frozen=True)
class Stage:
    name: str  # "driver", "model:policy", "rollout:policy"
    kind: str  # "actor" | "driver"
    nodes: tuple[str, ...]
    models: tuple[str, ...]  # models this actor loads
    num_cpus: float
    num_gpus: float


@dataclass(frozen=True)
class PlacedPlan:
    plan: Plan
    cluster: Cluster
    stages: tuple[Stage, ...]
    node_stage: Mapping[str, str]  # node id -> stage name (a MappingProxyType)

    def stage(self, name: str) -> Stage:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(name)
