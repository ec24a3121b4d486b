"""Compile a graph file: load -> validate -> plan -> place, pure functions between frozen
objects (see ``dapo_flow.plan``); ``explain`` prints the result without starting Ray.

``validate`` collects every problem it can find before raising once: Pydantic errors of
every section, each node's params against its operator's ``Params``, wiring (unknown
inputs, cycles, unreachable nodes), model rules (one update per model, frozen refs) and
Arrow column types propagated from `prompts` along every edge.
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Iterable

import networkx as nx
import pyarrow as pa
from pydantic import BaseModel, ValidationError

from dapo_flow import columns as C
from dapo_flow.contract import contract_problems, produces, requires, resolve
from dapo_flow.errors import (
    DapoFlowError,
    GraphError,
    OperatorContractError,
    Problem,
    SchemaError,
    UnknownOperatorError,
)
from dapo_flow.imports import load_object
from dapo_flow.loader import GraphDoc, PathKey, load
from dapo_flow.plan import Cluster, PlacedPlan, Plan, PlanNode, Stage, ValidGraph
from dapo_flow.registry import CUSTOM_OP, OPERATORS
from dapo_flow.rewrites import REWRITES
from dapo_flow.spec import PROMPTS_SOURCE, GraphSpec, NodeSpec

__all__ = ["Cluster", "Found", "compile_graph", "did_you_mean", "explain", "load", "place", "plan",
           "pydantic_problems", "validate"]


def compile_graph(path: str | Path, cluster: Cluster | None = None) -> PlacedPlan:
    """The whole chain; ``cluster`` defaults to this machine."""
    return place(plan(validate(load(path))), cluster or Cluster.local())


# --- problems -------------------------------------------------------------------------


@dataclass
class Found:
    """Problems collected so far, each with the GraphError subclass it belongs to."""

    doc: GraphDoc
    items: list[tuple[type[GraphError], Problem]] = field(default_factory=list)

    def add(self, path: PathKey, message: str, hint: str = "", kind: type[GraphError] = GraphError,
            field_name: str | None = None) -> None:
        node, fld = _locate(self.doc, path)
        line = self.doc.line_of(path)
        self.items.append((kind, Problem(self.doc.file, line, node, field_name or fld, message, hint)))

    def raise_if_any(self) -> None:
        if not self.items:
            return
        kinds = {k for k, _ in self.items}
        kind = kinds.pop() if len(kinds) == 1 else GraphError
        raise kind(sorted({p for _, p in self.items}))


def _locate(doc: GraphDoc, path: PathKey) -> tuple[str, str]:
    """(node id, dotted field relative to the node) for a path into the document."""
    if len(path) >= 2 and path[0] == "nodes" and isinstance(path[1], int):
        node_id = doc.get(("nodes", path[1], "id"))
        if isinstance(node_id, str):
            return node_id, _dotted(path[2:])
    return "", _dotted(path)


def _dotted(path: Iterable[Any]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def did_you_mean(word: str, options: Iterable[str]) -> str:
    options = sorted(set(options))
    close = difflib.get_close_matches(word, options, n=3, cutoff=0.6)
    if close:
        return "did you mean " + " or ".join(f"'{c}'" for c in close) + "?"
    return "expected one of: " + ", ".join(options)


def _short(value: Any, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def type_name(t: pa.DataType) -> str:
    """``list<float>`` rather than pyarrow's ``list<item: float>``."""
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return f"list<{type_name(t.value_type)}>"
    return str(t)


def pydantic_problems(found: Found, err: ValidationError, base: PathKey,
                       model: type[BaseModel]) -> None:
    for e in err.errors():
        loc = tuple(e["loc"])
        path = base + loc
        kind = e["type"]
        if kind == "extra_forbidden":
            allowed = _fields_at(model, loc[:-1])
            found.add(path, f"unknown key '{loc[-1]}'", did_you_mean(str(loc[-1]), allowed))
        elif kind == "missing":
            found.add(path, "required field is missing")
        elif kind == "literal_error" and isinstance(e.get("input"), str):
            options = re.findall(r"'([^']*)'", str(e.get("ctx", {}).get("expected", "")))
            found.add(path, f"{e['msg']} (got {_short(e['input'])})",
                      did_you_mean(e["input"], options) if options else "")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            got = f" (got {_short(e['input'])})" if loc else ""
            found.add(path, msg + got)


def _fields_at(model: type[BaseModel], loc: PathKey) -> list[str]:
    """Field names of the Pydantic model found by walking ``loc`` from ``model``."""
    tp: Any = model
    for part in loc:
        tp = _unwrap(tp)
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            if part not in tp.model_fields:
                return []
            tp = tp.model_fields[part].annotation
        elif typing.get_origin(tp) in (list, tuple, dict):
            tp = typing.get_args(tp)[-1]
        else:
            return []
    tp = _unwrap(tp)
    return list(tp.model_fields) if isinstance(tp, type) and issubclass(tp, BaseModel) else []


def _unwrap(tp: Any) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else tp
    return tp


# --- validate -------------------------------------------------------------------------


@dataclass
class _Node:
    """What validate knows about one node; cls/params stay None when they were broken."""

    index: int
    spec: NodeSpec
    cls: type | None = None
    params: BaseModel | None = None

    @property
    def path(self) -> PathKey:
        return ("nodes", self.index)

    @property
    def id(self) -> str:
        return self.spec.id

    @property
    def cardinality(self) -> str | None:
        return getattr(self.cls, "CARDINALITY", None)


def validate(doc: GraphDoc) -> ValidGraph:
    """Check everything; raise one GraphError listing every problem, sorted by line."""
    found = Found(doc)
    spec: GraphSpec | None = None
    try:
        spec = GraphSpec.model_validate(doc.raw)
    except ValidationError as err:
        pydantic_problems(found, err, (), GraphSpec)
    nodes = _node_specs(doc, spec)
    for node in nodes or []:
        _check_op(found, node)
    models = doc.get(("models",))
    declared = set(models) if isinstance(models, dict) else set()
    if nodes is None:  # some node is unreadable: its edges are unknown, stop here
        found.raise_if_any()
        raise AssertionError("unreachable: GraphSpec failed without errors")
    _check_models(found, nodes, declared)
    graph = _check_edges(found, nodes)
    order: tuple[str, ...] = ()
    schemas: dict[str, _Rows] = {}
    if _check_cycles(found, nodes, graph):
        index = {n.id: n.index for n in nodes}
        topo = nx.lexicographical_topological_sort(graph, key=lambda n: index.get(n, -1))
        order = tuple(n for n in topo if n != PROMPTS_SOURCE)
        _check_training(found, nodes)
        schemas = _propagate(found, nodes, order)
        _check_group_filter(found, nodes, graph, schemas)
        _check_consistency(found, nodes, graph, order)
    found.raise_if_any()
    assert spec is not None
    by_id = {n.id: n for n in nodes}
    return ValidGraph(
        spec=spec,
        doc=doc,
        op_cls=MappingProxyType({n.id: n.cls for n in nodes}),
        params=MappingProxyType({n.id: n.params for n in nodes}),
        in_schema=MappingProxyType({i: schemas[i].in_schema for i in by_id}),
        out_schema=MappingProxyType({i: schemas[i].out_schema for i in by_id}),
        order=order,
    )


def _node_specs(doc: GraphDoc, spec: GraphSpec | None) -> list[_Node] | None:
    """Nodes that parse as NodeSpec (their errors are already reported by GraphSpec);
    None when any node does not, since then the graph's edges are unknown."""
    if spec is not None:
        return [_Node(i, n) for i, n in enumerate(spec.nodes)]
    raw = doc.get(("nodes",))
    if not isinstance(raw, list):
        return None
    try:
        return [_Node(i, NodeSpec.model_validate(item)) for i, item in enumerate(raw)]
    except ValidationError:
        return None


def _check_op(found: Found, node: _Node) -> None:
    """Resolve the node's operator class and validate its params."""
    s = node.spec
    if s.op == CUSTOM_OP:
        if s.impl is None:
            found.add(node.path + ("op",), "op 'custom' needs `impl:` naming the operator class",
                      "add `impl: package.module:Class` or `impl: path/to/file.py:Class`",
                      field_name="impl")
            return
        base_dir = Path(found.doc.file).parent
        try:
            cls = load_object(s.impl, base_dir=base_dir)
        except DapoFlowError as exc:
            found.add(node.path + ("impl",), f"cannot load impl: {exc}",
                      "check the class name; relative .py paths resolve against the graph's folder")
            return
        bad = contract_problems(cls) if isinstance(cls, type) else ["is not a class"]
        if bad:
            err = OperatorContractError(f"{s.impl} is not an operator: " + "; ".join(bad))
            found.add(node.path + ("impl",), f"{type(err).__name__}: {err}",
                      "see dapo_flow/contract.py for what an operator class provides")
            return
    elif s.op in OPERATORS:
        cls = OPERATORS[s.op]
        if s.impl is not None:
            found.add(node.path + ("impl",), f"`impl` is only for op: custom, and '{s.op}' is built in",
                      "remove `impl:`, or write `op: custom` to use your own class")
    else:
        found.add(node.path + ("op",), f"unknown op '{s.op}'",
                  did_you_mean(s.op, [*OPERATORS, CUSTOM_OP]), kind=UnknownOperatorError)
        return
    node.cls = cls
    try:
        node.params = cls.Params.model_validate(s.params)
    except ValidationError as err:
        pydantic_problems(found, err, node.path + ("params",), cls.Params)


def _check_models(found: Found, nodes: list[_Node], declared: set[str]) -> None:
    first: dict[str, int] = {}
    for node in nodes:
        if node.id == PROMPTS_SOURCE:
            found.add(node.path + ("id",), f"'{PROMPTS_SOURCE}' is the implicit source fed by data.train",
                      "give this node another id")
        if node.id in first:
            found.add(node.path + ("id",), f"duplicate node id '{node.id}' (first used on line "
                      f"{found.doc.line_of(('nodes', first[node.id]))})", "node ids must be unique")
        first.setdefault(node.id, node.index)
        model = node.spec.model
        if model is not None and model not in declared:
            found.add(node.path + ("model",), f"model '{model}' is not declared in `models:`",
                      did_you_mean(model, declared) if declared else "declare it under `models:`")
        if node.cls is None:
            continue
        needs = bool(getattr(node.cls, "NEEDS_MODEL", False))
        if needs and model is None:
            found.add(node.path, f"op '{node.spec.op}' runs a model but names none",
                      "add `model: NAME` with a name from `models:`", field_name="model")
        if not needs and model is not None:
            found.add(node.path + ("model",), f"op '{node.spec.op}' does not use a model",
                      "remove `model:`")
    placement = found.doc.get(("placement", "models"))
    for name in placement if isinstance(placement, dict) else ():
        if name not in declared:
            found.add(("placement", "models", name), f"model '{name}' is not declared in `models:`",
                      did_you_mean(str(name), declared) if declared else "")


def _check_edges(found: Found, nodes: list[_Node]) -> nx.DiGraph:
    """The graph of known edges; reports unknown inputs and reads from sinks."""
    by_id = {n.id: n for n in reversed(nodes)}  # first definition wins
    graph = nx.DiGraph()
    graph.add_node(PROMPTS_SOURCE)
    graph.add_nodes_from(by_id)
    for node in nodes:
        if by_id[node.id] is not node or node.id == PROMPTS_SOURCE:
            continue  # a duplicate or reserved id: reported, its edges would mislead
        for j, inp in enumerate(node.spec.inputs):
            path = node.path + ("inputs", j)
            if inp != PROMPTS_SOURCE and inp not in by_id:
                found.add(path, f"unknown input '{inp}'",
                          did_you_mean(inp, [PROMPTS_SOURCE, *by_id]), field_name="inputs")
                continue
            src = by_id.get(inp)
            if src is not None and src.cardinality == "sink":
                found.add(path, f"input '{inp}' is a sink (op '{src.spec.op}' emits only metrics); "
                          "nothing can read from it", "feed this node from the node before "
                          f"'{inp}'", field_name="inputs")
            graph.add_edge(inp, node.id)
        if not node.spec.inputs:
            found.add(node.path, "has no inputs, so no rows ever reach it",
                      f"add `inputs: [{PROMPTS_SOURCE}]` or the id of an upstream node",
                      field_name="inputs")
    return graph


def _check_cycles(found: Found, nodes: list[_Node], graph: nx.DiGraph) -> bool:
    """Report one cycle per strongly connected component; True when there is none."""
    index = {n.id: n.index for n in reversed(nodes)}
    ok = True
    for comp in nx.strongly_connected_components(graph):
        first = min(comp, key=lambda n: index.get(n, -1))
        if len(comp) == 1 and not graph.has_edge(first, first):
            continue
        ok = False
        cycle = nx.find_cycle(graph.subgraph(comp), source=first)
        ids = [u for u, _ in cycle] + [cycle[-1][1]]
        found.add(("nodes", index[first], "inputs"), "cycle: " + " -> ".join(ids),
                  "a step is a DAG: feed one of these nodes from an upstream node instead")
    return ok


def _check_training(found: Found, nodes: list[_Node]) -> None:
    """One update per model; updated models feed a generator; refs stay frozen."""
    if any(n.cls is None for n in nodes):
        return  # a typo'd op may be the update: don't guess
    updates: dict[str, _Node] = {}
    for node in nodes:
        if node.spec.op != "update":
            continue
        model = node.spec.model
        if model in updates:
            other = updates[model]
            found.add(node.path + ("model",), f"model '{model}' is already updated by node "
                      f"'{other.id}' (line {found.doc.line_of(other.path)})",
                      "one update per model and step: remove one, or train another model")
        elif model is not None:
            updates[model] = node
    if not updates and not any(n.spec.op == "update" for n in nodes):
        found.add(("nodes",), "a graph must train something: no node has op 'update'",
                  "add an `update` node fed by an `advantage` node", field_name="nodes")
    generated = {n.spec.model for n in nodes if n.spec.op == "generate"}
    for model, node in updates.items():
        if model not in generated:
            found.add(node.path + ("model",), f"model '{model}' is updated but no `generate` node "
                      "uses it, so the new weights never reach a rollout",
                      f"generate with `model: {model}`, or update the model you generate with")
    for node in nodes:
        if node.spec.op == "logprob" and getattr(node.params, "role", None) == "ref":
            model = node.spec.model
            if model in updates:
                found.add(node.path + ("model",), f"a reference model must stay frozen, but "
                          f"'{model}' is updated by node '{updates[model].id}'",
                          "declare a separate model (same path) for the reference and use it here")


@dataclass(frozen=True)
class _Rows:
    """Columns a node emits, who added each, and which node decided its rows."""

    in_schema: pa.Schema
    out_schema: pa.Schema
    source: dict[str, str]  # column -> node id that added it
    rows_from: str  # id of the nearest upstream node that changed the rows (or prompts)
    input_rows_from: str


def _propagate(found: Found, nodes: list[_Node], order: tuple[str, ...]) -> dict[str, _Rows]:
    """Arrow schemas along every edge, from `prompts` in topological order."""
    prompt = C.prompt_schema()
    src = {name: PROMPTS_SOURCE for name in prompt.names}
    rows: dict[str, _Rows] = {PROMPTS_SOURCE: _Rows(prompt, prompt, src, PROMPTS_SOURCE, "")}
    by_id = {n.id: n for n in reversed(nodes)}
    for nid in order:
        node = by_id[nid]
        inputs = node.spec.inputs
        if (node.params is None or not inputs or any(i not in rows for i in inputs)
                or any(by_id[i].cardinality == "sink" for i in inputs if i in by_id)):
            continue  # broken here or upstream: already reported, don't cascade
        origins = {i: rows[i].rows_from for i in inputs}
        if len(set(origins.values())) > 1:
            found.add(node.path + ("inputs",), "inputs carry different rows ("
                      + ", ".join(f"'{i}' rows come from '{o}'" for i, o in origins.items())
                      + "); several inputs are joined row by row",
                      "feed it from nodes that share their rows (chain the nodes instead)")
            continue
        cols: dict[str, pa.DataType] = {}
        source: dict[str, str] = {}
        for i in inputs:
            for f in rows[i].out_schema:
                if f.name in cols and cols[f.name] != f.type:
                    found.add(node.path + ("inputs",), f"inputs disagree on column '{f.name}': "
                              f"'{source[f.name]}' gives {type_name(cols[f.name])}, '{rows[i].source[f.name]}' "
                              f"gives {type_name(f.type)}", "make the producers agree on the type",
                              kind=SchemaError)
                cols.setdefault(f.name, f.type)
                source.setdefault(f.name, rows[i].source[f.name])
        try:
            node.params = resolve(node.cls, node.params, cols)
            needed, made = requires(node.cls, node.params), produces(node.cls, node.params)
        except Exception as exc:  # user code in a custom op's resolve()/requires()/produces()
            found.add(node.path + ("impl",), f"resolve()/requires()/produces() raised {exc!r}",
                      "make resolve return params and the others {column: pyarrow type}", kind=SchemaError)
            continue
        for name, typ in needed.items():
            if name not in cols:
                found.add(node.path + ("inputs",), f"requires column '{name}' ({type_name(typ)}) "
                          "but no upstream node produces it", _producer_hint(name), kind=SchemaError)
            elif cols[name] != typ:
                found.add(node.path + ("inputs",), f"requires column '{name}' as {type_name(typ)}, "
                          f"but '{source[name]}' gives {type_name(cols[name])}",
                          f"make '{source[name]}' produce {type_name(typ)}", kind=SchemaError)
        if node.cardinality == "sink":
            out, out_src = dict(made), {name: nid for name in made}
        else:
            out, out_src = dict(cols), dict(source)
            for name, typ in made.items():
                if name in out and out[name] != typ:
                    found.add(node.path + ("op",), f"produces column '{name}' as {type_name(typ)}, "
                              f"but '{source[name]}' already gives it as {type_name(out[name])}",
                              "rename the column or match its type", kind=SchemaError)
                out[name], out_src[name] = typ, nid
        rows_in = next(iter(origins.values()))
        rows_from = rows_in if node.cardinality == "map" else nid
        rows[nid] = _Rows(pa.schema(list(cols.items())), pa.schema(list(out.items())), out_src,
                          rows_from, rows_in)
    return rows


def _producer_hint(column: str) -> str:
    """Which built-in op (and which params) produces ``column``."""
    hints = []
    for op, cls in OPERATORS.items():
        for label, params in _param_variants(cls):
            if column in produces(cls, params):
                hints.append(f"op '{op}'" + (f" with {label}" if label else ""))
                break
    if not hints:
        return "no built-in op produces it: add a custom op that does"
    return f"add an upstream node that produces it: {' or '.join(hints)}"


def _param_variants(cls: type) -> Iterable[tuple[str, BaseModel]]:
    """Default params, then each Literal/bool field flipped to its other values."""
    try:
        yield "", cls.Params()
    except ValidationError:
        return
    for name, info in cls.Params.model_fields.items():
        ann = info.annotation
        values = typing.get_args(ann) if typing.get_origin(ann) is typing.Literal else (
            (True, False) if ann is bool else ())
        for value in values:
            try:
                yield f"{name}: {value}", cls.Params.model_validate({name: value})
            except ValidationError:
                continue


def _check_group_filter(found: Found, nodes: list[_Node], graph: nx.DiGraph,
                        rows: dict[str, _Rows]) -> None:
    """A group-filter must see whole prompt groups: straight from a generate, no row
    filter in between; and only one per graph (dynamic sampling repeats its upstream)."""
    gfs = [n for n in nodes if n.cardinality == "group-filter"]
    for extra in gfs[1:]:
        found.add(extra.path + ("op",), f"a second group-filter (the first is '{gfs[0].id}')",
                  "one group-filter per graph: dynamic sampling repeats everything upstream of it")
    by_id = {n.id: n for n in reversed(nodes)}
    for gf in gfs:
        if gf.id not in rows:
            continue
        origin = rows[gf.id].input_rows_from
        src = by_id.get(origin)
        if origin == PROMPTS_SOURCE:
            later = [d for d in nx.descendants(graph, gf.id) if by_id[d].spec.op == "generate"]
            after = f" ('{later[0]}' comes after it)" if later else ""
            found.add(gf.path + ("inputs",), "a group-filter needs whole prompt groups, but no "
                      f"`generate` node is upstream{after}",
                      "put the group-filter after the generate and score nodes")
        elif src is not None and src.cardinality == "filter":
            found.add(gf.path + ("inputs",), f"row filter '{origin}' sits between the generate "
                      "and this group-filter, so it sees partial prompt groups",
                      f"move '{origin}' after '{gf.id}'")


def _check_consistency(found: Found, nodes: list[_Node], graph: nx.DiGraph,
                       order: tuple[str, ...]) -> None:
    """Params that must agree with the generate node upstream."""
    by_id = {n.id: n for n in reversed(nodes)}
    position = {nid: k for k, nid in enumerate(order)}
    for node in nodes:
        if node.params is None or node.spec.op not in ("overlong-shape", "logprob", "update"):
            continue
        gens = [a for a in nx.ancestors(graph, node.id)
                if a in by_id and by_id[a].spec.op == "generate" and by_id[a].params is not None]
        if not gens:
            continue
        gen = by_id[max(gens, key=position.__getitem__)]
        gp = gen.params
        if node.spec.op == "overlong-shape" and node.params.max_len != gp.max_tokens:
            found.add(node.path + ("params", "max_len"), f"max_len {node.params.max_len} differs "
                      f"from max_tokens {gp.max_tokens} of generate '{gen.id}'",
                      f"set max_len: {gp.max_tokens} so the penalty interval ends at the "
                      "response limit")
        temp = getattr(node.params, "temperature", None)
        if node.spec.op != "overlong-shape" and gp.temperature > 0 and temp != gp.temperature:
            found.add(node.path + ("params", "temperature"), f"temperature {temp} differs from "
                      f"{gp.temperature} of generate '{gen.id}': logprobs would not match the "
                      "sampling distribution", f"set temperature: {gp.temperature}")


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
        return "driver"
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
        if out[n.id] != "driver" or n.cardinality != "map" or not n.inputs or not consumers[n.id]:
            continue
        around = {out.get(i, "driver") for i in (*n.inputs, *consumers[n.id])}
        if len(around) == 1 and next(iter(around)) != "driver":
            out[n.id] = next(iter(around))
    return out


def place(plan: Plan, cluster: Cluster) -> PlacedPlan:
    """CPU ops in the driver; one actor per model (two when disaggregated), with
    `placement.models` resources or a default that fits the cluster."""
    stage_of = {n.id: _stage_name(n, plan.spec.placement.mode) for n in plan.nodes}
    stage_of = _pull_into_actors(plan, stage_of)
    members: dict[str, list[str]] = {"driver": []}
    for node in plan.nodes:
        members.setdefault(stage_of[node.id], []).append(node.id)
    actors = [name for name in members if name != "driver"]
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
    driver = Stage("driver", "driver", tuple(members["driver"]), (), driver_cpus, 0.0)
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
    out += ["", f"step ({run.steps} steps, {run.prompts_per_step} prompt groups each):",
            f"  prompts: {train.source} [{train.split}], {gen_batch} per generation batch",
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
