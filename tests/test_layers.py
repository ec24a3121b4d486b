"""The package's layers, as imports (top-level and inside functions): each layer uses only those
below it, so the graph language compiles without a runtime, the math runs without Ray or MLflow,
and the runtime receives what it logs instead of reaching up into experiments or printing."""

from __future__ import annotations

import ast
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: every part of the package but the ground floor (core) and the leaf modules it may use (errors)
ABOVE_CORE = ("graph", "runtime", "experiments", "tracking", "cli", "models", "recipes", "data", "algos", "agent",
              "tools", "operators", "training", "reductions", "threads", "home", "reward_server")

#: package -> modules it must never import (prefix match on dotted names)
FORBIDDEN = {
    "dapo_flow.runtime": ("dapo_flow.experiments", "dapo_flow.cli", "dapo_flow.graph.compiler", "dapo_flow.graph.drawing",
                          "dapo_flow.graph.edits", "dapo_flow.graph.placement", "dapo_flow.graph.placement_checks",
                          "dapo_flow.graph.explain"),
    "dapo_flow.graph": ("dapo_flow.runtime", "dapo_flow.experiments", "dapo_flow.tracking", "dapo_flow.cli",
                        "dapo_flow.models.hf", "dapo_flow.models.vllm_engine", "dapo_flow.recipes",
                        "torch", "ray", "mlflow", "vllm"),
    "dapo_flow.algos": ("dapo_flow.graph", "dapo_flow.runtime", "dapo_flow.experiments", "dapo_flow.models",
                        "dapo_flow.data", "dapo_flow.tracking", "ray", "mlflow", "pyarrow", "dapo_flow.operators"),
    # engines and model loading sit below the compiler, which reads their backend registry
    "dapo_flow.models": ("dapo_flow.graph", "dapo_flow.runtime", "dapo_flow.experiments", "dapo_flow.tracking",
                         "dapo_flow.operators", "dapo_flow.recipes", "dapo_flow.data", "ray", "mlflow"),
    # the built-in models' recipes: train a model from a config on a built-in task
    "dapo_flow.recipes": ("dapo_flow.graph", "dapo_flow.runtime", "dapo_flow.experiments", "dapo_flow.tracking",
                          "dapo_flow.operators", "ray", "mlflow"),
    "dapo_flow.data": ("dapo_flow.graph", "dapo_flow.runtime", "dapo_flow.experiments", "dapo_flow.tracking",
                       "dapo_flow.models", "dapo_flow.recipes", "ray", "mlflow"),
    "dapo_flow.tracking": ("dapo_flow.graph", "dapo_flow.runtime", "dapo_flow.experiments", "dapo_flow.models",
                           "ray", "torch"),
    # the agent loop drives an engine and tools through their interfaces: no Ray, no tables
    "dapo_flow.agent": ("dapo_flow.runtime", "dapo_flow.experiments", "dapo_flow.tracking", "dapo_flow.graph",
                        "ray", "mlflow", "pyarrow", "dapo_flow.operators"),
    "dapo_flow.tools": ("dapo_flow.graph", "dapo_flow.runtime", "dapo_flow.experiments", "dapo_flow.tracking",
                        "dapo_flow.agent", "dapo_flow.models", "dapo_flow.data", "ray", "mlflow", "pyarrow", "torch",
                        "dapo_flow.operators"),
    # an operator says what its loss is; optimizer steps and a group's collectives are a trainer's
    # (the compiler reads operators through their contract; they do not read the compiler)
    "dapo_flow.operators": ("dapo_flow.graph", "dapo_flow.runtime", "dapo_flow.experiments", "dapo_flow.tracking",
                            "ray", "mlflow", "torch.distributed", "dapo_flow.models.fsdp"),
    # how a metric adds up: the ground floor, which the math names its metrics with too
    "dapo_flow.reductions": ("dapo_flow.graph", "dapo_flow.runtime", "dapo_flow.experiments", "dapo_flow.tracking",
                             "dapo_flow.models", "dapo_flow.data", "dapo_flow.algos", "dapo_flow.operators",
                             "dapo_flow.training", "torch", "ray", "mlflow", "pyarrow"),
    # the trainer turns losses into optimizer steps: no tables, no runtime, no tracking
    "dapo_flow.training": ("dapo_flow.runtime", "dapo_flow.experiments", "dapo_flow.tracking", "dapo_flow.data",
                           "dapo_flow.graph", "ray", "mlflow", "pyarrow", "dapo_flow.operators"),
    # rewards over HTTP: a reward function (data) behind a server, and the client a score node uses
    "dapo_flow.reward_server": ("dapo_flow.graph", "dapo_flow.runtime", "dapo_flow.experiments", "dapo_flow.tracking",
                                "dapo_flow.operators", "dapo_flow.models", "ray", "mlflow", "torch", "pyarrow"),
    # the ground floor: column names and types, the operator contract, loading user code
    "dapo_flow.core": tuple(f"dapo_flow.{p}" for p in ABOVE_CORE) + ("torch", "ray", "mlflow", "vllm"),
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]  # `from pkg import mod`
    return out


def _violations(package: str, forbidden: tuple[str, ...]) -> list[str]:
    folder = ROOT.joinpath(*package.split("."))
    files = sorted(folder.rglob("*.py")) if folder.is_dir() else [folder.with_suffix(".py")]
    found = []
    for f in files:
        for line, name in _imports(f):
            bad = next((x for x in forbidden if name == x or name.startswith(x + ".")), None)
            if bad:
                found.append(f"{_module_name(f)} (line {line}) imports {name}")
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_layer_imports_only_what_is_below_it(package):
    found = _violations(package, FORBIDDEN[package])
    assert not found, f"{package} reaches into a layer it must not use:\n" + "\n".join(found)


def test_the_check_sees_imports_inside_functions():
    assert (4, "dapo_flow.graph.diff.diff_graphs") in [
        (line, name) for line, name in _imports_of("def f():\n    x = 1\n    if x:\n        from dapo_flow.graph.diff import diff_graphs\n")]


def _imports_of(source: str) -> list[tuple[int, str]]:
    with tempfile.TemporaryDirectory() as folder:
        probe = Path(folder) / "probe.py"
        probe.write_text(source)
        return _imports(probe)


def _import_graph(level: int | None = None):
    """dapo_flow's import graph from the source: module -> modules it imports (at any depth, in
    functions too; not under ``if TYPE_CHECKING:``, which never runs). ``from pkg import mod``
    imports ``pkg.mod``. With ``level``, names are cut to their first ``level`` parts."""
    import networkx as nx

    files = {_module_name(f): f for f in (ROOT / "dapo_flow").rglob("*.py")}
    graph = nx.DiGraph()
    for name, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and ast.unparse(node.test).endswith("TYPE_CHECKING") for n in ast.walk(node)}
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module
                           for a in node.names]
            else:
                continue
            for target in targets:
                if target in files:
                    a, b = (".".join(n.split(".")[:level]) for n in (name, target)) if level else (name, target)
                    if a != b:
                        graph.add_edge(a, b)
    return graph


@pytest.mark.parametrize("level", [None, 2], ids=["modules", "packages"])
def test_no_import_circles(level):
    """No module imports one that imports it back, and no part of the package (graph, models,
    data, ...) imports one that imports it back: the layers are a ladder, not a ring."""
    import networkx as nx

    circles = list(nx.simple_cycles(_import_graph(level)))
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c + c[:1]) for c in circles[:10])


def test_the_circle_check_sees_a_circle():
    graph = _import_graph(2)
    assert graph.has_edge("dapo_flow.graph", "dapo_flow.operators")  # the registry
    assert not graph.has_edge("dapo_flow.operators", "dapo_flow.graph")
    graph.add_edge("dapo_flow.operators", "dapo_flow.graph")
    import networkx as nx

    assert list(nx.simple_cycles(graph))
