"""Tests that share a module-scoped fixture run in one pytest-xdist process.

xdist's default scheduler hands tests out one by one, so a module's tests land on both processes
and each computes the module's fixture again: test_fsdp's three multi-process launches, a Ray
training group, a vLLM engine, a trained model (minutes of repeated work on 2 cores). xdist's own
``--dist loadgroup`` would do this from ``xdist_group`` markers, but it marks a test by rewriting
``item._nodeid``, which pytest 9 no longer reads. So the workers say which tests share a module
fixture (:func:`record`, from their collection, the first worker writes it down), and the
controller's scheduler (:class:`ModuleFixtureScheduling`) hands each such module out as one unit;
every other test is a unit of its own, in the collection's order, as before.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from xdist.scheduler import LoadScopeScheduling


def _groups_file(controller_pid: int) -> Path:
    return Path(tempfile.gettempdir()) / f"dapo-flow-xdist-groups-{controller_pid}.json"


def shares_a_module_fixture(item) -> bool:
    """Whether ``item`` uses a fixture of module scope (it is computed once per process)."""
    info = getattr(item, "_fixtureinfo", None)
    return bool(info) and any(defs[-1].scope == "module" for defs in info.name2fixturedefs.values())


def record(items) -> None:
    """In the first xdist worker: write which collected tests share their module's fixture
    (node id -> module path) where the controller (this process's parent) reads it."""
    if os.environ.get("PYTEST_XDIST_WORKER") != "gw0":
        return
    groups = {item.nodeid: item.nodeid.split("::", 1)[0] for item in items if shares_a_module_fixture(item)}
    path = _groups_file(os.getppid())
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(groups), encoding="utf-8")
    tmp.replace(path)  # whole or absent: the controller reads it once every worker has collected


def discard() -> None:
    """In the controller at session end: the workers' record, where no scheduler read it (a run
    cut short before scheduling, or another ``--dist``)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        _groups_file(os.getpid()).unlink(missing_ok=True)


class ModuleFixtureScheduling(LoadScopeScheduling):
    """xdist's scope scheduling with a test's scope being its module where the module's tests
    share a module fixture, else the test itself. Units go out in the collection's order (run
    with ``--no-loadscope-reorder``), each process holding about two tests ahead."""

    _groups: dict[str, str] | None = None

    def _split_scope(self, nodeid: str) -> str:
        if self._groups is None:
            path = _groups_file(os.getpid())
            try:
                self._groups = json.loads(path.read_text(encoding="utf-8"))
                path.unlink()
            except (OSError, ValueError):  # gw0 recorded nothing: schedule test by test
                self._groups = {}
        return self._groups.get(nodeid, nodeid)
