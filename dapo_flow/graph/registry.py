"""The registries a graph's names are looked up in: ``OPERATORS`` (op name -> operator class:
the built-ins plus the plugins the CLI loads into it) and the backends
(``models.engines.BACKENDS``). ``validate`` / ``compile_graph`` / the edits take them as one
:class:`Registries`, as they take the cluster, these defaults when none is handed in; workers
never read a registry (a node's setup names the module its class came from, a model's the
backend it was compiled with)."""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Mapping

from dapo_flow.models.engines import BACKENDS, Backend
from dapo_flow.operators.advantage import Advantage
from dapo_flow.operators.agent_generate import AgentGenerate
from dapo_flow.operators.baseline import Baseline
from dapo_flow.operators.critic_update import CriticUpdate
from dapo_flow.operators.generate import Generate
from dapo_flow.operators.group_filter import GroupFilter
from dapo_flow.operators.harness_generate import HarnessGenerate
from dapo_flow.operators.kl import KL
from dapo_flow.operators.logprob import Logprob
from dapo_flow.operators.overlong_filter import OverlongFilter
from dapo_flow.operators.overlong_shape import OverlongShape
from dapo_flow.operators.rollout_correction import RolloutCorrection
from dapo_flow.operators.score import Score
from dapo_flow.operators.update import Update
from dapo_flow.operators.values import Values

OPERATORS: dict[str, type] = {
    "generate": Generate,
    "agent-generate": AgentGenerate,
    "harness-generate": HarnessGenerate,
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


@dataclass(frozen=True)
class Registries:
    """What a graph's names mean: ``operators`` (a node's `op:`) and ``backends`` (a model's
    `backend:`); each defaults to the live module registry (plugins included)."""

    operators: Mapping[str, type] = field(default_factory=lambda: OPERATORS)
    backends: Mapping[str, Backend] = field(default_factory=lambda: BACKENDS)


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
    from dapo_flow.core.imports import ImportSpecError

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
