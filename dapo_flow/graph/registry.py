"""The one registry: op name -> operator class. Plugins are loaded into it explicitly."""

from __future__ import annotations

from importlib.metadata import entry_points

from operators.advantage import Advantage
from operators.agent_generate import AgentGenerate
from operators.baseline import Baseline
from operators.critic_update import CriticUpdate
from operators.generate import Generate
from operators.group_filter import GroupFilter
from operators.kl import KL
from operators.logprob import Logprob
from operators.overlong_filter import OverlongFilter
from operators.overlong_shape import OverlongShape
from operators.rollout_correction import RolloutCorrection
from operators.score import Score
from operators.update import Update
from operators.values import Values

OPERATORS: dict[str, type] = {
    "generate": Generate,
    "agent-generate": AgentGenerate,
    "score": Score,
    "overlong-shape": OverlongShape,
    "overlong-filter": OverlongFilter,
    "group-filter": GroupFilter,
    "logprob": Logprob,
    "kl": KL,
    "rollout-correction": RolloutCorrection,
    "baseline": Baseline,
    "advantage": Advantage,
    "update": Update,
    "values": Values,
    "critic-update": CriticUpdate,
}

CUSTOM_OP = "custom"  # a node whose class is named by its `impl:` field
PLUGIN_GROUP = "dapo_flow.operators"
#: entry points naming modules that register anything when imported: estimators
#: (algos.ESTIMATORS), backends (models.engines.BACKENDS), executors (runtime.executors.EXECUTORS)
MODULE_PLUGIN_GROUP = "dapo_flow.plugins"


def load_plugins(registry: dict[str, type] = OPERATORS) -> dict[str, type]:
    """Add operators that installed packages declare under the `dapo_flow.operators`
    entry-point group, and import the modules they declare under `dapo_flow.plugins` (whose
    top-level code adds to the other registries); called by the CLI, never at import time.
    A plugin that fails to import is an ImportSpecError naming it."""
    from dapo_flow.graph.imports import ImportSpecError

    for group in (PLUGIN_GROUP, MODULE_PLUGIN_GROUP):
        for ep in entry_points(group=group):
            try:
                loaded = ep.load()
            except Exception as exc:  # noqa: BLE001 - installed third-party code
                raise ImportSpecError(f"plugin '{ep.name}' ({ep.value}, entry point group {group}) "
                                      f"failed to load: {type(exc).__name__}: {exc}") from exc
            if group == PLUGIN_GROUP:
                registry.setdefault(ep.name, loaded)
    return registry
