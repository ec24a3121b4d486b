"""Plan rewrites: small pure rules ``Plan -> Plan``, applied in order by ``compiler.plan``.

Each returns a new Plan (``dataclasses.replace``) and never mutates its argument, so a
rule can be tested alone and ``explain`` shows what every rule decided.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from dapo_flow.graph.plan import Plan, PlanNode


def ancestors(plan: Plan, node_id: str) -> set[str]:
    """Ids upstream of ``node_id`` (excluding the implicit `prompts` source)."""
    by_id = {n.id: n for n in plan.nodes}
    seen: set[str] = set()
    todo = list(by_id[node_id].inputs)
    while todo:
        nid = todo.pop()
        if nid in by_id and nid not in seen:
            seen.add(nid)
            todo.extend(by_id[nid].inputs)
    return seen


def mark_group_barrier(plan: Plan) -> Plan:
    """Split the step at the group-filter: it and everything upstream form the rollout
    segment that dynamic sampling repeats until enough whole prompt groups are kept."""
    gf = next((n.id for n in plan.nodes if n.cardinality == "group-filter"), None)
    if gf is None:
        return replace(plan, rollout=(), group_filter=None, train=tuple(n.id for n in plan.nodes))
    upstream = ancestors(plan, gf) | {gf}
    return replace(
        plan,
        group_filter=gf,
        rollout=tuple(n.id for n in plan.nodes if n.id in upstream),
        train=tuple(n.id for n in plan.nodes if n.id not in upstream),
    )


def _cheap(node: PlanNode) -> bool:
    return node.cardinality == "map" and not getattr(node.op_cls, "NEEDS_MODEL", False)


def fuse_cpu_maps(plan: Plan) -> Plan:
    """Group chains of in-driver map nodes (a feeds only b, b reads only a) within one
    phase into runs executed back to back without materialising in between."""
    consumers: dict[str, int] = {}
    for n in plan.nodes:
        for i in n.inputs:
            consumers[i] = consumers.get(i, 0) + 1
    phase = {nid: "rollout" for nid in plan.rollout}
    runs: list[list[str]] = []
    prev: PlanNode | None = None
    for node in plan.nodes:
        chained = (
            prev is not None
            and _cheap(prev)
            and _cheap(node)
            and node.inputs == (prev.id,)
            and consumers.get(prev.id, 0) == 1
            and phase.get(prev.id) == phase.get(node.id)
        )
        if chained:
            runs[-1].append(node.id)
        else:
            runs.append([node.id])
        prev = node
    return replace(plan, fused=tuple(tuple(r) for r in runs if len(r) > 1))


def add_weight_syncs(plan: Plan) -> Plan:
    """After each `update`, push the new weights to the generator of the same model."""
    generated = {n.model for n in plan.nodes if n.op == "generate"}
    syncs = tuple(
        (n.id, n.model) for n in plan.nodes if n.op == "update" and n.model in generated
    )
    return replace(plan, syncs=syncs)


# order matters: fusion must not cross the group barrier
REWRITES: tuple[Callable[[Plan], Plan], ...] = (mark_group_barrier, fuse_cpu_maps, add_weight_syncs)
