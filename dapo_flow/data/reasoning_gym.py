"""Procedural task libraries as prompt sources: ``reasoning_gym:NAME`` (reasoning-gym's ~100
seeded generators, each with its own scorer), and the reward that scores with them.

Items. A source ``reasoning_gym:NAME`` with ``config:`` (the generator's own settings: the
fields of its config dataclass but ``seed`` and ``size``), ``size`` and ``seed`` serves the
generator's items 0 .. size-1. The library draws item i from ``Random(seed + i)``, so an item is
a function of (config, seed + i): the same seed gives the same items (a resumed run, ``eval``),
and two splits of one config share no item when their seed ranges ``[seed, seed + size)`` do not
overlap (validate checks this, :func:`overlap_problem`). A small task can still repeat an item
under another seed (``2 + 3`` drawn twice): validation items that a train item equals are
dropped and counted (:func:`questions`, the ``avoid`` of :func:`records`).

Prompt. The library's system prompt (``options: {system_prompt: NAME}``, a key of
``reasoning_gym.utils.SYSTEM_PROMPTS``, default ``default``), which tells the model to put its
final answer between ``<answer>`` tags, then the question, as chat messages.

Reward ``builtin:reasoning-gym``. The row's ground truth is a JSON object holding the dataset's
name, its config and the entry as the generator made it (question, answer, metadata), so the
score can be computed in any process from the row alone: ``score_answer(extract_answer(
response), entry)``, the library's scorer (in [0, 1]; some tasks give partial credit) on the
library's extraction of the last ``<answer>...</answer>``. The score is mapped onto
``[wrong, correct]`` (``correct: 1, wrong: 0`` gives the library's own number); ``acc`` is 1 when
the library scores 1. JSON turns the metadata's tuples into lists; every scorer read here was
checked to give the same score on the round-tripped entry (tests/data/test_reasoning_gym.py).

reasoning-gym is an optional extra: without it a graph naming a gym source fails validation
with the install command (:data:`INSTALL`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

from dapo_flow.errors import DataError

PREFIX = "reasoning_gym:"
REWARD = "builtin:reasoning-gym"
INSTALL = "pip install 'dapo-flow[gym]'"
OPTIONS = ("system_prompt",)
DEFAULT_SYSTEM_PROMPT = "default"
#: a validation split's default seed is the graph's seed plus this: its items' seeds
#: [seed, seed + size) stay clear of a train split at the graph's seed up to this many items
VAL_SEED_OFFSET = 100_000_000
DEFAULT_SIZE = 500  # reasoning-gym's own default size


def is_gym(source: str | None) -> bool:
    return bool(source) and source.startswith(PREFIX)


def gym_name(source: str) -> str:
    return source[len(PREFIX):]


def library() -> Any:
    """The ``reasoning_gym`` module; a DataError naming the install command when it is missing."""
    try:
        import reasoning_gym
    except ImportError as exc:
        raise DataError(f"a reasoning_gym: source needs the reasoning-gym package ({exc})\n"
                        f"    fix: {INSTALL}") from None
    return reasoning_gym


def default_seed(split: str, graph_seed: int) -> int:
    """The seed of a gym source that sets none: the graph's for train, offset for val."""
    return graph_seed + (VAL_SEED_OFFSET if split == "val" else 0)


def source_problems(source: str, config: dict[str, Any], options: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(field, message, fix) for each thing wrong with a gym source, without generating items:
    the library missing, an unknown task name, unknown or invalid config fields, unknown options."""
    try:
        rg = library()
    except DataError:
        return [("source", f"{source} needs the optional reasoning-gym package, not installed", INSTALL)]
    from reasoning_gym.factory import DATASETS

    from dapo_flow.errors import did_you_mean

    name = gym_name(source)
    if name not in DATASETS:
        return [("source", f"reasoning-gym has no task '{name}'",
                 did_you_mean(name, DATASETS) or f"one of {', '.join(sorted(DATASETS)[:12])}, ...")]
    out = []
    fields = [f.name for f in dataclasses.fields(DATASETS[name][1]) if f.name not in ("seed", "size")]
    for key in config:
        if key in ("seed", "size"):
            out.append((f"config.{key}", f"is set beside the source, not in its config",
                        f"move it up: `{key}:` next to `source:`"))
        elif key not in fields:
            out.append((f"config.{key}", f"{name} has no setting '{key}'",
                        did_you_mean(key, fields) or f"its settings: {', '.join(fields)}"))
    for key, value in options.items():
        if key not in OPTIONS:
            out.append((f"options.{key}", f"a gym source takes no option '{key}'", f"options: {list(OPTIONS)}"))
        elif value is not None and value not in rg.utils.SYSTEM_PROMPTS:
            out.append((f"options.{key}", f"reasoning-gym has no system prompt {value!r}",
                        f"one of {', '.join(rg.utils.SYSTEM_PROMPTS)} (or null: none)"))
    if not out:
        try:
            make_dataset(name, config, seed=0, size=1)
        except DataError as exc:
            out.append(("config", str(exc), f"see {name}'s config in reasoning-gym"))
    return out


def make_dataset(name: str, config: dict[str, Any], *, seed: int, size: int) -> Any:
    """The generator ``name`` with ``config`` at ``seed`` serving ``size`` items."""
    library()
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        raise DataError(f"reasoning-gym has no task '{name}'")
    dataset_cls, config_cls = DATASETS[name]
    try:
        return dataset_cls(config=config_cls(**config, seed=seed, size=size))
    except (AssertionError, TypeError, ValueError) as exc:
        raise DataError(f"reasoning-gym rejects {name}'s config {config}: {exc or type(exc).__name__}") from None


def entries(name: str, config: dict[str, Any], *, seed: int, size: int) -> list[dict[str, Any]]:
    """Items 0 .. size-1 of the generator (each ``{question, answer, metadata}``)."""
    dataset = make_dataset(name, config, seed=seed, size=size)
    return [dataset[i] for i in range(size)]


def questions(name: str, config: dict[str, Any], *, seed: int, size: int) -> set[str]:
    """The questions of a split: what a validation split of the same task must not repeat."""
    return {e["question"] for e in entries(name, config, seed=seed, size=size)}


def records(name: str, config: dict[str, Any], *, seed: int, size: int, options: dict[str, Any],
            avoid: set[str] = frozenset()) -> tuple[list[tuple[int, dict[str, Any]]], int]:
    """(index, verl-style row fields) of each item whose question is not in ``avoid``, and how
    many were dropped for being there."""
    rg = library()
    system = options.get("system_prompt", DEFAULT_SYSTEM_PROMPT)
    out, dropped = [], 0
    for i, entry in enumerate(entries(name, config, seed=seed, size=size)):
        if entry["question"] in avoid:
            dropped += 1
            continue
        messages = [{"role": "user", "content": entry["question"]}]
        if system is not None:
            messages.insert(0, {"role": "system", "content": rg.utils.SYSTEM_PROMPTS[system]})
        out.append((i, {"prompt": messages, "ground_truth": ground_truth(name, config, entry),
                        "data_source": name, "extra_info": {"index": i}}))
    return out, dropped


def ground_truth(name: str, config: dict[str, Any], entry: dict[str, Any]) -> str:
    """The row's ground truth: what :func:`verify_gym` needs to rebuild the scorer and its entry."""
    try:
        return json.dumps({"dataset": name, "config": config, "entry": entry}, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise DataError(f"reasoning_gym:{name}: an item's metadata is not JSON ({exc}), so it cannot "
                        "travel in a row to be scored; this task is not supported") from None


@functools.lru_cache(maxsize=64)
def _scorer(name: str, config_json: str) -> Any:
    return make_dataset(name, json.loads(config_json), seed=0, size=1).score_answer


def library_score(response_text: str, truth: str) -> float:
    """The library's score of a response: ``score_answer(extract_answer(response), entry)``."""
    rg = library()
    try:
        row = json.loads(truth)
        name, config, entry = row["dataset"], row["config"], row["entry"]
    except (ValueError, TypeError, KeyError):
        raise DataError(f"{REWARD} scores rows of a reasoning_gym: source; this row's ground truth is "
                        f"{truth[:60]!r}") from None
    score_answer = _scorer(name, json.dumps(config, sort_keys=True))
    return float(score_answer(rg.utils.extract_answer(response_text), entry))


def verify_gym(response_text: str, truth: str, *, correct: float = 1.0, wrong: float = 0.0) -> float:
    """The library's score mapped onto [wrong, correct]: exactly ``correct`` at 1, ``wrong`` at 0."""
    score = library_score(response_text, truth)
    if score >= 1.0:
        return correct
    return wrong if score <= 0.0 else wrong + (correct - wrong) * score


def overlap_problem(name: str, train: tuple[int, int], val: tuple[int, int]) -> str:
    """Why two splits (seed, size) of one task's config would share items ('' when they do not)."""
    (ts, tn), (vs, vn) = train, val
    if ts < vs + vn and vs < ts + tn:
        return (f"reasoning_gym:{name}: the val items' seeds {vs}..{vs + vn - 1} overlap the train "
                f"items' {ts}..{ts + tn - 1} (item i is drawn from seed + i): the splits would share items")
    return ""
