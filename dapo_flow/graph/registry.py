"""The one registry: op name -> operator class. Plugins are loaded into it explicitly."""

from __future__ import annotations

from importlib.metadata import entry_points

from operators.advantage import Advantage
from operators.generate import Generate
from operators.group_filter import GroupFilter
from operators.kl import KL
from operators.logprob import Logprob
from operators.overlong_filter import OverlongFilter
from operators.overlong_shape import OverlongShape
from operators.score import Score
from operators.update import Update

OPERATORS: dict[str, type] = {
    "generate": Generate,
    "score": Score,
    "overlong-shape": OverlongShape,
    "overlong-filter": OverlongFilter,
    "group-filter": GroupFilter,
    "logprob": Logprob,
    "kl": KL,
    "advantage": Advantage,
    "update": Update,
}

CUSTOM_OP = "custom"  # a node whose class is named by its `impl:` field
PLUGIN_GROUP = "dapo_flow.operators"


def load_plugins(registry: dict[str, type] = OPERATORS) -> dict[str, type]:
    """Add operators that installed packages declare under the `dapo_flow.operators`
    entry-point group; called by the CLI, never at import time."""
    for ep in entry_points(group=PLUGIN_GROUP):
        registry.setdefault(ep.name, ep.load())
    return registry
