"""What differs between two graphs (as loaded mappings), key by key: a concept of the graph
language, used by `dapo-flow diff`, sweeps and a resume that refuses a changed graph.

Both graphs are flattened to the paths ``--set`` writes: sections as ``run.steps`` or
``models.policy.backend``, nodes by id (``train.clip_high`` is a param, ``train.op``,
``train.inputs`` and ``train.model`` the node's own fields). Sections and params are compared
with their defaults filled in (GraphSpec and each operator's Params), so a ``clip_high: 0.28``
written out equals the default left out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping

from pydantic import BaseModel, TypeAdapter, ValidationError

from dapo_flow.graph.registry import Registries
from dapo_flow.graph.spec import GraphSpec

NODE_FIELDS = ("op", "inputs", "model", "impl")


@dataclass(frozen=True)
class Change:
    kind: Literal["added", "removed", "changed"]
    key: str  # "run.steps", "train.clip_high", or "node overlong" for a whole node
    old: Any = None
    new: Any = None

    def render(self) -> str:
        from dapo_flow.graph.edits import flow

        if self.key.startswith("node "):
            body = self.new if self.kind == "added" else self.old
            return f"{self.key}: {self.kind} ({', '.join(f'{k} {flow(v)}' for k, v in body.items())})"
        if self.kind == "changed":
            return f"{self.key}: {flow(self.old)} -> {flow(self.new)}"
        return f"{self.key}: {self.kind} ({flow(self.new if self.kind == 'added' else self.old)})"


def _flat(value: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(value, Mapping) and value:
        for k, v in value.items():
            _flat(v, f"{prefix}.{k}" if prefix else str(k), out)
    else:
        out[prefix] = value


def flatten_graph(raw: Mapping[str, Any], registries: Registries | None = None
                  ) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """(section key -> value, node id -> {field or param -> value}), defaults filled in (an
    invalid value is kept as written, its siblings still get their defaults); a node's params
    from its op's class in ``registries`` (default: the built-ins and plugins)."""
    operators = (registries or Registries()).operators
    sections: dict[str, Any] = {}
    for name, info in GraphSpec.model_fields.items():
        if name == "nodes":
            continue
        if name in raw:
            sections[name] = _filled(info.annotation, raw[name])
        elif not info.is_required():
            sections[name] = _dump(info.annotation, info.get_default(call_default_factory=True))
    sections.update({k: v for k, v in raw.items() if k not in GraphSpec.model_fields})
    flat: dict[str, Any] = {}
    _flat(sections, "", flat)
    nodes: dict[str, dict[str, Any]] = {}
    for node in raw.get("nodes") or []:
        if not isinstance(node, Mapping):
            continue
        fields = {k: node[k] for k in NODE_FIELDS if node.get(k) is not None}
        params = dict(node.get("params") or {})
        cls = operators.get(node.get("op"))
        if cls is not None:
            params = _filled(cls.Params, params)
        for k, v in params.items():
            fields[f"params.{k}" if k in NODE_FIELDS else k] = v
        nodes.setdefault(str(node.get("id")), fields)
    return flat, nodes


def _dump(annotation: Any, value: Any) -> Any:
    adapter = TypeAdapter(annotation)
    return adapter.dump_python(adapter.validate_python(value), mode="json")


def _filled(annotation: Any, value: Any) -> Any:
    """``value`` validated with defaults filled in; if invalid, as written plus the defaults
    of the fields it leaves out (so one bad field does not make every default differ)."""
    try:
        return _dump(annotation, value)
    except ValidationError:
        pass
    if isinstance(annotation, type) and issubclass(annotation, BaseModel) and isinstance(value, Mapping):
        defaults = {}
        for name, info in annotation.model_fields.items():
            if name not in value and not info.is_required():
                try:
                    defaults[name] = _dump(info.annotation, info.get_default(call_default_factory=True))
                except ValidationError:
                    continue
        return {**defaults, **value}
    return value


def diff_graphs(a: Mapping[str, Any], b: Mapping[str, Any], registries: Registries | None = None) -> list[Change]:
    """Changes from graph ``a`` to graph ``b``: sections first, then nodes in graph order."""
    (sa, na), (sb, nb) = flatten_graph(a, registries), flatten_graph(b, registries)
    changes = _diff_keys(sa, sb, "")
    for node in _merged_order(list(na), list(nb)):
        if node not in nb:
            changes.append(Change("removed", f"node {node}", old=na[node]))
        elif node not in na:
            changes.append(Change("added", f"node {node}", new=nb[node]))
        else:
            changes += _diff_keys(na[node], nb[node], f"{node}.")
    return changes


def _merged_order(a: list[str], b: list[str]) -> list[str]:
    """a's ids, with b's new ids placed right after their predecessor in b."""
    order = list(a)
    for i, node in enumerate(b):
        if node not in order:
            prev = next((p for p in reversed(b[:i]) if p in order), None)
            order.insert(order.index(prev) + 1 if prev is not None else 0, node)
    return order


def _diff_keys(a: Mapping[str, Any], b: Mapping[str, Any], prefix: str) -> list[Change]:
    out = []
    for key in list(dict.fromkeys([*a, *b])):
        if key not in b:
            out.append(Change("removed", prefix + key, old=a[key]))
        elif key not in a:
            out.append(Change("added", prefix + key, new=b[key]))
        elif a[key] != b[key]:
            out.append(Change("changed", prefix + key, a[key], b[key]))
    return out
