"""Concurrent requests gathered into batched engine calls, from one thread.

The engine is called from a single thread (it is not shared between calls). A request waits in
a queue; the thread takes the first, then keeps taking requests while they come within
``window_s`` of each other (up to ``max_batch``), groups them by sampling settings and makes
one ``generate`` call per group: requests arriving while a batch runs form the next batch.
With an ``expected`` count (the episodes of a harness node between two requests), the wait
stretches to ``expect_window_s`` (or half the last call's time, if longer) while more may come,
and ends once none may. A
group samples up to its largest ``max_tokens`` and each request keeps its own first
``max_tokens`` tokens: a sample's tokens come from its own seeded stream
(:func:`dapo_flow.models.sampling.sample_keys`), so they are what a call with that
``max_tokens`` alone would sample.

Threads: the engine computes on the process's torch threads less ``spare_threads``, left to the
harness clients that share the process (OpenMP's workers spin at each op's barrier, and with
fewer cores than runnable threads a barrier waits on a descheduled worker). With ``all_waiting``
(the episodes' book), a call during which no client can run, every open episode waiting on the
engine, takes every thread: the spare one would idle. The count is set per call in the batcher's
thread (OpenMP's count is per thread; a switch costs ~2 us). The tokens sampled were the same on
1 and 2 threads where checked; the logprobs' last bits are not (~1e-6: torch's CPU attention
rounds differently on another count), so they depend on which calls found every client waiting.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections import defaultdict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

from dapo_flow.endpoint.episodes import Sampled
from dapo_flow.models.sampling import SamplingConfig


class QueueFull(Exception):
    """More requests wait than the batcher holds."""


@dataclass(frozen=True)
class SamplingKey:
    """The settings requests must share to go in one engine call."""

    n: int
    temperature: float
    top_p: float
    top_k: int = -1


@dataclass(frozen=True)
class _Job:
    prompt: list[int]
    key: SamplingKey
    max_tokens: int
    seed: int
    future: Future = field(default_factory=Future)


@dataclass
class BatchStats:
    calls: int = 0  # engine generate calls
    requests: int = 0
    tokens: int = 0
    seconds: float = 0.0  # inside generate
    all_threads: int = 0  # calls run on every thread, none spared (every client waiting on them)
    batch_sizes: list[int] = field(default_factory=list)


class Batcher:
    """``submit`` from any thread; the engine runs in this batcher's thread."""

    def __init__(self, engine: Any, *, window_s: float = 0.005, max_batch: int = 512, max_queue: int = 4096,
                 expected: Callable[[], int] | None = None, expect_window_s: float = 0.05,
                 spare_threads: int = 0, all_waiting: Callable[[int], bool] | None = None):
        self.engine = engine
        self.window_s, self.max_batch, self.max_queue = window_s, max_batch, max_queue
        # how many more requests may come soon (episodes between two requests): while some may,
        # the batch waits up to expect_window_s for the next, so a round's requests go together
        self.expected, self.expect_window_s = expected, expect_window_s
        self.stats = BatchStats()
        self._last_call_s = 0.0
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        # torch threads for the engine: the process's, less ``spare_threads`` (at least one) left to
        # the threads that share this process and run Python (harness clients, the HTTP server):
        # OpenMP's workers spin at each op's barrier, and with a thread fewer cores than runnable
        # threads a barrier waits on a descheduled worker (tiny-agent's 256-episode round: 0.7 s
        # of engine time on 1 thread of 2 cores, 11-17 s on 2). ``all_waiting(held)``: whether no
        # client can run during a call (the batcher holding ``held`` requests); then it takes all
        self._process = _torch_threads()
        self._threads = max(1, self._process - spare_threads) if self._process else 0
        self.all_waiting = all_waiting
        self._thread = threading.Thread(target=self._loop, name="endpoint-batcher", daemon=True)
        self._thread.start()

    def submit(self, prompt: list[int], key: SamplingKey, max_tokens: int, seed: int) -> Future:
        """A future of the request's ``key.n`` completions (:class:`Sampled`, in order)."""
        if self._queue.qsize() >= self.max_queue:
            raise QueueFull(f"{self.max_queue} requests already wait for the engine")
        job = _Job(list(prompt), key, max_tokens, seed)
        self._queue.put(job)
        return job.future

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        while (job := self._queue.get()) is not None:
            jobs = [job]
            stop = False
            while len(jobs) < self.max_batch:
                coming = self.expected() if self.expected is not None else 0
                # while more may come, wait up to half what the last call took: a call costs about
                # the same for one row as for a hundred (each decode step's fixed cost dominates)
                wait = max(self.expect_window_s, self._last_call_s / 2) if coming > 0 else self.window_s
                try:
                    nxt = self._queue.get(timeout=wait)
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                jobs.append(nxt)
            groups: dict[SamplingKey, list[_Job]] = defaultdict(list)
            for j in jobs:
                groups[j.key].append(j)
            held = len(jobs)
            for key, group in groups.items():
                self._run(key, group, held + self._queue.qsize())
                held -= len(group)
            if stop:
                return

    def threads_for_call(self, held: int) -> int:
        """Torch threads for the next engine call, the batcher holding ``held`` requests (0: leave
        the count as it is, torch absent)."""
        if self.all_waiting is not None and self.all_waiting(held):
            return self._process  # the spare threads' clients all wait on this call: they would idle
        return self._threads

    def _run(self, key: SamplingKey, jobs: list[_Job], held: int) -> None:
        threads = self.threads_for_call(held)
        if threads:  # OpenMP's count is per thread (this one started at the library default)
            from dapo_flow.threads import set_torch_threads

            set_torch_threads(threads)
        cfg = SamplingConfig(n=key.n, temperature=key.temperature, top_p=key.top_p, top_k=key.top_k,
                             max_tokens=max(j.max_tokens for j in jobs), prompt_seeds=tuple(j.seed for j in jobs))
        start = time.perf_counter()
        try:
            rolled = self.engine.generate([j.prompt for j in jobs], cfg)
            versions = rolled.token_versions(self.engine.weights_version)
        except Exception as exc:  # noqa: BLE001 - every waiting request hears of it
            for j in jobs:
                j.future.set_exception(exc)
            return
        s = self.stats
        self._last_call_s = time.perf_counter() - start
        s.calls += 1
        s.all_threads += int(threads == self._process > self._threads)
        s.requests += len(jobs)
        s.tokens += int(rolled.tokens_generated)
        s.seconds += time.perf_counter() - start
        s.batch_sizes.append(len(jobs))
        for i, j in enumerate(jobs):
            rows = range(i * key.n, (i + 1) * key.n)
            j.future.set_result([_cut(rolled.response_ids[r], rolled.logprobs[r], versions[r],
                                      bool(rolled.truncated[r]), j.max_tokens) for r in rows])


def _cut(ids: list[int], logprobs: list[float], versions: list[int], truncated: bool, limit: int) -> Sampled:
    """A sample's first ``limit`` tokens (truncated when that cuts it)."""
    return Sampled(list(ids[:limit]), [float(x) for x in logprobs[:limit]], [int(v) for v in versions[:limit]],
                   truncated or len(ids) > limit)


def _torch_threads() -> int:
    """The torch intra-op threads of the calling thread (the process's setting), 0 without torch."""
    torch = sys.modules.get("torch")
    return torch.get_num_threads() if torch is not None else 0
