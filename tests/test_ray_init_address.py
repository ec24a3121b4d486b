"""Every ``ray.init`` in the project, its tests and its benchmarks names its address. Left out,
Ray joins the cluster recorded in /tmp/ray/ray_current_cluster when its GCS is alive: a test
running ``ray start --head`` on one xdist worker made another worker's ``ray.init(num_cpus=4)``
try to join it and fail ("num_cpus ... must not be provided")."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("dapo_flow", "tests", "benchmarks", "scripts")


def _ray_inits_without_address(path: Path) -> list[int]:
    text = path.read_text()
    if "init(" not in text:  # parse only the files that may call it (most do not)
        return []
    tree = ast.parse(text, filename=str(path))
    lines = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        func = node.func
        if func.attr == "init" and isinstance(func.value, ast.Name) and func.value.id == "ray":
            named = node.args or any(k.arg in ("address", None) for k in node.keywords)
            if not named:
                lines.append(node.lineno)
    return lines


def test_every_ray_init_names_its_address():
    missing = [f"{path.relative_to(ROOT)}:{line}"
               for folder in SOURCES if (ROOT / folder).is_dir()
               for path in sorted((ROOT / folder).rglob("*.py"))
               for line in _ray_inits_without_address(path)]
    assert not missing, ("ray.init without address= (pass address='local' for a cluster of its own): "
                         + ", ".join(missing))


def test_the_check_sees_a_call_without_address(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import ray\nray.init(num_cpus=4)\nray.init(address='local', num_cpus=2)\n")
    assert _ray_inits_without_address(bad) == [2]
