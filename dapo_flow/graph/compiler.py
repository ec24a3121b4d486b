"""Compile a graph file: load -> validate -> plan -> place, pure functions between frozen
objects (see ``dapo_flow.graph.plan``); ``explain`` prints the result without starting Ray.

``validate`` (``dapo_flow.graph.checks``) collects every problem it can find before raising once;
``plan`` applies the rewrites, ``place`` assigns stages to actors and the driver.
"""

from __future__ import annotations

from pathlib import Path
from types import MappingProxyType

import pyarrow as pa

from dapo_flow.graph import columns as C
from dapo_flow.graph.checks import validate
from dapo_flow.graph.contract import produces, requires
from dapo_flow.errors import GraphError, Problem
from dapo_flow.graph.loader import load
from dapo_flow.graph.plan import DRIVER, Cluster, PlacedPlan, Plan, PlanNode, Stage, ValidGraph
from dapo_flow.graph.problems import Found, did_you_mean, pydantic_problems, type_name
from dapo_flow.graph.rewrites import REWRITES


__all__ = ["Cluster", "Found", "compile_graph", "did_you_mean", "explain", "load", "place", "plan",
           "pydantic_problems", "validate"]


def compile_graph(path: str | Path, cluster: Cluster | None = None) -> PlacedPlan:
    """The whole chain; ``cluster`` defaults to this machine."""
    return place(plan(validate(load(path))), cluster or Cluster.local())


# --- plan and place -------------------------------------------------------------------


def plan(valid: ValidGraph) -> Plan:
    """Topologically ordered nodes, then every rewrite in ``rewrites.REWRITES``."""
    index = {n.id: i for i, n in enumerate(valid.spec.nodes)}
    nodes = []
    for nid in valid.order:
        s = valid.spec.nodes[index[nid]]
        cls = valid.op_cls[nid]
        nodes.append(PlanNode(
            id=nid, op=s.op, op_cls=cls, params=valid.params[nid], model=s.model,
            inputs=tuple(s.inputs), in_schema=valid.in_schema[nid],
            out_schema=valid.out_schema[nid], cardinality=cls.CARDINALITY,
            line=valid.doc.line_of(("nodes", index[nid])),
        ))
    result = Plan(spec=valid.spec, file=valid.file, nodes=tuple(nodes),
                  train=tuple(valid.order), doc=valid.doc)
    for rewrite in REWRITES:
        result = rewrite(result)
    return result


def _stage_name(node: PlanNode, mode: str) -> str:
    if not getattr(node.op_cls, "NEEDS_MODEL", False):
        return DRIVER
    if mode == "disaggregated" and node.op == "generate":
        return f"rollout:{node.model}"
    return f"model:{node.model}"


def _pull_into_actors(plan: Plan, stage_of: dict[str, str]) -> dict[str, str]:
    """A cheap CPU map whose inputs and consumers all live in one actor runs in that actor
    (e.g. `advantage` between `logprob` and `update`): two fewer round trips and table
    copies per step, and the actor runs the whole chain in one call."""
    consumers: dict[str, list[str]] = {n.id: [] for n in plan.nodes}
    for n in plan.nodes:
        for i in n.inputs:
            consumers.setdefault(i, []).append(n.id)
    out = dict(stage_of)
    for n in plan.nodes:  # topological order, so chains of CPU maps move one by one
        if out[n.id] != DRIVER or n.cardinality != "map" or not n.inputs or not consumers[n.id]:
            continue
        around = {out.get(i, DRIVER) for i in (*n.inputs, *consumers[n.id])}
        if len(around) == 1 and next(iter(around)) != DRIVER:
            out[n.id] = next(iter(around))
    return out


def place(plan: Plan, cluster: Cluster) -> PlacedPlan:
    """CPU ops in the driver; one actor per model (two when disaggregated), with
    `placement.models` resources or a default that fits the cluster."""
    stage_of = {n.id: _stage_name(n, plan.spec.placement.mode) for n in plan.nodes}
    stage_of = _pull_into_actors(plan, stage_of)
    members: dict[str, list[str]] = {DRIVER: []}
    for node in plan.nodes:
        members.setdefault(stage_of[node.id], []).append(node.id)
    actors = [name for name in members if name != DRIVER]
    model_of = {name: name.split(":", 1)[1] for name in actors}
    explicit = plan.spec.placement.models
    problems = []
    for resource, have in (("num_gpus", cluster.gpus), ("num_cpus", cluster.cpus)):
        asked = sum(getattr(explicit[m], resource) for m in model_of.values() if m in explicit)
        if asked <= have:
            continue
        for m in dict.fromkeys(m for m in model_of.values() if m in explicit):
            n_actors = sum(1 for x in model_of.values() if x == m)
            path = ("placement", "models", m, resource)
            line = plan.doc.line_of(path) if plan.doc is not None else 0
            problems.append(Problem(plan.file, line, "", f"placement.models.{m}.{resource}",
                                    f"{n_actors} actor(s) ask for {getattr(explicit[m], resource):g} "
                                    f"{resource[4:-1].upper()}(s) each, {asked:g} in all, but the "
                                    f"cluster has {have:g}", f"lower {resource} or run on a "
                                    "bigger cluster (ray start --address=...)"))
    if problems:
        raise GraphError(problems)
    default = [a for a in actors if model_of[a] not in explicit]
    free_gpus = cluster.gpus - sum(explicit[m].num_gpus for m in model_of.values() if m in explicit)
    gpu_each = 1.0 if default and free_gpus >= len(default) else 0.0
    cpu_each = min(1.0, cluster.cpus / (len(actors) + 1))  # leave the driver a share
    stages = []
    for name in actors:
        m = model_of[name]
        cpus, gpus = (explicit[m].num_cpus, explicit[m].num_gpus) if m in explicit else (cpu_each, gpu_each)
        stages.append(Stage(name=name, kind="actor", nodes=tuple(members[name]), models=(m,),
                            num_cpus=cpus, num_gpus=gpus))
    driver_cpus = max(cluster.cpus - sum(s.num_cpus for s in stages), 0.0)
    driver = Stage(DRIVER, DRIVER, tuple(members[DRIVER]), (), driver_cpus, 0.0)
    node_stage = {nid: name for name, ids in members.items() for nid in ids}
    return PlacedPlan(plan=plan, cluster=cluster, stages=(driver, *stages),
                      node_stage=MappingProxyType(node_stage))


# --- explain --------------------------------------------------------------------------


def _columns(schema: pa.Schema | dict[str, pa.DataType]) -> str:
    items = list(schema.items()) if isinstance(schema, dict) else [(f.name, f.type) for f in schema]
    return ", ".join(f"{name}:{type_name(t)}" for name, t in items) or "-"


def explain(placed: PlacedPlan) -> str:
    """The placed plan as text: models, stages, then one step phase by phase."""
    p, spec, cluster = placed.plan, placed.plan.spec, placed.cluster
    run = spec.run
    out = [
        f"graph {spec.name} ({Path(p.file).name}): {len(p.nodes)} nodes, "
        f"placement {spec.placement.mode}",
        f"cluster: {cluster.cpus:g} CPUs, {cluster.gpus:g} GPUs, {cluster.nodes} node(s)",
        "",
        "models:",
        *(f"  {name:<14} {m.path} ({m.dtype}, {m.backend}, device {m.device})"
          for name, m in spec.models.items()),
        "",
        "stages:",
    ]
    for s in placed.stages:
        what = f"loads {', '.join(s.models)}; " if s.models else ""
        out.append(f"  {s.name:<16} {s.kind:<6} cpus={s.num_cpus:g} gpus={s.num_gpus:g}  "
                   f"{what}runs {', '.join(s.nodes) or '-'}")
    train = spec.data.train
    gen_batch = run.gen_prompts_per_batch or run.prompts_per_step
    per_batch = ("generation batches sized from the keep rate so far (auto)" if gen_batch == "auto"
                 else f"{gen_batch} per generation batch")
    out += ["", f"step ({run.steps} steps, {run.prompts_per_step} prompt groups each):",
            f"  prompts: {train.source} [{train.split}], {per_batch}",
            f"    emits {_columns(C.prompt_schema())}"]
    fused_at = {run_[0]: run_ for run_ in p.fused}
    phases = [("rollout", p.rollout), ("train", p.train)] if p.group_filter else [("step", p.train)]
    for phase, ids in phases:
        if phase == "rollout":
            gf = p.node(p.group_filter)
            cap = getattr(gf.params, "max_gen_batches", 0)
            out.append(f"  rollout (repeated until {run.prompts_per_step} groups are kept; at most "
                       f"{cap or 'unlimited'} generation batches, then "
                       f"{getattr(gf.params, 'on_cap', 'error')}):")
        elif phase == "train":
            out.append("  train:")
        else:
            out.append("  all nodes once (no group-filter, so no dynamic sampling):")
        for nid in ids:
            node = p.node(nid)
            if nid == p.group_filter:
                out.append("    == group barrier: wait for whole prompt groups ==")
            if nid in fused_at:
                out.append(f"    fused in driver: {' -> '.join(fused_at[nid])}")
            out += _explain_node(node, placed.node_stage[nid])
            out += [f"    sync weights: {upd} -> generator of '{m}'"
                    + (" (same actor)" if spec.placement.mode == "colocated" else "")
                    for upd, m in p.syncs if upd == nid]
    return "\n".join(out) + "\n"


def _explain_node(node: PlanNode, stage: str) -> list[str]:
    given = " ".join(f"{k}={getattr(node.params, k)}" for k in type(node.params).model_fields
                     if k in node.params.model_fields_set)
    kind = node.op if node.op == node.cardinality else f"{node.op}, {node.cardinality}"
    lines = [f"    {node.id} [{kind}] @ {stage}  (line {node.line})"]
    if given:
        lines.append(f"      params   {given}")
    lines.append(f"      needs    {_columns(requires(node.op_cls, node.params))}")
    made = produces(node.op_cls, node.params)
    lines.append(f"      {'emits' if node.cardinality == 'sink' else 'adds':<8} {_columns(made)}")
    return lines

