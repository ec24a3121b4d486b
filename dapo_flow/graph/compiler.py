"""Compile a graph file: load -> validate -> plan -> place, pure functions between frozen
objects (see ``dapo_flow.graph.plan``); ``dapo_flow.graph.explain`` prints the result without
starting Ray.

``validate`` (``dapo_flow.graph.checks``) collects every problem it can find before raising once;
``plan`` applies the rewrites, ``place`` (``dapo_flow.graph.placement``) assigns stages to actors
and the driver. This module is the pipeline: its four steps are importable from here.
"""

from __future__ import annotations

from pathlib import Path

from dapo_flow.core.contract import contract_of, node_model, role
from dapo_flow.graph.checks import validate
from dapo_flow.graph.loader import load
from dapo_flow.graph.placement import place
from dapo_flow.graph.plan import Cluster, PlacedPlan, Plan, PlanNode, ValidGraph
from dapo_flow.graph.registry import Registries
from dapo_flow.graph.rewrites import REWRITES


__all__ = ["Cluster", "Registries", "compile_graph", "load", "place", "plan", "validate"]


def compile_graph(path: str | Path, cluster: Cluster | None = None,
                  registries: Registries | None = None) -> PlacedPlan:
    """The whole chain; ``cluster`` defaults to this machine, ``registries`` (what op and
    backend names mean) to the built-ins and loaded plugins."""
    return place(plan(validate(load(path), registries)), cluster or Cluster.local())


def plan(valid: ValidGraph) -> Plan:
    """Topologically ordered nodes, then every rewrite in ``rewrites.REWRITES``."""
    index = {n.id: i for i, n in enumerate(valid.spec.nodes)}
    nodes = []
    for nid in valid.order:
        s = valid.spec.nodes[index[nid]]
        cls = valid.op_cls[nid]
        nodes.append(PlanNode(
            id=nid, op=s.op, op_cls=cls, params=valid.params[nid],
            model=node_model(cls, s.model, valid.params[nid]),
            inputs=tuple(s.inputs), in_schema=valid.in_schema[nid],
            out_schema=valid.out_schema[nid], cardinality=contract_of(cls).cardinality,
            line=valid.doc.line_of(("nodes", index[nid])), role=role(cls),
        ))
    result = Plan(spec=valid.spec, file=valid.file, nodes=tuple(nodes),
                  train=tuple(valid.order), doc=valid.doc, backends=dict(valid.backends))
    for rewrite in REWRITES:
        result = rewrite(result)
    return result
