"""A prompt budget: how many tokens a prompt may have, and what happens to a longer one. The
data loaders (``dapo_flow.data.prompts``, ``dapo_flow.data.stream``) apply one; the graph's
`data:` block and its generating models' contexts decide it (``dapo_flow.graph.prompt_room``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Overlong = Literal["error", "filter", "left", "right"]


@dataclass(frozen=True)
class PromptBudget:
    """At most ``tokens`` prompt tokens. A longer prompt: ``error``, a bad row (the source's
    on_bad_row decides); ``filter``, dropped and counted; ``left``, its last ``tokens`` kept;
    ``right``, its first. ``name`` says what set the bound, ``fix`` how to let a row through
    (both for the messages)."""

    tokens: int
    overlong: Overlong = "error"
    name: str = "max_prompt_tokens"
    fix: str = "raise max_prompt_tokens or shorten the prompt"

    @classmethod
    def of_source(cls, tokens: int) -> "PromptBudget":
        """A source's own ``max_prompt_tokens``, longer prompts bad rows (the loaders' shorthand)."""
        return cls(tokens, "error", f"max_prompt_tokens={tokens}")

    def fit(self, ids: list[int]) -> list[int]:
        """The token ids kept of a prompt over the budget (``left``/``right``; verl keeps
        ``ids[-n:]`` / ``ids[:n]``, the BOS too when it is cut off)."""
        return list(ids[-self.tokens:]) if self.overlong == "left" else list(ids[: self.tokens])
