"""How much room a graph leaves a prompt: the prompt budget it declares, or the room its generating
models' contexts leave beside max_tokens; and what happens to a longer prompt. The result is a
:class:`~dapo_flow.data.prompt_budget.PromptBudget`, which the data loaders apply.

A graph sets it in its `data:` block with verl's names (`max_prompt_length`, `truncation`,
`filter_overlong_prompts`), or per source (`max_prompt_tokens`, which takes the place of
`max_prompt_length` for that source). Without either, a prompt may take the room its generating
model's context leaves beside the generate node's `max_tokens`: either way no row longer than the
model's context reaches a forward pass. ``validate`` refuses a budget that does not fit the
context; the data loaders (``dapo_flow.data.prompts``) apply what :func:`source_budget` returns
(``Plan.prompt_budget`` for a planned graph); the memory estimate sizes rows by the budget plus
``max_tokens`` (``Plan.engine_context``).

Pure and light (no torch, no tokenizer): a model's context comes from its config.json.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Mapping

from dapo_flow.data.prompt_budget import Overlong, PromptBudget
from dapo_flow.errors import DataError

if TYPE_CHECKING:
    from dapo_flow.graph.spec import DataSourceSpec, DataSpec, ModelSpec


@dataclass(frozen=True)
class Room:
    """What generate node ``node``'s model context leaves for a prompt beside its max_tokens."""

    node: str
    model: str
    context: int  # max_position_embeddings of the model's config.json
    max_tokens: int

    @property
    def tokens(self) -> int:
        return self.context - self.max_tokens

    def describe(self) -> str:
        return (f"{self.tokens}, the room model '{self.model}''s context of {self.context} positions leaves "
                f"beside generate node '{self.node}''s max_tokens {self.max_tokens}")


def model_context(model: "ModelSpec") -> int | None:
    """The longest row ``model`` takes (max_position_embeddings of its config.json, a builtin's
    declared shape); None when there is no config to read yet."""
    from dapo_flow.models import model_config  # light: json only

    config = model_config(model.path) or {}
    try:
        return int(config["max_position_embeddings"])
    except (KeyError, TypeError, ValueError):
        return None


def rooms(generators: Iterable[tuple[str, str | None, object]], models: Mapping[str, "ModelSpec"]) -> list[Room]:
    """One :class:`Room` per generate node ``(node id, model, max_tokens)`` whose model's context
    is known and whose max_tokens is a number."""
    out = []
    for node, model, max_tokens in generators:
        if model in models and isinstance(max_tokens, int) and not isinstance(max_tokens, bool):
            context = model_context(models[model])
            if context is not None:
                out.append(Room(node, model, context, max_tokens))
    return out


def tightest(found: Iterable[Room]) -> Room | None:
    """The room that bounds every generator's prompts (the train source feeds them all)."""
    return min(found, key=lambda r: r.tokens, default=None)


def declared(data: "DataSpec", src: "DataSourceSpec") -> int | None:
    """The budget a graph declares for ``src``: its own max_prompt_tokens, else data.max_prompt_length."""
    return src.max_prompt_tokens if src.max_prompt_tokens is not None else data.max_prompt_length


def declared_for_all(data: "DataSpec") -> int | None:
    """The largest declared budget over the sources; None when a source declares none (its
    prompts are then bounded by the context alone)."""
    budgets = [declared(data, s) for s in (data.train, data.val) if s is not None]
    return None if None in budgets else max(b for b in budgets if b is not None)


def source_budget(data: "DataSpec", src: "DataSourceSpec", room: Room | None) -> PromptBudget | None:
    """What bounds ``src``'s prompts, and how a longer one is handled: the declared budget with
    data.truncation / filter_overlong_prompts, else the room the context leaves (a longer prompt a
    bad row), else nothing (no generator, or no config to read)."""
    overlong: Overlong = "filter" if data.filter_overlong_prompts else data.truncation
    if src.max_prompt_tokens is not None:
        budget = PromptBudget(src.max_prompt_tokens, overlong, f"max_prompt_tokens={src.max_prompt_tokens}",
                              _fix("raise max_prompt_tokens", overlong))
    elif data.max_prompt_length is not None:
        budget = PromptBudget(data.max_prompt_length, overlong, f"data.max_prompt_length={data.max_prompt_length}",
                              _fix("raise data.max_prompt_length", overlong))
    elif room is not None:
        if room.tokens < 1:  # validate refuses this first
            raise DataError(f"generate node '{room.node}''s max_tokens {room.max_tokens} fills model "
                            f"'{room.model}''s whole context of {room.context}: no prompt fits beside it")
        return PromptBudget(room.tokens, "error", room.describe(),
                            f"set data.max_prompt_length with data.truncation: left or right (or "
                            f"data.filter_overlong_prompts: true), lower max_tokens of '{room.node}', or "
                            "shorten the prompt")
    else:
        return None
    if room is not None and budget.tokens > room.tokens:  # validate refuses this first; never let it through
        raise DataError(overrun(budget.name, budget.tokens, room)[0])
    return budget


def _fix(raise_it: str, overlong: Overlong) -> str:
    if overlong != "error":
        return f"{raise_it} or shorten the prompt"
    return (f"{raise_it}, shorten the prompt, or set data.truncation: left or right (keep its last or first "
            "tokens) or data.filter_overlong_prompts: true (drop such prompts)")


def overrun(setting: str, tokens: int, room: Room) -> tuple[str, str]:
    """(message, fix) for a budget ``setting`` of ``tokens`` that leaves rows longer than the context."""
    message = (f"a prompt of up to {tokens} tokens ({setting}) and generate node '{room.node}''s max_tokens "
               f"{room.max_tokens} make rows of {tokens + room.max_tokens} positions, more than model "
               f"'{room.model}''s context of {room.context} (max_position_embeddings)")
    fixes = [f"set {setting} to at most {room.tokens}"] if room.tokens > 0 else []
    fixes.append(f"max_tokens of '{room.node}' to at most {room.context - tokens}" if room.context > tokens
                 else "use a model with a longer context")
    return message, ", or ".join(fixes)


def budget_problems(data: "DataSpec", found: list[Room]) -> list[tuple[tuple, str, str]]:
    """(path in the graph, message, fix) for each declared budget that does not fit beside a
    generator's max_tokens in its model's context, and each generator whose max_tokens alone fills
    its model's context."""
    out: list[tuple[tuple, str, str]] = []
    for room in found:
        if room.tokens < 1:
            out.append((("nodes", room.node, "params", "max_tokens"),
                        f"max_tokens {room.max_tokens} of generate node '{room.node}' fills model "
                        f"'{room.model}''s whole context of {room.context} positions: no prompt fits beside it",
                        f"max_tokens below {room.context}"))
    room = tightest(r for r in found if r.tokens >= 1)
    if room is None:
        return out
    settings: dict[tuple, tuple[str, int]] = {}
    for which, src in (("train", data.train), ("val", data.val)):
        if src is None:
            continue
        if src.max_prompt_tokens is not None:
            settings[("data", which, "max_prompt_tokens")] = (f"data.{which}.max_prompt_tokens", src.max_prompt_tokens)
        elif data.max_prompt_length is not None:
            settings[("data", "max_prompt_length")] = ("data.max_prompt_length", data.max_prompt_length)
    for path, (setting, tokens) in settings.items():
        if tokens > room.tokens:
            out.append((path, *overrun(setting, tokens, room)))
    return out

