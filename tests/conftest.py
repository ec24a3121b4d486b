"""Shared fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest

from dapo_flow import threads


def pytest_configure(config) -> None:
    """One thread budget for the whole session, nesting off, numba on its own pool: before any
    test imports torch's users, numba or vLLM (issue 10: nested OpenMP after a vLLM engine and the
    numba kernels ran in one process made one test take 27 minutes instead of 20 s)."""
    threads.configure(threads.cpu_count())


@pytest.fixture(autouse=True)
def _thread_budget():
    """Every test starts from the session's budget: a test (or an in-process vLLM engine, or
    numba's OpenMP layer) that changed torch's count or turned nesting on does not leak it."""
    threads.configure(threads.cpu_count())
    yield


@pytest.fixture(scope="session")
def tiny_adder_path() -> Path:
    """The builtin tiny-adder model dir, built once (~15 s) into the persistent cache.

    The cache is ``$DAPO_FLOW_HOME`` (default ~/.cache/dapo-flow); the build is deterministic
    and the directory versioned by recipe, so later sessions reuse it.
    """
    from dapo_flow.models import resolve_model

    return resolve_model("builtin:tiny-adder", progress=False)
