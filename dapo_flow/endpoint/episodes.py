"""Token-exact episodes: what the endpoint fed and sampled, assembled into one training sequence.

An episode is one sample of a harness: the requests it sends under one episode id. The first
request's prompt ids are the sequence's prompt. Every later request must continue what the
model saw and wrote so far (prompt + completion + ...): its prompt ids extend that context, and
the tokens it adds (tool results, user turns) go into the response with loss mask 0, the
sampled tokens with loss mask 1, so training never re-tokenizes a transcript.

"Continues" (:func:`continuation`), in the order tried:
1. the new prompt ids start with the context's ids (a chat template re-rendering the assistant
   turn as it was sampled);
2. they start with the context less its final EOS: OpenAI's text leaves the stop token out, so a
   harness that appends to the text it got drops it; the model sampled it, so it is fed back;
3. a prefix of the new ids decodes to the same text as the context (a tokenizer that splits the
   same text differently: re-tokenization drift); the sampled ids are kept, the rest appended.

A request that continues none of them rewrote history (dropped or edited a turn): the episode
is *masked* (loss mask 0 on every token), not cut at the last consistent point, because the
harness's reward judges turns the sequence would not hold. Its later requests are served and
not recorded. So are requests over the per-episode cap (HTTP 429, the sample masked). A request
with ``n > 1`` leaves ``n`` candidate continuations; the next request picks the one it extends
(the first when the episode ends there).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

DRIFT_TOKENS = 8  # how far a re-tokenized prefix's length may stray from the sampled one's

#: why a sample is masked (each is counted in the operator's metrics)
MASK_REASONS = ("no_model_call", "rewritten", "request_cap", "harness_error", "timeout")


class EpisodeError(Exception):
    """A request the episode refuses: ``status`` is its HTTP status."""

    def __init__(self, status: int, message: str, code: str):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


@dataclass(frozen=True)
class Sampled:
    """One completion as the engine sampled it (EOS included when sampled)."""

    ids: list[int]
    logprobs: list[float]
    versions: list[int]
    truncated: bool


@dataclass(frozen=True)
class Admitted:
    """What to feed the engine for an admitted request: ``fed`` ids, at most ``max_tokens``
    new ones, seeded ``seed``; ``recorded``: whether its completion joins the episode."""

    fed: list[int]
    max_tokens: int
    seed: int
    recorded: bool


@dataclass(frozen=True)
class EpisodeRecord:
    """An episode as one training row (shapes: response_ids, logprobs, versions, loss_mask are one
    value per response token)."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    loss_mask: list[int]
    truncated: bool
    requests: int
    completions: int
    masked: str  # "" or one of MASK_REASONS

    @property
    def training_mask(self) -> list[int]:
        """``loss_mask``, or all 0 when the sample is masked: nothing is trained on what was not
        sampled, nor on a sample whose reward judges turns the sequence does not hold."""
        return [0] * len(self.loss_mask) if self.masked else list(self.loss_mask)


def continuation(context: list[int], new: list[int], eos_ids: set[int],
                 decode: Callable[[list[int]], str]) -> list[int] | None:
    """The ids to feed for a prompt ``new`` that continues ``context`` (module docstring), else None."""
    if new[: len(context)] == context:
        return list(new)
    core = context[:-1] if context and context[-1] in eos_ids else context
    if len(core) < len(context) and new[: len(core)] == core:
        return context + new[len(core):]
    target = decode(core)
    for k in range(max(1, len(core) - DRIFT_TOKENS), min(len(new), len(core) + DRIFT_TOKENS) + 1):
        if decode(new[:k]) == target:
            return context + new[k:]
    return None


@dataclass
class Episode:
    id: str
    seed: int
    max_requests: int
    budget: int  # response tokens in all: completions and inserted tokens
    prompt_ids: list[int] | None = None
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    pending: list[Sampled] = field(default_factory=list)  # the last request's completions
    requests: int = 0
    completions: int = 0
    in_flight: bool = False
    closed: bool = False
    masked: str = ""
    spent: bool = False  # a request found the budget spent (413): the sample is truncated there

    def context(self, choice: int) -> list[int]:
        return (self.prompt_ids or []) + self.response_ids + self.pending[choice].ids

    def admit(self, prompt_ids: list[int], eos_ids: set[int], decode: Callable[[list[int]], str],
              seed_of: Callable[[int, int], int]) -> Admitted:
        if self.closed:
            raise EpisodeError(410, f"episode '{self.id}' has ended (its harness call returned or timed "
                               "out); requests after that are not served", "episode_ended")
        if self.in_flight:
            raise EpisodeError(409, f"episode '{self.id}' has a request in flight: an episode's requests "
                               "form one sequence, send them one after another", "episode_busy")
        if self.requests >= self.max_requests:
            self.masked = self.masked or "request_cap"
            raise EpisodeError(429, f"episode '{self.id}' made {self.requests} requests, its cap "
                               f"(max_requests); the sample is masked", "request_cap")
        seed = seed_of(self.seed, self.requests)
        self.requests += 1
        if self.masked:  # rewritten or capped: served, never recorded
            return Admitted(list(prompt_ids), self.budget, seed, recorded=False)
        if self.prompt_ids is not None:
            fed = None
            for choice in range(len(self.pending)):
                fed = continuation(self.context(choice), prompt_ids, eos_ids, decode)
                if fed is not None:
                    self._commit(choice, fed)
                    break
            if fed is None:
                self.masked = "rewritten"
                return Admitted(list(prompt_ids), self.budget, seed, recorded=False)
        else:
            fed = list(prompt_ids)
        remaining = self.budget - len(self.response_ids)
        if remaining < 1:
            self.spent = True
            raise EpisodeError(413, f"episode '{self.id}' has spent its budget of {self.budget} response "
                               "tokens (max_tokens of the harness node)", "episode_budget")
        self.in_flight = True
        return Admitted(fed, remaining, seed, recorded=True)

    def _commit(self, choice: int, fed: list[int]) -> None:
        """The chosen completion (loss mask 1), then what the harness put after it (mask 0)."""
        s = self.pending[choice]
        self.response_ids += s.ids
        self.logprobs += s.logprobs
        self.versions += s.versions
        self.loss_mask += [1] * len(s.ids)
        inserted = fed[len(self.prompt_ids or []) + len(self.response_ids):]
        version = self.versions[-1] if self.versions else 0
        self.response_ids += inserted
        self.logprobs += [0.0] * len(inserted)
        self.versions += [version] * len(inserted)
        self.loss_mask += [0] * len(inserted)
        self.pending = []

    def record(self, fed: list[int], choices: list[Sampled]) -> None:
        if self.masked:  # rewritten or capped: the sequence stays at its last consistent point
            return
        if self.prompt_ids is None:
            self.prompt_ids = list(fed)
        self.pending = list(choices)
        self.completions += 1
        self.in_flight = False

    def fail(self) -> None:
        """The admitted request's generation failed: nothing of it is recorded."""
        self.in_flight = False

    def result(self, masked: str = "") -> EpisodeRecord:
        """The episode as one row; ``masked``: a reason from the harness's side (error, timeout)."""
        response, logps, versions, mask = (list(self.response_ids), list(self.logprobs),
                                           list(self.versions), list(self.loss_mask))
        truncated = False
        if self.pending:
            s = self.pending[0]
            response, logps, versions, mask = (response + s.ids, logps + s.logprobs, versions + s.versions,
                                               mask + [1] * len(s.ids))
            truncated = s.truncated
        while mask and mask[-1] == 0:  # tokens inserted after the last completion: no request followed
            for column in (response, logps, versions, mask):
                column.pop()
        if self.spent:  # ran out of budget, as generate's max_tokens: truncated, not a harness failure
            truncated, masked = True, "" if masked == "harness_error" else masked
        reason = self.masked or masked or ("" if self.completions else "no_model_call")
        return EpisodeRecord(list(self.prompt_ids or []), response, logps, versions, mask, truncated,
                             self.requests, self.completions, reason)


class EpisodeBook:
    """The episodes the endpoint records, by id, safe to use from the server's threads. Requests
    naming no registered episode are served and counted in :attr:`unrecorded`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._episodes: dict[str, Episode] = {}
        self._ended: set[str] = set()
        self.unrecorded = 0

    def register(self, episode_id: str, seed: int, max_requests: int, budget: int) -> None:
        with self._lock:
            self._episodes[episode_id] = Episode(episode_id, seed, max_requests, budget)

    def admit(self, episode_id: str | None, prompt_ids: list[int], eos_ids: set[int],
              decode: Callable[[list[int]], str], seed_of: Callable[[int, int], int]) -> Admitted | None:
        """None when the request belongs to no registered episode."""
        with self._lock:
            episode = self._episodes.get(episode_id) if episode_id else None
            if episode is None and episode_id in self._ended:
                raise EpisodeError(410, f"episode '{episode_id}' has ended (its harness call returned or "
                                   "timed out); requests after that are not served", "episode_ended")
            if episode is None:
                self.unrecorded += 1
                return None
            return episode.admit(prompt_ids, eos_ids, decode, seed_of)

    def record(self, episode_id: str, fed: list[int], choices: list[Sampled]) -> None:
        with self._lock:
            episode = self._episodes.get(episode_id)
            if episode is not None and not episode.closed:
                episode.record(fed, choices)

    def expected(self) -> int:
        """Open episodes without a request in flight: those that may send one soon."""
        with self._lock:
            return sum(not e.in_flight for e in self._episodes.values())

    def all_waiting(self, held: int) -> bool:
        """Whether every open episode waits on the engine: each has a request in flight, and
        ``held`` (the requests the batcher holds: the batch it is about to run and its queue)
        covers them all, so no harness is between two requests (thinking, running a tool) and no
        request is between its admission and the batcher. False with no open episode."""
        with self._lock:
            in_flight = sum(e.in_flight for e in self._episodes.values())
            return 0 < in_flight == len(self._episodes) and held >= in_flight

    def fail(self, episode_id: str, spent: bool = False) -> None:
        """The admitted request was not sampled; ``spent``: it would not fit the model's context."""
        with self._lock:
            if (episode := self._episodes.get(episode_id)) is not None:
                episode.fail()
                episode.spent = episode.spent or spent

    def finish(self, episode_id: str, masked: str = "") -> EpisodeRecord:
        """End the episode (later requests get 410) and return its row."""
        with self._lock:
            episode = self._episodes.pop(episode_id)
            episode.closed = True
            self._ended.add(episode_id)
            return episode.result(masked)
