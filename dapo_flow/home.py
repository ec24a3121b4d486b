"""Where dapo-flow keeps its caches (built models, ...): ``$DAPO_FLOW_HOME`` or ~/.cache/dapo-flow."""

from __future__ import annotations

import os
from pathlib import Path


def dapo_flow_home() -> Path:
    """The cache root; not created here (callers create the subfolders they write)."""
    env = os.environ.get("DAPO_FLOW_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dapo-flow"
