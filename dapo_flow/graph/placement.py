"""``place``: which stage runs each node of a plan (the driver, or a model's actor), on what
resources, in which round trips (calls), with which weight syncs after each update. Pure: the
cluster is passed in (:class:`Cluster`), sized by ``dapo_flow.graph.sizing`` and checked by
``dapo_flow.graph.placement_checks`` and ``dapo_flow.graph.fit`` before a plan is returned."""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

from dapo_flow.core.contract import contract_of, scope_of, uses_model
from dapo_flow.errors import GraphError
from dapo_flow.graph import fit, sizing
from dapo_flow.graph.placement_checks import placement_problems
from dapo_flow.graph.plan import (DRIVER, IN_ACTOR, TRANSFER, Call, Cluster, PlacedPlan, Plan, PlanNode, Stage,
                                  Sync, is_model_stage, is_rollout_stage, model_stage, rollout_stage,
                                  stage_model)
from dapo_flow.graph.spec import TrainSpec


def place(plan: Plan, cluster: Cluster) -> PlacedPlan:
    """CPU ops in the driver; one actor per model (two when disaggregated), with
    `placement.models` resources or a default that fits the cluster; `workers: auto` sized to
    the cluster first (dapo_flow.graph.sizing), so the placed plan's spec holds the sizes."""
    stage_of = {n.id: _stage_name(n, plan.spec.placement.mode) for n in plan.nodes}
    hosts = {name: stage_model(name) for name in dict.fromkeys(stage_of.values()) if name != DRIVER}
    sizes = sizing.resolve_auto(plan, cluster, hosts, {name: _workers_of(plan, name) for name in hosts})
    plan = sizing.with_sizes(plan, sizes)
    stage_of = _pull_into_actors(plan, stage_of)
    members: dict[str, list[str]] = {DRIVER: []}
    for node in plan.nodes:
        members.setdefault(stage_of[node.id], []).append(node.id)
    model_of = {name: stage_model(name) for name in members if name != DRIVER}
    workers = {name: _workers_of(plan, name) for name in model_of}
    shares = sizing.default_gpus(plan, cluster, model_of, workers)
    problems = placement_problems(plan, cluster, stage_of, model_of, workers) + shares.problems
    if problems:
        raise GraphError(problems)
    stages = _actor_stages(plan, cluster, members, workers, sizes, shares)
    driver_cpus = max(cluster.cpus - sum(s.num_cpus * s.workers for s in stages), 0.0)
    driver = Stage(DRIVER, DRIVER, tuple(members[DRIVER]), (), driver_cpus, 0.0)
    per_stage = fit.budgets(plan, tuple(stages), cluster)
    problems = fit.memory_problems(plan, tuple(stages), cluster, per_stage)
    if problems:
        raise GraphError(problems)
    node_stage = {nid: name for name, ids in members.items() for nid in ids}
    return PlacedPlan(plan=plan, cluster=cluster, stages=(driver, *stages),
                      node_stage=MappingProxyType(node_stage),
                      calls=MappingProxyType(_calls(plan, node_stage)),
                      syncs=_syncs(plan, node_stage), budgets=MappingProxyType(per_stage))


def _actor_stages(plan: Plan, cluster: Cluster, members: Mapping[str, list[str]], workers: Mapping[str, int],
                  sizes: Mapping[str, sizing.Sized], shares: sizing.Shares) -> list[Stage]:
    """A :class:`Stage` per actor in ``workers`` (stage -> its workers, in placement order), with
    its model's `placement.models` resources, else a CPU share and the GPUs ``shares`` gave it;
    its notes say how sizing decided (explain prints them)."""
    explicit = plan.spec.placement.models
    cpu_each = min(1.0, cluster.cpus / (sum(workers.values()) + 1))  # leave the driver a share
    stages = []
    for name in workers:
        m = stage_model(name)
        cpus, gpus = (explicit[m].num_cpus, explicit[m].num_gpus) if m in explicit else (cpu_each, shares.gpus[name])
        group = _group_of(plan, name)
        notes = ((sizes[m].note,) if group is not None and m in sizes else ()) + (
            (shares.notes[name],) if name in shares.notes else ())
        stages.append(Stage(name=name, kind="actor", nodes=tuple(members[name]), models=(m,),
                            num_cpus=cpus, num_gpus=gpus, workers=workers[name],
                            strategy=group.resolved_strategy if group else "none",
                            placement_strategy=group.placement_strategy if group else "PACK", notes=notes))
    return stages


def _stage_name(node: PlanNode, mode: str) -> str:
    if not uses_model(node.op_cls, node.params):
        return DRIVER
    if mode == "disaggregated" and node.role == "generate":
        return rollout_stage(node.model)
    return model_stage(node.model)


def _group_of(plan: Plan, stage: str) -> TrainSpec | None:
    """The `train:` block of the model a model stage hosts (its group settings); None for the
    driver and for rollout stages (rollout replicas are not training groups)."""
    if not is_model_stage(stage):
        return None
    return plan.spec.models[stage_model(stage)].train


def _workers_of(plan: Plan, stage: str) -> int:
    """Actors a stage runs on: a training group's workers, a rollout stage's replicas, else 1."""
    group = _group_of(plan, stage)
    if group is not None:
        return group.workers
    if is_rollout_stage(stage):
        return plan.spec.models[stage_model(stage)].rollout.replicas
    return 1


def _pull_into_actors(plan: Plan, stage_of: dict[str, str]) -> dict[str, str]:
    """A cheap CPU map runs in an actor instead of the driver's stage where that saves a round
    trip and a table copy a step, and the actor then runs the chain in one call:
    - its inputs and consumers all live in that actor (``advantage`` between ``logprob`` and
      ``update``);
    - its consumers all live in that actor, which is one worker, and each input in the driver's
      stage or that actor: the rows travel to the actor either way (``logprob`` with
      `source: rollout` -> ``advantage`` -> ``update`` for a one-worker trainer).
    These two never into a training group: each of its workers sees a share of the rows (whole
    prompt groups), and a CPU map may need them all (an advantage normalised over the batch).
    Into a training group only a map whose rows need no other prompt group's (``SCOPE`` `row` or
    `group`: ``logprob`` with `source: rollout` -> a group-normalised ``advantage`` -> ``update``,
    each worker computing its own share's; an advantage whitened over the batch stays in the
    driver's stage), that keeps no state, whose consumers are all in the group and whose inputs
    are all in the driver's stage: it then heads the group's call. Never into rollout replicas."""
    consumers = plan.consumers()
    out = dict(stage_of)

    def movable(n) -> bool:
        return out[n.id] == DRIVER and n.cardinality == "map" and bool(n.inputs) and bool(consumers[n.id])

    def actor_ungrouped(stage: str) -> bool:  # an actor no training group divides the rows of
        group = _group_of(plan, stage)
        return stage != DRIVER and not (group is not None and group.grouped)

    for n in plan.nodes:  # topological order, so chains of CPU maps move one by one
        if not movable(n):
            continue
        around = {out.get(i, DRIVER) for i in (*n.inputs, *consumers[n.id])}
        stage = next(iter(around))
        if len(around) == 1 and actor_ungrouped(stage):
            out[n.id] = stage
    for n in reversed(plan.nodes):  # consumers first, so a chain follows its last node in
        if not movable(n):
            continue
        after = {out[c] for c in consumers[n.id]}
        stage = next(iter(after))
        if (len(after) == 1 and actor_ungrouped(stage) and _workers_of(plan, stage) == 1
                and {out.get(i, DRIVER) for i in n.inputs} <= {DRIVER, stage}):
            out[n.id] = stage
    for n in reversed(plan.nodes):  # into the training group that consumes it, on each worker's share
        if not (movable(n) and _splits_by_group(n)):
            continue
        after = {out[c] for c in consumers[n.id]}
        stage = next(iter(after))
        group = _group_of(plan, stage)
        if (len(after) == 1 and group is not None and group.grouped
                and all(out.get(i, DRIVER) == DRIVER for i in n.inputs)):
            out[n.id] = stage
    return out


def _splits_by_group(node: PlanNode) -> bool:
    """Whether ``node`` computes each share of whole prompt groups as it would the whole batch:
    its rows need no other group's (:func:`~dapo_flow.core.contract.scope_of`) and it keeps no
    state (each worker would keep its own) nor holds anything to release."""
    c = contract_of(node.op_cls)
    return scope_of(node.op_cls, node.params) in ("row", "group") and not c.stateful and not c.closes


def _calls(plan: Plan, stage_of: Mapping[str, str]) -> dict[str, tuple[Call, ...]]:
    """Per phase, its nodes cut into calls: consecutive nodes of one stage, each the only
    consumer of the one before, run in one round trip (one table out and back, however long
    the chain); e.g. logprob -> advantage -> update in the model actor, score -> shaping ->
    group filter in the driver."""
    consumers = plan.consumers()
    out: dict[str, tuple[Call, ...]] = {}
    for phase, ids in plan.phases:
        chains: list[list[str]] = []
        for nid in ids:
            prev = chains[-1][-1] if chains else None
            if (prev is not None and stage_of[nid] == stage_of[prev]
                    and plan.node(nid).inputs == (prev,) and consumers[prev] == [nid]):
                chains[-1].append(nid)
            else:
                chains.append([nid])
        out[phase] = tuple(Call(stage_of[c[0]], tuple(c)) for c in chains)
    return out


def _syncs(plan: Plan, stage_of: Mapping[str, str]) -> tuple[Sync, ...]:
    """Each train node's weight syncs, one per stage that generates with its model: none where
    that stage rolls out with the very policy it trains (colocated, a backend whose rollout
    engine is the trained model: hf), in-actor into the stage's own engine (colocated vLLM),
    a transfer between actors otherwise (disaggregated)."""
    out = []
    for after, model in plan.syncs:
        source = stage_of[after]
        targets = sorted({stage_of[n.id] for n in plan.with_role("generate") if n.model == model})
        for target in targets:
            if target != source:
                out.append(Sync(after, model, source, target, TRANSFER))
            elif not plan.backends[model].generates_with_trainer:
                out.append(Sync(after, model, source, target, IN_ACTOR))
    return tuple(out)

