"""Shared fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_adder_path() -> Path:
    """The builtin tiny-adder model dir, built once (~15 s) into the persistent cache.

    The cache is ``$DAPO_FLOW_HOME`` (default ~/.cache/dapo-flow); the build is deterministic
    and the directory versioned by recipe, so later sessions reuse it.
    """
    from dapo_flow.models import resolve_model

    return resolve_model("builtin:tiny-adder", progress=False)
