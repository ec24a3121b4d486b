"""Ablations as edits of a graph: ``--set``, ``--drop``, ``--swap``, ``--insert``.

An edit is a frozen dataclass, parsed from a CLI flag (``parse_cli_edit("set", "train.lr=5e-4")``)
or from a patch-file entry (``dapo_flow.experiments.sweep``). ``apply_edits(doc, edits)`` is pure: it
deep-copies the document, applies the edits in order and keeps the line of every untouched
key. Each key an edit writes gets the marker line ``-1 - k`` (k: the edit's index), so
``compile_edited`` can point any problem the compiler finds there at the edit itself::

    <--set train.lr>: node 'train' params.lr: Input should be greater than 0 (got -1.0)

Paths of ``--set``: the first key names a section when it is a GraphSpec field (``run.steps``,
``models.policy.backend``, ``seed``), else a node id. After the node id, ``op``, ``inputs``,
``model`` and ``impl`` are the node's own fields, ``params.X`` is explicit and anything else
is a param (``train.lr`` == ``train.params.lr``). VALUE is YAML (``null``, ``[a, b]``, ``1e-3``).

Wiring: ``--drop N`` gives N's consumers N's inputs instead (deduplicated, order kept);
``--insert NEW:OP:after=N`` puts NEW between N and N's consumers; ``--swap N=OP`` changes the
op and keeps id, wiring and the params the new op also has.
"""

from __future__ import annotations

import copy
import re
import shlex
from dataclasses import dataclass, field
from dataclasses import replace as dc_replace
from pathlib import Path
from typing import Any, Iterable, Mapping, Union

from ruamel.yaml import YAML
from ruamel.yaml.error import YAMLError

from dapo_flow.graph.compiler import place, plan, validate
from dapo_flow.core.contract import contract_of, node_model, uses_model
from dapo_flow.graph.problems import MISSING_COLUMN, did_you_mean
from dapo_flow.errors import GraphError, Problem
from dapo_flow.graph.loader import GraphDoc, PathKey, load
from dapo_flow.graph.plan import Cluster, PlacedPlan
from dapo_flow.graph.registry import CUSTOM_OP, Registries
from dapo_flow.graph.spec import ID_PATTERN, PROMPTS_SOURCE, GraphSpec

SECTIONS = tuple(f for f in GraphSpec.model_fields if f != "nodes")
NODE_FIELDS = ("op", "inputs", "model", "impl", "params")  # `id` is not editable by --set
FLAGS = ("set", "drop", "swap", "insert")
USAGE = {
    "set": "--set NODE.PARAM=VALUE or --set SECTION.KEY=VALUE (e.g. train.lr=5e-4, run.steps=5)",
    "drop": "--drop NODE",
    "swap": "--swap NODE=OP",
    "insert": "--insert NEW_ID:OP:after=NODE[:model=MODEL]",
}


@dataclass(frozen=True)
class Origin:
    """Where an edit was written: a patch file and line, or a label like ``<--steps 2>``."""

    file: str
    line: int = 0


@dataclass(frozen=True)
class SetEdit:
    path: tuple[str, ...]
    value: Any
    origin: Origin | None = field(default=None, compare=False)

    def cli(self) -> str:
        return "--set " + shlex.quote(f"{'.'.join(self.path)}={flow(self.value)}")

    def label(self) -> str:
        return f"--set {'.'.join(self.path)}"


@dataclass(frozen=True)
class DropEdit:
    node: str
    origin: Origin | None = field(default=None, compare=False)

    def cli(self) -> str:
        return f"--drop {self.node}"

    label = cli


@dataclass(frozen=True)
class SwapEdit:
    node: str
    op: str
    origin: Origin | None = field(default=None, compare=False)

    def cli(self) -> str:
        return f"--swap {self.node}={self.op}"

    label = cli


@dataclass(frozen=True)
class InsertEdit:
    new_id: str
    op: str
    after: str
    params: Mapping[str, Any] = field(default_factory=dict)
    model: str | None = None
    origin: Origin | None = field(default=None, compare=False)
    impl: str | None = None  # op: custom

    def cli(self) -> str:
        """The equivalent flags: --insert NEW:OP:after=NODE, then one --set per param."""
        text = self.label() + (f":model={self.model}" if self.model else "")
        if self.impl:
            text += " --set " + shlex.quote(f"{self.new_id}.impl={self.impl}")
        for key, value in self.params.items():
            param = f"params.{key}" if key in NODE_FIELDS or key == "id" else key
            text += " --set " + shlex.quote(f"{self.new_id}.{param}={flow(value)}")
        return text

    def label(self) -> str:
        return f"--insert {self.new_id}:{self.op}:after={self.after}"


Edit = Union[SetEdit, DropEdit, SwapEdit, InsertEdit]


def flow(value: Any) -> str:
    """A value as a one-line YAML flow string (what ``--set`` would parse back)."""
    import io

    yaml = YAML(typ="safe", pure=True)
    yaml.default_flow_style = True
    yaml.width = 1 << 16
    buf = io.StringIO()
    yaml.dump(value, buf)
    return buf.getvalue().strip().removesuffix("...").strip()


def where(edit: Edit) -> Origin:
    return edit.origin or Origin(f"<{edit.label()}>")


# --- parsing ----------------------------------------------------------------------------


class _EditProblem(Exception):
    """Raised inside the edit functions; becomes a Problem located at the edit."""

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.message, self.hint = message, hint


def _problem(origin: Origin, message: str, hint: str = "") -> Problem:
    return Problem(origin.file, origin.line, "", "", message, hint)


def parse_cli_edit(flag: str, text: str, origin: Origin | None = None) -> Edit:
    """One edit from a flag (set, drop, swap, insert) and its argument; GraphError if malformed."""
    flag = flag.lstrip("-")
    if flag not in FLAGS:
        raise GraphError([_problem(origin or Origin(f"<--{flag}>"), f"unknown edit '--{flag}'",
                                   did_you_mean(flag, FLAGS))])
    try:
        return _PARSERS[flag](text.strip(), origin)
    except _EditProblem as p:
        where_ = origin or Origin(f"<--{flag} {text}>")
        raise GraphError([_problem(where_, p.message, p.hint or f"write {USAGE[flag]}")]) from None


def parse_cli_edits(pairs: Iterable[tuple[str, str]]) -> list[Edit]:
    """Edits from (flag, argument) pairs in the order given, every malformed one reported."""
    edits, problems = [], []
    for flag, text in pairs:
        try:
            edits.append(parse_cli_edit(flag, text))
        except GraphError as err:
            problems += err.problems
    if problems:
        raise GraphError(problems)
    return edits


def parse_edit_string(text: str, origin: Origin | None = None) -> list[Edit]:
    """Edits written as CLI flags in one string: ``"--set run.steps=3 --drop overlong"``."""
    where_ = origin or Origin(f"<{text}>")
    try:
        tokens = shlex.split(text)
    except ValueError as exc:
        raise GraphError([_problem(where_, f"cannot split {text!r}: {exc}", "balance the quotes")]) from None
    edits, i = [], 0
    while i < len(tokens):
        tok = tokens[i]
        flag, eq, arg = tok.partition("=") if tok.startswith("--") else (tok, "", "")
        name = flag.removeprefix("--")
        if not tok.startswith("--") or name not in FLAGS:
            raise GraphError([_problem(where_, f"expected an edit flag, got {tok!r}",
                                       did_you_mean(name, FLAGS) + " (written --set, --drop, ...)")])
        if not eq:
            if i + 1 >= len(tokens):
                raise GraphError([_problem(where_, f"{flag} needs an argument", f"write {USAGE[name]}")])
            i, arg = i + 1, tokens[i + 1]
        edits.append(parse_cli_edit(name, arg, origin))
        i += 1
    return edits


def parse_value(text: str) -> Any:
    """A --set VALUE: a YAML scalar or flow collection."""
    if text.strip() == "":
        raise _EditProblem("no value after '='", "write null for None, or '' for an empty string")
    try:
        return YAML(typ="safe", pure=True).load(text)
    except YAMLError as exc:
        first = str(exc).strip().splitlines()[0]
        raise _EditProblem(f"cannot read value {text!r} as YAML: {first}",
                           "quote strings with special characters: --set 'N.P=\"a: b\"'") from None


def _check_id(word: str, what: str) -> str:
    if not re.match(ID_PATTERN, word):
        raise _EditProblem(f"{what} {word!r} is not a valid node id",
                           "ids are letters, digits, _ and -, starting with a letter or _")
    return word


def _parse_set(text: str, origin: Origin | None) -> SetEdit:
    path_text, eq, value_text = text.partition("=")
    if not eq:
        raise _EditProblem(f"expected PATH=VALUE, got {text!r}")
    path = tuple(path_text.strip().split("."))
    if any(not p for p in path):
        raise _EditProblem(f"bad path {path_text!r}: empty key between dots")
    return SetEdit(path, parse_value(value_text), origin)


def _parse_drop(text: str, origin: Origin | None) -> DropEdit:
    if not text:
        raise _EditProblem("--drop needs a node id")
    return DropEdit(_check_id(text, "node"), origin)


def _parse_swap(text: str, origin: Origin | None) -> SwapEdit:
    node, eq, op = text.partition("=")
    if not eq or not node.strip() or not op.strip():
        raise _EditProblem(f"expected NODE=OP, got {text!r}")
    return SwapEdit(_check_id(node.strip(), "node"), op.strip(), origin)


def _parse_insert(text: str, origin: Origin | None) -> InsertEdit:
    parts = [p.strip() for p in text.split(":")]
    if len(parts) < 3 or not parts[0] or not parts[1]:
        raise _EditProblem(f"expected NEW_ID:OP:after=NODE, got {text!r}")
    opts: dict[str, str] = {}
    for part in parts[2:]:
        key, eq, value = part.partition("=")
        if not eq or key not in ("after", "model") or not value:
            raise _EditProblem(f"bad option {part!r} in {text!r}",
                               f"options are after=NODE and model=MODEL: {USAGE['insert']}")
        opts[key] = value
    if "after" not in opts:
        raise _EditProblem(f"--insert {text} says not where: add :after=NODE")
    return InsertEdit(_check_id(parts[0], "new id"), parts[1], opts["after"], {}, opts.get("model"),
                      origin)


_PARSERS = {"set": _parse_set, "drop": _parse_drop, "swap": _parse_swap, "insert": _parse_insert}


# --- applying -----------------------------------------------------------------------------


def apply_edits(doc: GraphDoc, edits: Iterable[Edit], registries: Registries | None = None) -> GraphDoc:
    """The edited document (a new object); edited keys carry marker lines (see module doc).
    ``registries``: whose op names a swap or insert may use (default: the built-ins and plugins).

    Problems in the edits themselves (unknown node, unknown op, duplicate id, ...) are all
    collected and raised as one GraphError, each located at its edit."""
    operators = (registries or Registries()).operators
    raw: dict[str, Any] = copy.deepcopy(dict(doc.raw))
    lines = dict(doc.lines)
    problems = []
    for k, edit in enumerate(edits):
        try:
            _APPLY[type(edit)](raw, lines, edit, -1 - k, operators)
        except _EditProblem as p:
            problems.append(_problem(where(edit), p.message, p.hint))
    if problems:
        raise GraphError(problems)
    return GraphDoc(file=doc.file, raw=raw, lines=lines)


def _nodes(raw: dict[str, Any]) -> list[dict[str, Any]]:
    nodes = raw.get("nodes")
    if not isinstance(nodes, list) or not all(isinstance(n, dict) for n in nodes):
        raise _EditProblem("the graph has no readable `nodes:` list to edit",
                           "fix the graph file first (dapo-flow validate GRAPH)")
    return nodes


def _node_index(raw: dict[str, Any], node_id: str, extra: Iterable[str] = ()) -> int:
    nodes = _nodes(raw)
    for i, node in enumerate(nodes):
        if node.get("id") == node_id:
            return i
    ids = [str(n.get("id")) for n in nodes]
    if node_id == PROMPTS_SOURCE:
        raise _EditProblem(f"'{PROMPTS_SOURCE}' is the implicit source fed by data.train, not a node",
                           "name a node from `nodes:`")
    raise _EditProblem(f"unknown node '{node_id}'", did_you_mean(node_id, [*ids, *extra]))


def _mark(lines: dict[PathKey, int], path: PathKey, marker: int) -> None:
    """``path`` was written by the edit: drop the stale lines below it, mark it."""
    n = len(path)
    for key in [k for k in lines if len(k) > n and k[:n] == path]:
        del lines[key]
    lines[path] = marker


def _shift_nodes(lines: dict[PathKey, int], start: int, delta: int) -> None:
    """Renumber line entries of nodes[start:] by ``delta`` (after a drop or insert)."""
    moved = {}
    for key in list(lines):
        if len(key) >= 2 and key[0] == "nodes" and isinstance(key[1], int) and key[1] >= start:
            moved[("nodes", key[1] + delta, *key[2:])] = lines.pop(key)
    lines.update(moved)


def _set_path(raw: dict[str, Any], edit: SetEdit) -> PathKey:
    """Where in the document ``edit.path`` points (see the module doc)."""
    head, rest = edit.path[0], edit.path[1:]
    if head == "nodes":
        raise _EditProblem("nodes are edited by id: --set NODE.PARAM=VALUE",
                           "or use --drop / --swap / --insert to change the wiring")
    if head in SECTIONS:
        return edit.path
    index = _node_index(raw, head, SECTIONS)
    if not rest:
        raise _EditProblem(f"--set {head}=... names a node, not one of its fields",
                           f"write --set {head}.PARAM=VALUE")
    if rest[0] == "id":
        raise _EditProblem("a node id cannot be changed by --set (its consumers would dangle)",
                           "use --insert to add a node with a new id and --drop the old one")
    if rest[0] in NODE_FIELDS:
        if rest[0] != "params" and len(rest) > 1:
            raise _EditProblem(f"node field '{rest[0]}' has no sub-keys",
                               f"write --set {head}.{rest[0]}=VALUE")
        if rest == ("params",):
            raise _EditProblem("set params one by one", f"write --set {head}.PARAM=VALUE")
        return ("nodes", index, *rest)
    return ("nodes", index, "params", *rest)


def _apply_set(raw: dict[str, Any], lines: dict[PathKey, int], edit: SetEdit, marker: int,
               operators: Mapping[str, type]) -> None:
    path = _set_path(raw, edit)
    target: Any = raw
    missing = False
    offset = len(path) - len(edit.path)  # ("nodes", i, "params") vs the node id
    for depth, key in enumerate(path[:-1]):  # check the whole way before writing anything
        child = None if missing else (target[key] if isinstance(target, list) else target.get(key))
        if child is None:
            missing = True
            continue
        shown = ".".join(edit.path[: max(depth + 1 - offset, 1)])
        if isinstance(child, list) and not isinstance(path[depth + 1], int):
            raise _EditProblem(f"'{shown}' is a list; set it whole", f"write --set {shown}=[a, b]")
        if not isinstance(child, (dict, list)):
            raise _EditProblem(f"'{shown}' is {flow(child)}, not a mapping, so it has no key "
                               f"'{path[depth + 1]}'", f"write --set {shown}=VALUE")
        target = child
    target = raw
    for depth, key in enumerate(path[:-1]):
        if isinstance(target, dict) and target.get(key) is None:
            target[key] = {}
            lines[path[: depth + 1]] = marker  # a mapping this edit made: errors there name it
        target = target[key]
    target[path[-1]] = copy.deepcopy(edit.value)
    _mark(lines, path, marker)


def _apply_drop(raw: dict[str, Any], lines: dict[PathKey, int], edit: DropEdit, marker: int,
                operators: Mapping[str, type]) -> None:
    index = _node_index(raw, edit.node)
    nodes = _nodes(raw)
    own_inputs = list(nodes[index].get("inputs") or [])
    for j, node in enumerate(nodes):
        inputs = node.get("inputs")
        if j == index or not isinstance(inputs, list) or edit.node not in inputs:
            continue
        rewired: list[Any] = []
        for inp in inputs:
            rewired += own_inputs if inp == edit.node else [inp]
        node["inputs"] = list(dict.fromkeys(rewired))
        _mark(lines, ("nodes", j, "inputs"), marker)
    del nodes[index]
    for key in [k for k in lines if k[:2] == ("nodes", index)]:  # forget the dropped node's lines
        del lines[key]
    _shift_nodes(lines, index + 1, -1)


def _op_class(op: str, operators: Mapping[str, type]) -> type | None:
    """The operator class of ``op`` (None for custom); _EditProblem when unknown."""
    if op == CUSTOM_OP:
        return None
    if op not in operators:
        raise _EditProblem(f"unknown op '{op}'", did_you_mean(op, [*operators, CUSTOM_OP]))
    return operators[op]


def _takes_model_field(cls: type, params: Mapping[str, Any]) -> bool:
    """Whether a node of ``cls`` with ``params`` runs on a model named by its `model:` field (not
    `score` with a rule reward, which runs on none, or with `reward: {model: rm}`, which names
    it in its params); params that do not validate are judged by the op's ``NEEDS_MODEL``."""
    try:
        validated = cls.Params.model_validate(dict(params))
    except Exception:  # reported by validate, at the edit
        return contract_of(cls).needs_model
    return uses_model(cls, validated) and node_model(cls, None, validated) is None


def _default_model(raw: dict[str, Any], *candidates: Any) -> str | None:
    """The first candidate that is set, else the only declared model, else None."""
    for c in candidates:
        if c:
            return c
    models = raw.get("models")
    return next(iter(models)) if isinstance(models, dict) and len(models) == 1 else None


def _apply_swap(raw: dict[str, Any], lines: dict[PathKey, int], edit: SwapEdit, marker: int,
                operators: Mapping[str, type]) -> None:
    index = _node_index(raw, edit.node)
    cls = _op_class(edit.op, operators)
    node = _nodes(raw)[index]
    params = node.get("params") if isinstance(node.get("params"), dict) else {}
    if cls is not None:  # keep what the new op understands; the rest belonged to the old op
        params = {k: v for k, v in params.items() if k in cls.Params.model_fields}
        model = _default_model(raw, node.get("model")) if _takes_model_field(cls, params) else None
        if model is None:
            node.pop("model", None)
        else:
            node["model"] = model
        node.pop("impl", None)
    node["op"] = edit.op
    node["params"] = params
    for key in ("op", "params", "model", "impl"):
        _mark(lines, ("nodes", index, key), marker)
    lines[("nodes", index)] = marker


def _apply_insert(raw: dict[str, Any], lines: dict[PathKey, int], edit: InsertEdit, marker: int,
                  operators: Mapping[str, type]) -> None:
    nodes = _nodes(raw)
    ids = [n.get("id") for n in nodes]
    if edit.new_id in ids or edit.new_id == PROMPTS_SOURCE:
        raise _EditProblem(f"node id '{edit.new_id}' already exists", "pick a new id for the inserted node")
    cls = _op_class(edit.op, operators)
    if edit.after == PROMPTS_SOURCE:
        anchor, position = {}, 0
    else:
        position = _node_index(raw, edit.after) + 1
        anchor = nodes[position - 1]
    new: dict[str, Any] = {"id": edit.new_id, "op": edit.op, "inputs": [edit.after]}
    needs = cls is not None and _takes_model_field(cls, edit.params)
    model = _default_model(raw, edit.model, anchor.get("model")) if needs else edit.model
    if model is not None:
        new["model"] = model
    if edit.impl is not None:
        new["impl"] = edit.impl
    new["params"] = copy.deepcopy(dict(edit.params))
    for j, node in enumerate(nodes):
        inputs = node.get("inputs")
        if isinstance(inputs, list) and edit.after in inputs:
            node["inputs"] = list(dict.fromkeys(edit.new_id if i == edit.after else i for i in inputs))
            _mark(lines, ("nodes", j, "inputs"), marker)
    _shift_nodes(lines, position, +1)
    nodes.insert(position, new)
    lines[("nodes", position)] = marker


_APPLY = {SetEdit: _apply_set, DropEdit: _apply_drop, SwapEdit: _apply_swap, InsertEdit: _apply_insert}


# --- compiling ------------------------------------------------------------------------------


def compile_edited(doc: GraphDoc, edits: Iterable[Edit] = (), cluster: Cluster | None = None,
                   base: GraphDoc | None = None, registries: Registries | None = None) -> PlacedPlan:
    """validate -> plan -> place an edited document. Problems at edited keys name the edit;
    with the unedited ``base``, so does a missing column that a dropped or swapped node made."""
    edits = tuple(edits)
    cluster = cluster or Cluster.local()
    registries = registries or Registries()
    operators = registries.operators
    try:
        placed = place(plan(validate(doc, registries)), cluster)
    except GraphError as err:
        made = _made_by_edits(base, edits, operators) if base is not None else {}
        raise type(err)([_relocate(p, edits, made, doc, operators) for p in err.problems]) from None
    if not edits:
        return placed
    # compiled once: the markers (negative lines at edited keys) only served the problems above;
    # the plan's nodes get the lines of the file without them (explain prints them)
    clean = GraphDoc(doc.file, doc.raw, {k: v for k, v in doc.lines.items() if v > 0})
    return _with_doc(placed, clean)


def _with_doc(placed: PlacedPlan, doc: GraphDoc) -> PlacedPlan:
    """``placed`` with every line number read from ``doc``."""
    index = {n.id: i for i, n in enumerate(placed.plan.spec.nodes)}
    nodes = tuple(dc_replace(n, line=doc.line_of(("nodes", index[n.id]))) for n in placed.plan.nodes)
    return dc_replace(placed, plan=dc_replace(placed.plan, nodes=nodes, doc=doc))


def _made_by_edits(base: GraphDoc, edits: tuple[Edit, ...],
                   operators: Mapping[str, type]) -> dict[str, tuple[int, str]]:
    """column -> (index of the drop/swap edit that removed its producer, that node's id)."""
    from dapo_flow.core.contract import produces

    out: dict[str, tuple[int, str]] = {}
    nodes = {n.get("id"): n for n in base.get(("nodes",), []) or [] if isinstance(n, dict)}
    for k, edit in enumerate(edits):
        node = nodes.get(getattr(edit, "node", None)) if isinstance(edit, (DropEdit, SwapEdit)) else None
        cls = operators.get(node.get("op")) if node else None
        if cls is None:
            continue
        try:
            made = produces(cls, cls.Params.model_validate(node.get("params") or {}))
        except Exception:  # a broken base node: its own problems are reported anyway
            continue
        for column in made:
            out.setdefault(column, (k, edit.node))
    return out


def _relocate(problem: Problem, edits: tuple[Edit, ...], made: Mapping[str, tuple[int, str]],
              doc: GraphDoc, operators: Mapping[str, type]) -> Problem:
    hint = problem.hint
    missing = problem.column if problem.code == MISSING_COLUMN else ""
    if missing:
        hint = _param_fix(doc, problem.node, missing, operators) or hint
    if problem.line >= 0 and missing and missing in made:
        k, node = made[missing]
        edit = edits[k]
    elif 0 < -problem.line <= len(edits):
        edit = edits[-problem.line - 1]
        node = getattr(edit, "node", "")
    else:
        return problem
    if missing and isinstance(edit, (DropEdit, SwapEdit)):
        what = "dropped" if isinstance(edit, DropEdit) else "swapped"
        hint = f"the {what} node '{node}' produced it: keep it" + (f", or {hint[0].lower()}{hint[1:]}"
                                                                   if hint else "")
    origin = where(edit)
    return dc_replace(problem, file=origin.file, line=origin.line, hint=hint)


def _param_fix(doc: GraphDoc, node_id: str, column: str, operators: Mapping[str, type]) -> str:
    """'--set adv.reward_column=score' when a param of the node picks the missing column."""
    node = next((n for n in doc.get(("nodes",), []) or [] if isinstance(n, dict) and n.get("id") == node_id), None)
    cls = operators.get(node.get("op")) if node else None
    if cls is None:
        return ""
    import typing

    given = node.get("params") or {}
    made = _columns_made(doc, operators)
    for name, info in cls.Params.model_fields.items():
        value = given.get(name, info.default)
        options = typing.get_args(info.annotation) if typing.get_origin(info.annotation) is typing.Literal else ()
        others = [o for o in options if o != column and o in made]
        if value == column and others:
            return "read another column: " + " or ".join(f"--set {node_id}.{name}={o}" for o in others)
    return ""


def _columns_made(doc: GraphDoc, operators: Mapping[str, type]) -> set[str]:
    """Every column some node of the graph (or the prompt source) produces."""
    from dapo_flow.core import columns as C
    from dapo_flow.core.contract import produces

    made = set(C.prompt_schema().names)
    for n in doc.get(("nodes",), []) or []:
        cls = operators.get(n.get("op")) if isinstance(n, dict) else None
        if cls is None:
            continue
        try:
            made |= set(produces(cls, cls.Params.model_validate(n.get("params") or {})))
        except Exception:  # a broken node: reported on its own
            continue
    return made


@dataclass(frozen=True)
class Edited:
    """A graph file with edits applied, ready to compile, print or log."""

    doc: GraphDoc
    edits: tuple[Edit, ...]
    base: GraphDoc | None = None  # the unedited file, to name edits in downstream errors
    registries: Registries | None = None  # what op and backend names mean (None: the defaults)

    def compile(self, cluster: Cluster | None = None) -> PlacedPlan:
        return compile_edited(self.doc, self.edits, cluster, self.base, self.registries)

    def yaml(self) -> str:
        return effective_yaml(self.doc, self.edits)

    def params(self) -> dict[str, str]:
        """MLflow params: ``edit.0 = "--set train.lr=0.0005"``, ..."""
        return {f"edit.{i}": e.cli() for i, e in enumerate(self.edits)}


def edit_file(path: str | Path, edits: Iterable[Edit] = (), registries: Registries | None = None) -> Edited:
    """load + apply_edits; ``registries`` as for ``validate``."""
    edits = tuple(edits)
    doc = load(path)
    return Edited(apply_edits(doc, edits, registries) if edits else doc, edits, doc, registries)


def effective_yaml(doc: GraphDoc, edits: Iterable[Edit] = ()) -> str:
    """The edited document as YAML, headed by a comment naming the base file and edits."""
    import io

    yaml = YAML(typ="rt")
    yaml.default_flow_style = False
    yaml.indent(mapping=2, sequence=4, offset=2)
    yaml.width = 4096
    buf = io.StringIO()
    head = [f"# effective graph: {doc.file}"]
    edits = list(edits)
    if edits:
        head.append("# with edits:")
        head += [f"#   {e.cli()}" for e in edits]
    buf.write("\n".join(head) + "\n")
    yaml.dump(_styled(dict(doc.raw)), buf)
    return buf.getvalue()


def _styled(value: Any) -> Any:
    """Short leaf mappings and scalar lists in flow style ({n: 8}, [prompts]), the rest block."""
    from ruamel.yaml.comments import CommentedMap, CommentedSeq

    if isinstance(value, dict):
        out = CommentedMap((k, _styled(v)) for k, v in value.items())
        leaf = all(not isinstance(v, (dict, list)) or not v for v in value.values())
        if leaf and value and len(flow(value)) <= 72:
            out.fa.set_flow_style()
        return out
    if isinstance(value, list):
        out = CommentedSeq(_styled(v) for v in value)
        if all(not isinstance(v, (dict, list)) for v in value):
            out.fa.set_flow_style()
        return out
    return value
