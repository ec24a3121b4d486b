"""One sampled conversation's state, and the transitions of its state machine (pure: no engine,
no tool; :mod:`dapo_flow.agent.rollout` feeds it what they return).

    PENDING --start--> RUNNING --turn(calls)--> TOOL_CALLING --observe--> RUNNING ...
                          |                          |
                          +--turn(answer / length / max_turns)--> COMPLETED
                                                     +--observe(over budget, or done)--> COMPLETED

The response is a flat token list: the model's turns (``loss_mask`` 1, their rollout
logprobs) and the observations between them (``loss_mask`` 0, logprob 0). A response never
ends inside an observation: one that would not fit the budget ends the request instead, so the
last token (where the reward lands) is always the model's. An environment that ends the
episode (a call's ``done``) completes the request after that turn, its last observation unshown.

Under routing replay the request also keeps each prompt and response token's expert choices
(:attr:`Request.routes`, laid out as a single-turn rollout's: :attr:`Rollouts.routes`), stitched
from its turns' engine calls (:meth:`Request.turn`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from dapo_flow.tools.calls import ParsedCalls


class Status(enum.Enum):
    PENDING = "pending"
    RUNNING = "running"
    TOOL_CALLING = "tool_calling"
    COMPLETED = "completed"


#: why a request completed
STOPS = ("answer", "length", "max_turns", "done")


class TransitionError(RuntimeError):
    """A transition asked of a request in the wrong state (a bug in the driver, not user input)."""


@dataclass
class Request:
    """Sample ``sample_idx`` of prompt row ``row``; ``seed`` seeds its turns."""

    row: int
    sample_idx: int
    prompt_ids: list[int]
    seed: int
    budget: int  # response tokens in all, turns and observations
    max_turns: int
    status: Status = Status.PENDING
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # per token: the policy version that sampled it
    turns: int = 0
    turn_tokens: list[int] = field(default_factory=list)  # tokens of each model turn
    tool_calls: int = 0  # calls run
    tool_attempts: int = 0  # calls written: run, or refused (malformed, unknown tool, bad arguments, too many)
    tool_errors: int = 0  # calls that failed: malformed, unknown tool, bad arguments, raised, timed out
    segments: list[tuple[str, int, int]] = field(default_factory=list)  # ("assistant" | "tool", start, end) spans
    calls: ParsedCalls | None = None  # the current turn's, while TOOL_CALLING
    stop: str = ""  # one of STOPS once COMPLETED
    truncated: bool = False  # ended by the budget, not by the model
    # under routing replay: each prompt and response token's experts, -1 where none was recorded
    # (the last token, when never fed to the model), and the weights version that routed them.
    # Shape: (len(prompt) + len(response), layers, top_k) int16
    routes: np.ndarray | None = None
    routes_version: int = -1

    @property
    def context(self) -> list[int]:
        """What the engine continues: the prompt and the response so far."""
        return self.prompt_ids + self.response_ids

    @property
    def remaining(self) -> int:
        return self.budget - len(self.response_ids)

    def _expect(self, status: Status, what: str) -> None:
        if self.status is not status:
            raise TransitionError(f"request {self.row}/{self.sample_idx}: {what} in state {self.status.value}")

    def start(self) -> None:
        self._expect(Status.PENDING, "start")
        self.status = Status.RUNNING

    def turn(self, tokens: list[int], logprobs: list[float], finished: bool, calls: ParsedCalls,
             versions: list[int] | None = None, routes: np.ndarray | None = None, routes_version: int = 0) -> None:
        """The model's turn: ``tokens`` as the engine produced them (EOS included when it ended
        the turn: ``finished``), and the tool calls parsed from their text; ``versions``: each
        token's policy version (None: the version of the response so far, 0 at first);
        ``routes``: the engine call's expert choices for :attr:`context` and ``tokens``, by the
        weights of version ``routes_version`` (:meth:`_stitch_routes`).
        Shape: routes (len(context) + len(tokens), layers, top_k)."""
        self._expect(Status.RUNNING, "a model turn")
        finished = finished and len(tokens) <= self.remaining  # a turn past the budget is cut: a length stop
        if versions is None:
            versions = [self.versions[-1] if self.versions else 0] * len(tokens)
        tokens, logprobs = list(tokens[: self.remaining]), list(logprobs[: self.remaining])
        self.segments.append(("assistant", len(self.response_ids), len(self.response_ids) + len(tokens)))
        self.response_ids += tokens
        self.logprobs += logprobs
        self.versions += list(versions[: len(tokens)])
        self.loss_mask += [1] * len(tokens)
        self.turns += 1
        self.turn_tokens.append(len(tokens))
        if routes is not None:
            self._stitch_routes(routes, routes_version)
        if not finished:
            self._complete("length", truncated=True)
        elif not calls.asked_for_tools:
            self._complete("answer")
        elif self.turns >= self.max_turns:
            self._complete("max_turns")
        else:
            self.calls = calls
            self.status = Status.TOOL_CALLING

    def observe(self, tokens: list[int], calls_run: int, errors: int, attempts: int | None = None,
                done: bool = False) -> None:
        """The tools' responses to the turn's calls, as tokens; over the budget (room must stay
        for at least one model token after it), or ``done`` (an environment ended the episode),
        the request ends instead."""
        self._expect(Status.TOOL_CALLING, "an observation")
        self.calls = None
        self.tool_calls += calls_run
        self.tool_attempts += calls_run if attempts is None else attempts
        self.tool_errors += errors
        if done:
            self._complete("done")
            return
        if len(tokens) >= self.remaining:
            self._complete("length", truncated=True)
            return
        self.segments.append(("tool", len(self.response_ids), len(self.response_ids) + len(tokens)))
        self.response_ids += tokens
        self.logprobs += [0.0] * len(tokens)
        self.versions += [self.versions[-1] if self.versions else 0] * len(tokens)  # the turn they answer
        self.loss_mask += [0] * len(tokens)
        self.status = Status.RUNNING

    def _stitch_routes(self, routes: np.ndarray, version: int) -> None:
        """Each token keeps the experts of the forward that first processed it: the prompt's at
        the first turn's prefill, a model token's at its decode step, a tool token's (and the
        previous turn's last token, when no later decode step fed it) at the next turn's
        prefill. Every turn re-prefills the whole context, which routes the earlier tokens anew;
        in float32 with the same weights they go where they went before, but under bf16 the
        prefill's rounding may flip a near-tie. No single record then matches every turn's
        forward (a later turn's tokens saw the re-prefill's); the first is kept: the one its own
        turn's tokens were sampled with, and the one a prefix-caching engine (which never
        re-prefills) would keep. A turn routed by other weights (``version``: a sync between or
        inside turns) replaces the whole record, as a recomputed cache does within one engine
        call (:class:`~dapo_flow.models.moe.RouteLog`).
        Shape: routes (len(context) + len(turn tokens, uncut), layers, top_k)."""
        fresh = np.array(routes[: len(self.prompt_ids) + len(self.response_ids)])  # the turn's cut tokens dropped
        if self.routes is not None and version == self.routes_version:
            earlier = fresh[: len(self.routes)]  # a view: written through
            seen = self.routes[:, 0, 0] >= 0
            earlier[seen] = self.routes[seen]
        self.routes, self.routes_version = fresh, version

    def _complete(self, stop: str, truncated: bool = False) -> None:
        self.status, self.stop, self.truncated = Status.COMPLETED, stop, truncated
