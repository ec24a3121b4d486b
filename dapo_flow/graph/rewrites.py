"""Plan rewrites: small pure rules ``Plan -> Plan``, applied in order by ``compiler.plan``.

Each returns a new Plan (``dataclasses.replace``) and never mutates its argument, so a
rule can be tested alone and ``explain`` shows what every rule decided.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from dapo_flow.graph.plan import DynamicSampling, Plan


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
    segment that dynamic sampling repeats until enough whole prompt groups are kept, as its
    params say (``Plan.dynamic_sampling``)."""
    gf = next((n.id for n in plan.nodes if n.cardinality == "group-filter"), None)
    if gf is None:
        return replace(plan, rollout=(), group_filter=None, dynamic_sampling=None,
                       train=tuple(n.id for n in plan.nodes))
    upstream = ancestors(plan, gf) | {gf}
    return replace(
        plan,
        group_filter=gf,
        dynamic_sampling=DynamicSampling.of(plan.node(gf)),
        rollout=tuple(n.id for n in plan.nodes if n.id in upstream),
        train=tuple(n.id for n in plan.nodes if n.id not in upstream),
    )


def add_weight_syncs(plan: Plan) -> Plan:
    """After each trainer (role `train`), push the new weights to the generators of its model."""
    generated = {n.model for n in plan.nodes if n.role == "generate"}
    syncs = tuple(
        (n.id, n.model) for n in plan.nodes if n.role == "train" and n.model in generated
    )
    return replace(plan, syncs=syncs)


REWRITES: tuple[Callable[[Plan], Plan], ...] = (mark_group_barrier, add_weight_syncs)
