"""Checks of the data sources a graph names that need more than their own fields: a
reasoning_gym source's task, settings and options (against the installed library), and train /
validation splits of one gym task that would share items (``data.reasoning_gym``); a verifiers
source's environment and args (``envs.verifiers_env``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from dapo_flow.data import reasoning_gym as gym
from dapo_flow.envs import verifiers_env

if TYPE_CHECKING:
    from dapo_flow.graph.spec import DataSourceSpec, DataSpec

Located = tuple[tuple, str, str]  # (path in the graph, message, fix)


def source_seed(src: "DataSourceSpec", role: str, graph_seed: int) -> int:
    """The seed a source's items are generated with: its own, else the graph's (offset for a
    validation gym source, so that by default its items are not the train split's)."""
    if src.seed is not None:
        return src.seed
    return gym.default_seed(role, graph_seed) if gym.is_gym(src.source) else graph_seed


def leaves(data: "DataSpec") -> Iterator[tuple[str, tuple, "DataSourceSpec"]]:
    """(role, path in the graph, single source) of every source, a mixture's one by one."""
    for role, src in (("train", data.train), ("val", data.val)):
        if src is None:
            continue
        if src.sources is None:
            yield role, ("data", role), src
        else:
            for k, leaf in enumerate(src.sources):
                yield role, ("data", role, "sources", k), leaf


def gym_problems(data: "DataSpec", graph_seed: int) -> list[Located]:
    out: list[Located] = []
    for _, path, src in leaves(data):
        if not gym.is_gym(src.source):
            if src.config and not verifiers_env.is_verifiers(src.source):
                out.append((path + ("config",), f"config is a reasoning_gym source's generator settings; "
                            f"{src.source} takes none", "remove it (a builtin task takes `options`)"))
            continue
        for field, message, fix in gym.source_problems(src.source, src.config, src.options):
            out.append((path + tuple(field.split(".")), message, fix))
    if out:
        return out
    trains = [(src, source_seed(src, role, graph_seed)) for role, _, src in leaves(data)
              if role == "train" and gym.is_gym(src.source)]
    for role, path, src in leaves(data):
        if role != "val" or not gym.is_gym(src.source):
            continue
        seed = source_seed(src, role, graph_seed)
        for train, train_seed in trains:
            if train.source != src.source or train.config != src.config:
                continue
            problem = gym.overlap_problem(gym.gym_name(src.source), (train_seed, train.size or gym.DEFAULT_SIZE),
                                          (seed, src.size or gym.DEFAULT_SIZE))
            if problem:
                clear = train_seed + (train.size or gym.DEFAULT_SIZE)
                out.append((path + ("seed",), problem, f"set this seed to {clear} or more (or the train seed "
                            "past this split's items), or leave both unset"))
    return out


def verifiers_problems(data: "DataSpec") -> list[Located]:
    """A verifiers source's library, environment id, args and options (``envs.verifiers_env``)."""
    out: list[Located] = []
    for _, path, src in leaves(data):
        if verifiers_env.is_verifiers(src.source):
            for field, message, fix in verifiers_env.source_problems(src.source, dict(src.config), dict(src.options)):
                out.append((path + tuple(field.split(".")), message, fix))
    return out
