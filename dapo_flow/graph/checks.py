"""validate: every check of a loaded graph, all problems collected before raising once.

Pydantic errors of every section, each node's params against its operator's ``Params``, wiring
(unknown inputs, cycles, unreachable nodes), model rules (one update per model, frozen refs) and
Arrow column types propagated from `prompts` along every edge (operators may ``resolve`` params
against the columns that reach them).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Iterable, Mapping

import networkx as nx
import pyarrow as pa
from pydantic import BaseModel, ValidationError

from dapo_flow.core import columns as C
from dapo_flow.core.contract import (contract_of, contract_problems, logprob_role_of, node_model, produces, requires,
                                     resolve, role, model_head, sampling_of, upstream_problems, uses_model)
from dapo_flow.errors import DapoFlowError, OperatorContractError, SchemaError, UnknownOperatorError
from dapo_flow.core.imports import load_object
from dapo_flow.graph.data_checks import gym_problems, verifiers_problems
from dapo_flow.graph.loader import GraphDoc, PathKey
from dapo_flow.graph.plan import ValidGraph
from dapo_flow.graph.problems import COLUMN_TYPE, MISSING_COLUMN, Found, did_you_mean, pydantic_problems, type_name
from dapo_flow.graph.registry import CUSTOM_OP, Registries
from dapo_flow.graph.spec import BACKENDS_CONTEXT, PROMPTS_SOURCE, GraphSpec, NodeSpec, TrainSpec


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
        return contract_of(self.cls).cardinality if self.cls is not None else None

    @property
    def model(self) -> str | None:
        """Its `model:`, else the model its params name (contract.node_model)."""
        return node_model(self.cls, self.spec.model, self.params)

    @property
    def model_path(self) -> PathKey:
        """Where its model is named: its `model:`, else its op's ``MODEL_PARAM`` in params."""
        if self.spec.model is not None:
            return self.path + ("model",)
        return self.path + ("params", *contract_of(self.cls).model_param)


def validate(doc: GraphDoc, registries: Registries | None = None) -> ValidGraph:
    """Check everything; raise one GraphError listing every problem, sorted by line.
    ``registries``: what the graph's op and backend names mean (default: the built-ins and
    loaded plugins)."""
    registries = registries or Registries()
    operators = registries.operators
    found = Found(doc)
    spec: GraphSpec | None = None
    try:
        spec = GraphSpec.model_validate(doc.raw, context={BACKENDS_CONTEXT: registries.backends})
    except ValidationError as err:
        pydantic_problems(found, err, (), GraphSpec)
    nodes = _node_specs(doc, spec)
    for node in nodes or []:
        _check_op(found, node, operators)
    models = doc.get(("models",))
    declared = set(models) if isinstance(models, dict) else set()
    if nodes is None:  # some node is unreadable: its edges are unknown, stop here
        found.raise_if_any()
        raise AssertionError("unreachable: GraphSpec failed without errors")
    _check_models(found, nodes, declared)
    heads = {name: m.resolved_head for name, m in spec.models.items()} if spec is not None else {}
    _check_heads(found, nodes, heads)
    graph = _check_edges(found, nodes)
    order: tuple[str, ...] = ()
    schemas: dict[str, _Rows] = {}
    if _check_cycles(found, nodes, graph):
        index = {n.id: n.index for n in nodes}
        topo = nx.lexicographical_topological_sort(graph, key=lambda n: index.get(n, -1))
        order = tuple(n for n in topo if n != PROMPTS_SOURCE)
        lora = {name for name, m in spec.models.items() if m.train.lora is not None} if spec is not None else set()
        _check_lora_heads(found, lora, heads)
        _check_training(found, nodes, {m for m, h in heads.items() if h == "value"}, lora)
        trains = {name: m.train for name, m in spec.models.items()} if spec is not None else {}
        schemas = _propagate(found, nodes, order, operators, trains, graph)
        _check_rollout_records(found, nodes, trains, operators)
        _check_group_filter(found, nodes, graph, schemas)
        _check_greedy_groups(found, nodes, graph)
        _check_consistency(found, nodes, graph, order)
        if spec is not None:
            _check_model_support(found, nodes, spec)
        if spec is not None:
            _check_tokenizers(found, nodes, graph, order, spec)
    if spec is not None:
        _check_prompt_budget(found, nodes, spec)
        for path, message, fix in gym_problems(spec.data, spec.seed) + verifiers_problems(spec.data):
            found.add(path, message, fix)
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
        backends=MappingProxyType({name: registries.backends[m.backend] for name, m in spec.models.items()}),
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


def _check_op(found: Found, node: _Node, operators: Mapping[str, type]) -> None:
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
        if not bad:  # a column declared under a setting no model has would never come
            bad = [f"`PRODUCES_WITH_TRAIN` names train.{name}, which is not a model setting "
                   f"({did_you_mean(name, TrainSpec.model_fields)})"
                   for name in contract_of(cls).produces_with_train if name not in TrainSpec.model_fields]
        if bad:
            err = OperatorContractError(f"{s.impl} is not an operator: " + "; ".join(bad))
            found.add(node.path + ("impl",), f"{type(err).__name__}: {err}",
                      "see dapo_flow/core/contract.py for what an operator class provides")
            return
    elif s.op in operators:
        cls = operators[s.op]
        if s.impl is not None:
            found.add(node.path + ("impl",), f"`impl` is only for op: custom, and '{s.op}' is built in",
                      "remove `impl:`, or write `op: custom` to use your own class")
    else:
        found.add(node.path + ("op",), f"unknown op '{s.op}'",
                  did_you_mean(s.op, [*operators, CUSTOM_OP]), kind=UnknownOperatorError)
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
        model = node.model
        if model is not None and model not in declared:
            found.add(node.model_path, f"model '{model}' is not declared in `models:`",
                      did_you_mean(model, declared) if declared else "declare it under `models:`")
        if node.cls is None:
            continue
        needs = contract_of(node.cls).needs_model
        if needs and model is None and (node.params is None or uses_model(node.cls, node.params)):
            found.add(node.path, f"op '{node.spec.op}' runs a model but names none",
                      "add `model: NAME` with a name from `models:`", field_name="model")
        if not needs and model is not None:
            found.add(node.path + ("model",), f"op '{node.spec.op}' does not use a model",
                      "remove `model:`")
        elif (node.spec.model is not None and contract_of(node.cls).model_param
              and node.params is not None and not uses_model(node.cls, node.params)):
            found.add(node.path + ("model",), f"op '{node.spec.op}' does not use a model with these params",
                      f"remove `model:` (this op names its model in the params: "
                      f"`{'.'.join(contract_of(node.cls).model_param)}`)")
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


#: what each model head is, in messages
HEAD_WORDS = {"lm": "a causal LM (it generates and gives token logprobs)",
              "value": "a value model (a critic: one value per token)",
              "reward": "a reward model (one score per response)"}


def _check_heads(found: Found, nodes: list[_Node], heads: dict[str, str]) -> None:
    """Each node's model is what its operator works on (``MODEL_HEAD``, default `lm`): a critic's
    nodes (`values`, `critic-update`) need a value model, every other model op a causal LM."""
    for node in nodes:
        model = node.model
        if (node.cls is None or model not in heads or not contract_of(node.cls).needs_model
                or (node.params is not None and not uses_model(node.cls, node.params))):
            continue
        wanted = model_head(node.cls, node.params)
        if heads[model] == wanted:
            continue
        if wanted == "reward":
            fix = ("declare a reward model under `models:` (e.g. `rm: {path: builtin:tiny-adder-rm}`, or "
                   "a sequence classifier's directory) and name it in `reward: {model: NAME}`")
            if heads[model] == "lm":
                fix += (", or score with this causal LM's likelihood of each response (a generative "
                        "verifier or a teacher): `reward: {model: " + model + ", output: likelihood}`")
        elif contract_of(node.cls).model_param:  # score with output: likelihood
            fix = (f"`output: likelihood` scores with a causal LM (e.g. `verifier: {{path: "
                   f"builtin:tiny-adder-judge}}`); a reward model such as '{model}' scores with "
                   f"`output: logit` or `output: probability`")
        elif wanted == "value":
            fix = ("declare a critic under `models:` with `head: value` (e.g. `critic: {path: "
                   "builtin:tiny-adder-critic}`, or your policy's path with `head: value`) and name it here")
        else:
            fix = f"name a causal-LM model here (the policy or a reference), not the critic '{model}'"
        found.add(node.model_path, f"op '{node.spec.op}' needs {HEAD_WORDS[wanted]}, but model "
                  f"'{model}' is {HEAD_WORDS[heads[model]]}", fix)


def _check_lora_heads(found: Found, lora: set[str], heads: dict[str, str]) -> None:
    """`train.lora` only on a causal LM: a value or reward model's new head must train in full."""
    for name in sorted(lora):
        if heads.get(name, "lm") != "lm":
            found.add(("models", name, "train", "lora"), f"model '{name}' has a {heads[name]} head, "
                      "which LoRA adapters cannot train (the new head must train in full)",
                      f"train '{name}' without train.lora")


def _check_training(found: Found, nodes: list[_Node], value_models: set[str], lora: set[str]) -> None:
    """One trainer per model; trained models feed a generator (a critic's values feed the
    advantages instead); refs and teachers stay frozen."""
    if any(n.cls is None for n in nodes):
        return  # a typo'd op may be the update: don't guess
    updates: dict[str, _Node] = {}
    for node in nodes:
        if role(node.cls) != "train":
            continue
        model = node.spec.model
        if model in updates:
            other = updates[model]
            found.add(node.path + ("model",), f"model '{model}' is already updated by node "
                      f"'{other.id}' (line {found.doc.line_of(other.path)})",
                      "one update per model and step: remove one, or train another model")
        elif model is not None:
            updates[model] = node
    if not updates and not any(role(n.cls) == "train" for n in nodes):
        found.add(("nodes",), "a graph must train something: no node has op 'update'",
                  "add an `update` node fed by an `advantage` node", field_name="nodes")
    generated = {n.spec.model for n in nodes if role(n.cls) == "generate"}
    for model, node in updates.items():
        if model not in generated and model not in value_models:
            found.add(node.path + ("model",), f"model '{model}' is updated but no `generate` node "
                      "uses it, so the new weights never reach a rollout",
                      f"generate with `model: {model}`, or update the model you generate with")
    for node in nodes:
        if role(node.cls) != "logprob" or node.params is None:
            continue
        whose, model = logprob_role_of(node.cls, node.params), node.spec.model
        if whose == "teacher" and model in updates:  # its logprobs are the target the student moves towards
            found.add(node.path + ("model",), f"a teacher must stay frozen, but '{model}' is updated "
                      f"by node '{updates[model].id}'",
                      "declare the teacher as a model of its own under `models:` (no update node trains "
                      "it) and name it here")
        elif whose == "ref" and model in updates and model not in lora:  # under LoRA the reference is the base
            found.add(node.path + ("model",), f"a reference model must stay frozen, but "
                      f"'{model}' is updated by node '{updates[model].id}'",
                      "declare a separate model (same path) for the reference and use it here, or "
                      f"train '{model}' with train.lora (the reference is then its base, adapters off)")


@dataclass(frozen=True)
class _Rows:
    """Columns a node emits, who added each, and which node decided its rows."""

    in_schema: pa.Schema
    out_schema: pa.Schema
    source: dict[str, str]  # column -> node id that added it
    rows_from: str  # id of the nearest upstream node that changed the rows (or prompts)
    input_rows_from: str


def _propagate(found: Found, nodes: list[_Node], order: tuple[str, ...], operators: Mapping[str, type],
               trains: Mapping[str, TrainSpec], graph: nx.DiGraph) -> dict[str, _Rows]:
    """Arrow schemas along every edge, from `prompts` in topological order. ``trains``: each
    model's ``train`` section, whose settings add columns to the nodes that run on it
    (``PRODUCES_WITH_TRAIN``: a generate node's ``routed_experts`` under routing replay)."""
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
        if contract_of(node.cls).combine:  # joins its inputs itself, by key
            _propagate_join(found, node, rows, operators)
            continue
        origins = {i: rows[i].rows_from for i in inputs}
        if len(set(origins.values())) > 1:
            found.add(node.path + ("inputs",), "inputs carry different rows ("
                      + ", ".join(f"'{i}' rows come from '{o}'" for i, o in origins.items())
                      + "); several inputs are joined row by row",
                      "feed it from nodes that share their rows (chain the nodes instead)")
            continue
        cols, source = _merged_inputs(found, node, rows)
        try:
            node.params = resolve(node.cls, node.params, cols)
            needed = requires(node.cls, node.params)
            made = produces(node.cls, node.params, trains.get(node.model))
        except Exception as exc:  # user code in a custom op's resolve()/requires()/produces()
            found.add(node.path + ("impl",), f"resolve()/requires()/produces() raised {exc!r}",
                      "make resolve return params and the others {column: pyarrow type}", kind=SchemaError)
            continue
        _check_required(found, node, needed, cols, source, operators,
                        _setting_hints(node, needed, cols, by_id, graph, trains))
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


def _merged_inputs(found: Found, node: _Node,
                   rows: dict[str, _Rows]) -> tuple[dict[str, pa.DataType], dict[str, str]]:
    """The columns a node's inputs bring, merged row by row (the first input's type where two
    disagree, which is reported), and the node each column comes from."""
    cols: dict[str, pa.DataType] = {}
    source: dict[str, str] = {}
    for i in node.spec.inputs:
        for f in rows[i].out_schema:
            if f.name in cols and cols[f.name] != f.type:
                found.add(node.path + ("inputs",), f"inputs disagree on column '{f.name}': "
                          f"'{source[f.name]}' gives {type_name(cols[f.name])}, '{rows[i].source[f.name]}' "
                          f"gives {type_name(f.type)}", "make the producers agree on the type",
                          kind=SchemaError)
            cols.setdefault(f.name, f.type)
            source.setdefault(f.name, rows[i].source[f.name])
    return cols, source


def _check_required(found: Found, node: _Node, needed: Mapping[str, pa.DataType], cols: Mapping[str, pa.DataType],
                    source: Mapping[str, str], operators: Mapping[str, type],
                    setting_hints: Mapping[str, str] | None = None) -> None:
    """Report each column the node requires that its inputs lack or bring as another type
    (``setting_hints``: for a missing column, the model setting that would make an upstream node add it)."""
    for name, typ in needed.items():
        if name not in cols:
            hint = (setting_hints or {}).get(name) or _producer_hint(name, operators)
            found.add(node.path + ("inputs",), f"requires column '{name}' ({type_name(typ)}) "
                      "but no upstream node produces it", hint, kind=SchemaError,
                      code=MISSING_COLUMN, column=name)
        elif cols[name] != typ:
            found.add(node.path + ("inputs",), f"requires column '{name}' as {type_name(typ)}, "
                      f"but '{source[name]}' gives {type_name(cols[name])}",
                      f"make '{source[name]}' produce {type_name(typ)}", kind=SchemaError,
                      code=COLUMN_TYPE, column=name)


def _propagate_join(found: Found, node: _Node, rows: dict[str, _Rows], operators: Mapping[str, type]) -> None:
    """A node that combines its inputs itself (``combine``: e.g. `baseline` joins by prompt id):
    each input must bring its own columns (``input_requires``); the rows and columns going on
    are the first input's, plus what the node produces."""
    inputs = node.spec.inputs
    wanted = contract_of(node.cls).input_requires(node.params)
    if len(inputs) != len(wanted):
        found.add(node.path + ("inputs",), f"op '{node.spec.op}' takes {len(wanted)} inputs, got "
                  f"{len(inputs)}", f"inputs: {contract_of(node.cls).inputs_hint or 'see `dapo-flow ops`'}")
        return
    for nth, (i, need) in enumerate(zip(inputs, wanted)):
        schema = rows[i].out_schema
        for name, typ in need.items():
            if name not in schema.names:
                found.add(node.path + ("inputs", nth), f"input '{i}' lacks column '{name}' "
                          f"({type_name(typ)})", _producer_hint(name, operators), kind=SchemaError)
            elif schema.field(name).type != typ:
                found.add(node.path + ("inputs", nth), f"input '{i}' gives column '{name}' as "
                          f"{type_name(schema.field(name).type)}, not {type_name(typ)}",
                          f"make '{rows[i].source[name]}' produce {type_name(typ)}", kind=SchemaError)
    first = rows[inputs[0]]
    out, out_src = dict(zip(first.out_schema.names, first.out_schema.types)), dict(first.source)
    for name, typ in produces(node.cls, node.params).items():
        out[name], out_src[name] = typ, node.id
    rows[node.id] = _Rows(first.out_schema, pa.schema(list(out.items())), out_src, first.rows_from,
                          first.rows_from)


def _setting_hints(node: _Node, needed: Mapping[str, pa.DataType], cols: Mapping[str, pa.DataType],
                   by_id: Mapping[str, _Node], graph: nx.DiGraph, trains: Mapping[str, TrainSpec]) -> dict[str, str]:
    """For each column ``node`` needs and does not get that an upstream node would add with a
    setting of its model on (``PRODUCES_WITH_TRAIN``), the fix naming that setting."""
    missing = [name for name in needed if name not in cols]
    if not missing:
        return {}
    hints: dict[str, str] = {}
    ancestors = sorted((by_id[a] for a in nx.ancestors(graph, node.id) if a in by_id), key=lambda n: n.index)
    for up in ancestors:
        if up.cls is None or up.params is None or up.model not in trains:
            continue
        for setting, columns in contract_of(up.cls).produces_with_train.items():
            for name in missing:
                if name in columns and name not in hints:
                    hints[name] = (f"turn on `train.{setting}` of model '{up.model}' (models.{up.model}.train."
                                   f"{setting}: true): node '{up.id}' then adds '{name}'")
    return hints


def _check_rollout_records(found: Found, nodes: list[_Node], trains: Mapping[str, TrainSpec],
                           operators: Mapping[str, type]) -> None:
    """A model trained with routing replay replays the experts its rollout chose, so each node
    generating with it must record them (declare ``routed_experts`` under ``routing_replay`` in
    ``PRODUCES_WITH_TRAIN``, as `generate` and `agent-generate` do); a harness rollout records
    none (its endpoint's clients never see the experts)."""
    recorders = [op for op, cls in operators.items()
                 if C.ROUTED_EXPERTS in contract_of(cls).produces_with_train.get("routing_replay", {})]
    for node in nodes:
        train = trains.get(node.model)
        if (node.cls is None or node.params is None or role(node.cls) != "generate" or train is None
                or not train.routing_replay):
            continue
        if C.ROUTED_EXPERTS in produces(node.cls, node.params, train):
            continue
        ops = " or ".join(f"op '{op}'" for op in recorders) or "an op that records them"
        found.add(node.path + ("op",), f"op '{node.spec.op}' records no expert routes (column "
                  f"'{C.ROUTED_EXPERTS}'), but its model '{node.model}' trains with train.routing_replay, "
                  "which replays the experts the rollout chose for each token",
                  f"set models.{node.model}.train.routing_replay: false, or roll out with {ops}")


def _producer_hint(column: str, operators: Mapping[str, type]) -> str:
    """Which registered op (and which params) produces ``column``."""
    hints = []
    for op, cls in operators.items():
        for label, params in _param_variants(cls):
            if column in produces(cls, params):
                hints.append(f"op '{op}'" + (f" with {label}" if label else ""))
                break
        else:
            hints += [f"op '{op}' on a model with train.{setting}: true"
                      for setting, columns in contract_of(cls).produces_with_train.items() if column in columns]
    if not hints:
        return "no registered op produces it: add a custom op that does"
    return f"add an upstream node that produces it: {' or '.join(hints)}"


def _param_variants(cls: type) -> Iterable[tuple[str, BaseModel]]:
    """Default params, then each Literal/bool field flipped to its other values, then the
    op's ``PARAM_EXAMPLES`` (settings of several fields at once that turn a column on)."""
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
    for example in getattr(cls, "PARAM_EXAMPLES", ()):
        try:
            yield ", ".join(f"{k}: {v}" for k, v in example.items()), cls.Params.model_validate(example)
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
            later = [d for d in nx.descendants(graph, gf.id) if role(by_id[d].cls) == "generate"]
            after = f" ('{later[0]}' comes after it)" if later else ""
            found.add(gf.path + ("inputs",), "a group-filter needs whole prompt groups, but no "
                      f"`generate` node is upstream{after}",
                      "put the group-filter after the generate and score nodes")
        elif src is not None and src.cardinality == "filter":
            found.add(gf.path + ("inputs",), f"row filter '{origin}' sits between the generate "
                      "and this group-filter, so it sees partial prompt groups",
                      f"move '{origin}' after '{gf.id}'")


def _greedy_groups(node: _Node) -> bool:
    """Whether a generate node samples n >= 2 identical responses per prompt."""
    sampling = sampling_of(node.cls, node.params)
    return isinstance(sampling.n, int) and sampling.n >= 2 and sampling.greedy


def _check_greedy_groups(found: Found, nodes: list[_Node], graph: nx.DiGraph) -> None:
    """Greedy sampling (temperature 0 or top_k 1) gives all n samples of a prompt the same
    response, so every group has zero spread: a group-filter keeps none of them and a
    group-relative advantage is 0 for every sample. Either way no step trains anything."""
    by_id = {n.id: n for n in reversed(nodes)}
    for gen in nodes:
        p = gen.params
        if role(gen.cls) != "generate" or p is None or not _greedy_groups(gen):
            continue
        after = [by_id[d] for d in nx.descendants(graph, gen.id) if d in by_id]
        gf = next((n for n in after if n.cardinality == "group-filter"), None)
        adv = min((n for n in after if role(n.cls) == "advantage"), key=lambda n: n.index, default=None)
        if gf is not None:
            effect = f"group-filter '{gf.id}' (line {found.doc.line_of(gf.path)}) drops every group"
        elif adv is not None:
            effect = f"advantage '{adv.id}' (line {found.doc.line_of(adv.path)}) is 0 for every sample"
        else:
            continue
        field = "temperature" if p.temperature == 0 else "top_k"
        what = "temperature 0" if field == "temperature" else "top_k 1"
        found.add(gen.path + ("params", field), f"{what} samples greedily, so all n={p.n} responses "
                  f"to a prompt are the same and {effect}: no step would train anything",
                  "sample with temperature > 0 (DAPO: 1.0) and top_k -1")


def _check_consistency(found: Found, nodes: list[_Node], graph: nx.DiGraph,
                       order: tuple[str, ...]) -> None:
    """Params that must agree with the nearest generator upstream (each operator says which:
    ``upstream_problems``)."""
    nearest = _nearest_generator(nodes, graph, order)
    for node in nodes:
        if node.params is None or not contract_of(node.cls).upstream_problems:
            continue
        gen = nearest(node.id, with_params=True)
        if gen is None:
            continue
        for field_name, message, fix in upstream_problems(node.cls, node.params, gen.id, gen.params):
            found.add(node.path + ("params", field_name), message, fix)


def _check_model_support(found: Found, nodes: list[_Node], spec: GraphSpec) -> None:
    """Params the node's model must support, as its config.json says (each operator says which:
    ``model_problems``); a model whose config cannot be read yet is checked when it loads."""
    from dapo_flow.models import model_config

    for node in nodes:
        hook = contract_of(node.cls).model_problems if node.cls is not None else None
        model = node.spec.model
        if node.params is None or hook is None or model not in spec.models:
            continue
        config = model_config(spec.models[model].path)
        if config is None:
            continue
        for field_name, message, fix in hook(node.params, config):
            found.add(node.path + ("params", field_name), message, fix)


def _nearest_generator(nodes: list[_Node], graph: nx.DiGraph, order: tuple[str, ...]):
    """``nearest(node_id, with_params=False)``: the node's nearest `generate`-role ancestor (the
    latest in ``order``; ``with_params``: among those whose params validated), or None."""
    by_id = {n.id: n for n in reversed(nodes)}
    position = {nid: k for k, nid in enumerate(order)}

    def nearest(node_id: str, with_params: bool = False) -> _Node | None:
        gens = [by_id[a] for a in nx.ancestors(graph, node_id) if a in by_id and role(by_id[a].cls) == "generate"
                and (by_id[a].params is not None or not with_params)]
        return max(gens, key=lambda g: position[g.id]) if gens else None

    return nearest


def _check_tokenizers(found: Found, nodes: list[_Node], graph: nx.DiGraph, order: tuple[str, ...],
                      spec: GraphSpec) -> None:
    """A model that reads the rows another model generated (a reference, a teacher, a critic, a
    reward model, a judge) reads that model's token ids as they are, so it must share its tokenizer: checked
    where both tokenizers can be read without loading anything (``models.reads_tokens_of``)."""
    from dapo_flow.models import reads_tokens_of  # light: json only

    nearest = _nearest_generator(nodes, graph, order)
    for node in nodes:
        model = node.model
        if (model not in spec.models or node.params is None or role(node.cls) == "generate"
                or not uses_model(node.cls, node.params)):
            continue
        gen = nearest(node.id)
        writer = gen.model if gen is not None else None
        if writer is None or writer == model or writer not in spec.models:
            continue
        if reads_tokens_of(spec.models[model].path, spec.models[writer].path) is False:
            found.add(node.model_path, f"model '{model}' does not share the tokenizer of '{writer}', which "
                      f"generated the rows it reads: it would read their token ids as tokens of its own",
                      f"use a '{model}' with '{writer}''s tokenizer (e.g. one trained from it), or generate "
                      f"with a model of '{model}''s tokenizer")


def _check_prompt_budget(found: Found, nodes: list[_Node], spec: GraphSpec) -> None:
    """No row longer than a model's context: a declared prompt budget plus a generate node's
    max_tokens must fit its model's context (max_position_embeddings, read where there is a
    config.json to read; ``graph.prompt_room``)."""
    from dapo_flow.graph.prompt_room import budget_problems, rooms

    generators = [n for n in nodes if n.params is not None and role(n.cls) == "generate"]
    index = {n.id: n.index for n in generators}
    found_rooms = rooms(((n.id, n.model, sampling_of(n.cls, n.params).max_tokens) for n in generators), spec.models)
    for path, message, fix in budget_problems(spec.data, found_rooms):
        if path[0] == "nodes":  # budget_problems names the node; the document numbers it
            path = ("nodes", index[path[1]], *path[2:])
        found.add(path, message, fix)
