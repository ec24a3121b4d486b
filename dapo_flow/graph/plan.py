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

from dapo_flow.core.contract import (Sampling, TrainSizing, forward_rows_of, group_settings_of, logprob_role_of,
                                     sampling_of, train_sizing_of)
from dapo_flow.data.prompt_budget import PromptBudget
from dapo_flow.graph.prompt_room import declared_for_all, rooms, source_budget, tightest
from dapo_flow.graph.spec import PROMPTS_SOURCE, GraphSpec
from dapo_flow.models.engines import Backend

if TYPE_CHECKING:
    from dapo_flow.graph.loader import GraphDoc
    from dapo_flow.graph.memory import Budget
    from dapo_flow.graph.spec import DataSourceSpec


@dataclass(frozen=True)
class Cluster:
    """Resources to place on; passed in so ``place`` is testable without Ray."""

    cpus: float
    gpus: float = 0.0
    nodes: int = 1
    gpu_mem_gib: float | None = None  # memory of one GPU; None: unknown (memory is not checked)

    @classmethod
    def local(cls) -> "Cluster":
        """This machine. GPUs are counted only when torch is already imported (never
        imported just for this)."""
        gpus, mem = 0, None
        torch = sys.modules.get("torch")
        if torch is not None:
            try:
                gpus = torch.cuda.device_count()
                if gpus:
                    mem = torch.cuda.get_device_properties(0).total_memory / 2**30
            except Exception:  # a broken CUDA install: place on CPU
                gpus, mem = 0, None
        return cls(cpus=float(os.cpu_count() or 1), gpus=float(gpus), nodes=1, gpu_mem_gib=mem)


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
    backends: Mapping[str, "Backend"] = field(default_factory=dict)  # model name -> its backend

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
    role: str = "transform"  # what the operator is (contract.ROLES): read instead of op names

    def sampling(self) -> Sampling:
        """A generate node's group size and longest response, as its op declares them."""
        return sampling_of(self.op_cls, self.params)

    def forward_rows(self) -> int | None:
        """Rows per forward of a node that runs a model without training it, as its op declares them."""
        return forward_rows_of(self.op_cls, self.params)

    def train_sizing(self) -> TrainSizing:
        """A train node's update sizes, as its op declares them."""
        return train_sizing_of(self.op_cls, self.params)

    def logprob_role(self) -> str:
        """Whose logprobs a logprob node reads (contract.LOGPROB_ROLES), as its op declares it."""
        return logprob_role_of(self.op_cls, self.params)


@dataclass(frozen=True)
class DynamicSampling:
    """How a step's rollout phase repeats until its group filter has kept ``run.prompts_per_step``
    prompt groups, fixed at compile time from the group-filter node's params (a custom group
    filter without a field gets its default)."""

    node: str  # the group filter's id: the rollout phase's last node
    metric: str = "acc"  # the per-sequence value whose spread keeps a group (for messages)
    max_gen_batches: int = 0  # generation batches per step before on_cap applies; 0: no cap
    on_cap: str = "error"  # "error" | "train-on-what-we-have" | "skip-step"
    max_skipped_steps: int = 0  # steps in a row that train nothing before the run stops; 0: never

    @classmethod
    def of(cls, node: "PlanNode") -> "DynamicSampling":
        s = group_settings_of(node.op_cls, node.params)
        return cls(node=node.id, metric=s.metric, max_gen_batches=s.max_gen_batches, on_cap=s.on_cap,
                   max_skipped_steps=s.max_skipped_steps)

    @property
    def cap(self) -> str:
        return str(self.max_gen_batches or "unlimited")


@dataclass(frozen=True)
class Plan:
    spec: GraphSpec
    file: str
    nodes: tuple[PlanNode, ...]  # topological order, excluding the implicit `prompts` source
    rollout: tuple[str, ...] = ()  # repeated by dynamic sampling: the group-filter + ancestors
    group_filter: str | None = None
    dynamic_sampling: DynamicSampling | None = None  # with a group filter: how the rollout phase repeats
    train: tuple[str, ...] = ()  # the remaining ids, topological
    syncs: tuple[tuple[str, str], ...] = ()  # (train node id, model): sync after the update
    # model name -> the backend (models.engines.Backend) its `backend:` named when compiled
    backends: Mapping[str, "Backend"] = field(default_factory=dict, compare=False, repr=False)
    # where each key sits in the file, for placement errors; not part of the plan's identity
    doc: "GraphDoc | None" = field(default=None, compare=False, repr=False)

    def node(self, node_id: str) -> PlanNode:
        for n in self.nodes:
            if n.id == node_id:
                return n
        raise KeyError(node_id)

    def with_role(self, role: str) -> tuple[PlanNode, ...]:
        """Nodes whose operator declares ``role`` (contract.ROLES), in topological order."""
        return tuple(n for n in self.nodes if n.role == role)

    def first(self, role: str) -> PlanNode | None:
        """The first node of ``role`` (the generator validation samples with, ...), or None."""
        return next(iter(self.with_role(role)), None)

    @property
    def group_size(self) -> int:
        """Samples per prompt: the first generate node's ``n`` (1 without one)."""
        gen = self.first("generate")
        return int(gen.sampling().n) if gen is not None else 1

    def consumers(self) -> dict[str, list[str]]:
        """node id (or `prompts`) -> ids of the nodes that read it, in topological order."""
        out: dict[str, list[str]] = {n.id: [] for n in self.nodes}
        for n in self.nodes:
            for i in n.inputs:
                out.setdefault(i, []).append(n.id)
        return out

    @property
    def phases(self) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """(phase name, node ids) in the order a step runs them: "rollout" (repeated by dynamic
        sampling) then "train" with a group filter; one "step" phase without."""
        if self.group_filter is None:
            return (("step", self.train),)
        return (("rollout", self.rollout), ("train", self.train))

    def engine_context(self) -> dict[str, int]:
        """Per generated model, the longest row it sees (what its rollout engine must serve when
        `rollout.max_model_len` is null, what the memory estimate sizes rows by): the prompt
        budget (the largest of the sources', data.max_prompt_length or a source's
        max_prompt_tokens) plus the largest max_tokens of its generate nodes. Empty where a
        source has no prompt budget (rows are then bounded by the model's own maximum)."""
        budget = declared_for_all(self.spec.data)
        if budget is None:
            return {}
        out: dict[str, int] = {}
        for node in self.with_role("generate"):
            tokens = node.sampling().max_tokens
            if node.model and isinstance(tokens, int):
                out[node.model] = max(out.get(node.model, 0), budget + tokens)
        return out

    @property
    def engine_scored(self) -> tuple[str, ...]:
        """Frozen models scored by their rollout engine instead of a torch copy, sorted: no node
        trains or generates with them, every node that reads them is a `logprob` one of role teacher
        or ref, and their backend's engine scores given tokens (``Backend.scores_frozen``: vLLM's
        prompt logprobs), so a large teacher or reference is served as a rollout would be."""
        readers: dict[str, set[str]] = {}
        for n in self.nodes:
            if n.model:  # an actor-role logprob node (entropy, routing replay) needs the torch copy
                readers.setdefault(n.model, set()).add(n.logprob_role() if n.role == "logprob" else n.role)
        return tuple(sorted(m for m, roles in readers.items()
                            if roles <= {"teacher", "ref"} and m in self.backends and self.backends[m].scores_frozen))

    @property
    def trained_models(self) -> tuple[str, ...]:
        """Models some `train`-role node updates, sorted."""
        return tuple(sorted({n.model for n in self.with_role("train") if n.model}))

    def prompt_budget(self, src: "DataSourceSpec") -> PromptBudget | None:
        """What bounds source ``src``'s prompts (:func:`~dapo_flow.graph.prompt_room.source_budget`),
        beside the tightest room this graph's generate nodes leave; what the data loaders apply."""
        found = rooms(((n.id, n.model, n.sampling().max_tokens) for n in self.with_role("generate")),
                      self.spec.models)
        return source_budget(self.spec.data, src, tightest(found))


#: The stage (and stage kind) that runs in the driver process: CPU operators no actor hosts.
DRIVER = "driver"

# An actor stage is named after the model it hosts, e.g. "model:policy" (the model's trainer, and
# its rollout engine when colocated) or "rollout:policy" (only the rollout engine: disaggregated
# placement). These helpers are the one place that builds and reads the names, which MLflow and
# explain show as they are.
_MODEL_PREFIX, _ROLLOUT_PREFIX = "model:", "rollout:"


def model_stage(model: str) -> str:
    """The stage that trains ``model`` (and generates with it, colocated): ``model:NAME``."""
    return f"{_MODEL_PREFIX}{model}"


def rollout_stage(model: str) -> str:
    """The stage that only generates with ``model`` (disaggregated): ``rollout:NAME``."""
    return f"{_ROLLOUT_PREFIX}{model}"


def is_model_stage(stage: str) -> bool:
    return stage.startswith(_MODEL_PREFIX)


def is_rollout_stage(stage: str) -> bool:
    return stage.startswith(_ROLLOUT_PREFIX)


def stage_model(stage: str) -> str:
    """The model an actor stage hosts (``policy`` of ``rollout:policy``)."""
    return stage.split(":", 1)[1]


#: strategies whose stage is a training group (Stage.strategy, StageSetup.strategy)
GROUP_STRATEGIES = ("fsdp2", "ddp")


@dataclass(frozen=True)
class Stage:
    name: str  # "driver", "model:policy", "rollout:policy" (DRIVER, model_stage, rollout_stage)
    kind: str  # "actor" | "driver"
    nodes: tuple[str, ...]
    models: tuple[str, ...]  # models this actor loads
    num_cpus: float  # per worker
    num_gpus: float  # per worker
    workers: int = 1  # > 1: a training group, one actor per worker on one placement group
    strategy: str = "none"  # how the group trains its model: "fsdp2" | "ddp" | "none"
    placement_strategy: str = "PACK"  # the group's placement group strategy
    # how placement sized the stage to the cluster (`workers: auto`, a share of a GPU), for explain
    notes: tuple[str, ...] = ()

    @property
    def is_group(self) -> bool:
        """A stage whose model is trained by a group of workers (FSDP2 shards, even one, or DDP
        replicas): its calls go to every worker, each with its share of the rows
        (dapo_flow.runtime.group)."""
        return self.strategy in GROUP_STRATEGIES

    @property
    def sharded(self) -> bool:
        """Whether each worker holds only a shard of the model (FSDP2)."""
        return self.strategy == "fsdp2"


@dataclass(frozen=True)
class Call:
    """One round trip the runner makes: ``nodes`` run back to back in ``stage`` (an actor, or the
    driver), each feeding the next, and only the last one's output comes back."""

    stage: str
    nodes: tuple[str, ...]


#: Sync kinds: the actor pushes its trained policy into its own rollout engine (colocated vLLM),
#: or the trainer's actor exports the weights and the rollout actor imports them (disaggregated).
IN_ACTOR, TRANSFER = "in-actor", "transfer"


@dataclass(frozen=True)
class Sync:
    """After train node ``after``, the new weights of ``model`` go from ``source`` to ``target``."""

    after: str
    model: str
    source: str
    target: str
    kind: str  # IN_ACTOR | TRANSFER


@dataclass(frozen=True)
class PlacedPlan:
    """What the runtime executes, and exactly what `explain` prints: per phase the calls in order,
    and the weight syncs after each train node."""

    plan: Plan
    cluster: Cluster
    stages: tuple[Stage, ...]
    node_stage: Mapping[str, str]  # node id -> stage name (a MappingProxyType)
    calls: Mapping[str, tuple[Call, ...]] = field(default_factory=dict)  # phase -> calls, in order
    syncs: tuple[Sync, ...] = ()
    budgets: Mapping[str, "Budget"] = field(default_factory=dict)  # actor stage -> memory per worker

    @property
    def generates_in_parts(self) -> bool:
        """Whether a generation batch is generated in parts, stopping once enough groups are
        kept (run.gen_stop_early): where the trained batch stays the one the whole batch gives,
        i.e. the surplus is dropped (not carried), the batch is not sized from the keep rate
        already, no weight sync can come between its parts (not async), and its parts reach a
        generating node that samples them as it would the whole (``BATCH_PARTS``: generate)
        as they are (no chunks, no node before it)."""
        run, calls = self.plan.spec.run, self.calls.get("rollout")
        if not (run.gen_stop_early and not run.carry_surplus and not run.chunk_prompts and calls
                and run.gen_prompts_per_batch != "auto" and run.rollout_mode != "async"
                and self.plan.dynamic_sampling is not None):
            return False
        head = self.plan.node(calls[0].nodes[0])
        return head.inputs == (PROMPTS_SOURCE,) and bool(getattr(head.op_cls, "BATCH_PARTS", False))

    @property
    def prefetches_generation(self) -> bool:
        """Whether, on an executor that queues calls (Ray), each update of a synchronous run has
        the next step's first generation call queued behind it (unless a validation, checkpoint
        or metrics write comes between the steps): the generating actors are the trainer's (no
        weight sync, so it samples with the update's weights), a group filter ends the rollout,
        generation reads the prompts, and no carried groups could make the next step need none."""
        run, calls = self.plan.spec.run, self.calls.get("rollout")
        return bool(run.rollout_mode == "sync" and not self.syncs and not run.carry_surplus and calls
                    and self.plan.dynamic_sampling is not None
                    and self.plan.node(calls[0].nodes[0]).inputs == (PROMPTS_SOURCE,))

    def stage(self, name: str) -> Stage:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(name)
