"""Shared fixtures, the session's thread budget, and the built-in models it builds ahead."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

import model_builds
from dapo_flow import threads


def session_threads() -> int:
    """Threads per test process: the cores shared among the session's workers (pytest-xdist
    runs one process per core; each computing on every core would oversubscribe them)."""
    return max(1, threads.cpu_count() // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


def pytest_configure(config) -> None:
    """One thread budget for the whole session, nesting off, numba on its own pool: before any
    test imports torch's users, numba or vLLM (nested OpenMP, once a vLLM engine and the numba
    kernels have run in one process, makes a 20 s test take 27 minutes: dapo_flow/threads.py)."""
    threads.configure(session_threads())


@pytest.fixture(autouse=True)
def _thread_budget():
    """Every test starts from the session's budget: a test (or an in-process vLLM engine, or
    numba's OpenMP layer) that changed torch's count or turned nesting on does not leak it."""
    threads.configure(session_threads())
    yield


@pytest.fixture(scope="session")
def tiny_adder_path() -> Path:
    """The builtin tiny-adder model dir, built once (~15 s) into the persistent cache.

    The cache is ``$DAPO_FLOW_HOME`` (default ~/.cache/dapo-flow); the build is deterministic
    and the directory versioned by recipe, so later sessions reuse it.
    """
    from dapo_flow.models import resolve_model

    return resolve_model("builtin:tiny-adder", progress=False)


@pytest.fixture(scope="session")
def short_tiny_chat_dir(tmp_path_factory) -> Path:
    """A tiny-chat built by ``model_builds.short_tiny_chat``'s recipe (seconds)."""
    from dapo_flow.models import tiny_chat

    return tiny_chat.build_tiny_chat(tmp_path_factory.mktemp("tiny-chat"), progress=False,
                                     recipe=model_builds.short_tiny_chat())


_LANES: list = []


@pytest.hookimpl(trylast=True)  # after -m / -k have deselected: only what will run counts
def pytest_collection_modifyitems(session, config, items) -> None:
    """Start the builds of the built-in models the selected tests read and the cache lacks (in
    background lanes: ``model_builds``), and order the tests: the slow ones first (they start
    while the builds run and leave no long test for the end), those that read a model of a long
    build after the others, by when it is built; then the fast ones, the same way. The order
    depends on the markers alone, not on the cache, so every pytest-xdist worker collects the
    same one."""
    def needs(item) -> set[str]:
        names = {n for mark in item.iter_markers("models") for n in mark.args}
        return names | ({"tiny-adder"} if "tiny_adder_path" in item.fixturenames else set())

    wanted = [needs(item) for item in items]
    every = set().union(*wanted) if wanted else set()
    all_lanes = model_builds.plan_lanes(sorted(every))

    def key(item, models: set[str]):
        long_builds = {n for n in models if model_builds.BUILD_MINUTES.get(n, 1.0) >= 1.0}
        return item.get_closest_marker("slow") is None, model_builds.ready_at(long_builds, all_lanes)

    order = {id(item): key(item, w) for item, w in zip(items, wanted)}
    items.sort(key=lambda item: order[id(item)])

    lanes = model_builds.plan_lanes(model_builds.missing(every))
    if not lanes or config.option.collectonly:
        return
    if os.environ.get("PYTEST_XDIST_WORKER", "gw0") == "gw0":  # one process starts them
        _LANES.extend(model_builds.start_lanes(lanes, Path(tempfile.gettempdir()) / "dapo-flow-test-builds"))
    model_builds.step_back()


def pytest_sessionfinish(session, exitstatus) -> None:
    """A session cut short stops its builds (a build's lock dies with it; its temp dir goes)."""
    for proc in _LANES:
        if proc.poll() is None:
            proc.terminate()
            proc.wait()
