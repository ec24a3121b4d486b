"""Reward functions applied row by row: in this process, or in a pool of worker processes.

``evaluate`` turns one reward-function call into checked numbers (or a ``BadReward`` naming
what the function did); the ``score`` operator uses it in-process (``workers: 0``) and every
worker runs the very same code, so both paths give the same floats.

``RewardPool`` keeps N spawned worker processes for as long as its owner lives (spawn, not
fork: the driver has Ray/torch threads). Each worker builds the reward function once, from the
same ``module:fn`` / ``file.py:fn`` string as the driver. Rows travel in chunks (one message
each way per chunk, never per row); results come back in row order. Per-sample timeout: before
each row a worker writes the row's start time and position to a small shared array; the driver
waits on the workers' pipes with a deadline, and a row past ``timeout_s`` gets its worker
killed (SIGKILL: nothing else stops a function stuck in C code, e.g. ``2**10**10``) and
replaced. That row is reported as timed out; the rest of its chunk, the rows scored before it
included (their results died with the process), goes to the front of the queue, so a reward
function with side effects may see those rows twice.

Not pebble: its timeout is per task, and with rows sent in chunks it would time a whole chunk
without telling which row hung; one task per row would pay an IPC round trip per row.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import numbers
import signal
import time
import weakref
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from dapo_flow.errors import RunError

FLOAT32_MAX = float(np.finfo(np.float32).max)
CHUNKS_PER_WORKER = 4  # enough chunks to even out uneven rows, few enough to amortize the IPC
MAX_CHUNK = 256  # bounds what a killed worker's chunk re-scores

TOOL_REWARD_RULE = "builtin:tool-reward"

# A row's outcome: (score, acc, extras) once checked, a BadReward's text, or None: timed out.
Row = tuple[float, float, tuple[float, ...]] | str | None


@dataclass(frozen=True)
class RewardSpec:
    """What any process needs to build the reward function (picklable: workers get a copy)."""

    reward: str
    correct: float = 1.0
    wrong: float = -1.0
    extra_columns: tuple[str, ...] = ()
    base_dir: str | None = None  # a relative `file.py:fn` resolves here: the driver's cwd at start

    @property
    def builtin(self) -> bool:
        return self.reward.startswith("builtin:")


class BadReward(Exception):
    """A reward function misbehaved on one row; the text ends "reward function F {text} for
    SAMPLE" in the operator's error."""


HARNESS = "builtin:harness"


def harness_score(reward: float | None, wrong: float) -> dict[str, float]:
    """``builtin:harness``: the harness's reward as the score (``wrong`` where it gave none or the
    sample is masked: NaN); acc is score > 0."""
    score = wrong if reward is None or not np.isfinite(reward) else float(reward)
    return {"score": score, "acc": float(np.float32(score) > 0)}


def resolve_reward(spec: RewardSpec) -> Callable[[str, str, dict], Any]:
    """The function ``spec.reward`` names, taking (response_text, ground_truth, extra_info).
    A function with verl's signature, ``compute_score(data_source, solution_str, ground_truth,
    extra_info=None)`` (told apart by its ``solution_str`` parameter), is called that way, with
    the row's ``data_source`` (extra_info's) and the rest of extra_info, so verl reward files
    work unchanged."""
    from dapo_flow.data import chain_task, reasoning_gym, tasks, tool_arith
    from dapo_flow.core.imports import load_object

    builtins = {"builtin:addition": tasks.verify_addition, "builtin:math": tasks.verify_math,
                "builtin:chain": chain_task.verify_chain, tool_arith.TOOL_ARITH: tool_arith.verify_tool_arith,
                reasoning_gym.REWARD: reasoning_gym.verify_gym}
    if spec.reward == HARNESS:  # harness-generate's own reward (score's extra_info carries it)
        return lambda _text, _truth, extra: harness_score(extra.get("harness_reward"), spec.wrong)
    if spec.reward in builtins:
        verify = builtins[spec.reward]
        return lambda text, truth, _extra: verify(text, truth, correct=spec.correct, wrong=spec.wrong)
    if spec.reward == TOOL_REWARD_RULE:
        return tool_reward_score
    fn = load_object(spec.reward, base_dir=None if spec.base_dir is None else Path(spec.base_dir))
    if not callable(fn):
        raise RunError(f"reward '{spec.reward}' is a {type(fn).__name__}, not a function: name a "
                       "function taking (response_text, ground_truth, extra_info)")
    if _takes_verl_arguments(fn):
        return lambda text, truth, extra: fn(
            data_source=extra.get("data_source"), solution_str=text, ground_truth=truth,
            extra_info={k: v for k, v in extra.items() if k != "data_source"})
    return fn


def tool_reward_score(_text: str, _truth: str, extra: dict) -> dict:
    """``builtin:tool-reward``: the score is the row's ``tool_reward`` (what agent-generate's tools
    or environment gave the sample, summed), acc whether it is positive."""
    reward = extra["tool_reward"]
    return {"score": reward, "acc": float(reward > 0)}


def _takes_verl_arguments(fn: Callable) -> bool:
    import inspect

    try:
        return "solution_str" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C function without a signature
        return False


def evaluate(fn: Callable[[str, str, dict], Any], spec: RewardSpec, text: str,
             truth: str, extra: dict | None = None) -> tuple[float, float, tuple[float, ...]]:
    """(score, acc, extras) of one response; BadReward when the function raises or returns
    anything but finite numbers. acc: the builtin's verdict, else ``score > 0`` (after float32
    rounding, as the column stores it) unless the function's dict gives one."""
    try:
        result = fn(text, truth, dict(extra or {}))
    except Exception as exc:  # user code: report which sample, not a traceback
        raise BadReward(f"raised {exc!r}") from exc
    if isinstance(result, dict):
        if "score" not in result:
            raise BadReward(f"returned a dict without 'score': {short(result)}")
        score = _checked(result["score"], "score")
        acc = _checked(result.get("acc", float(np.float32(score) > 0)), "acc")
        return score, acc, tuple(_checked(result.get(name, 0.0), name) for name in spec.extra_columns)
    score = _checked(result, "score")
    # builtins return exactly `correct` or `wrong`: compare before float32 rounding
    acc = float(score == spec.correct) if spec.builtin else float(np.float32(score) > 0)
    return score, acc, (0.0,) * len(spec.extra_columns)


def as_number(value: Any) -> float | None:
    """``value`` as a finite float32-representable number, or None when it is not one (numpy
    scalars, 0-d arrays and one-element tensors count as their element; strings never do)."""
    if isinstance(value, (np.ndarray, np.generic)) or type(value).__module__.startswith("torch"):
        try:
            value = value.item()
        except (ValueError, RuntimeError):  # more than one element
            return None
    if not isinstance(value, numbers.Real):
        return None
    try:
        x = float(value)
    except OverflowError:  # an int beyond float range
        return None
    return x if math.isfinite(x) and abs(x) <= FLOAT32_MAX else None


def _checked(value: Any, what: str) -> float:
    number = as_number(value)
    if number is None:
        raise BadReward(f"returned {short(value)} as '{what}'")
    return number


def short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --- the pool ---------------------------------------------------------------------------


class WorkerDied(Exception):
    """A worker process ended while scoring ``rows`` (at ``row`` when it had started one)."""

    def __init__(self, rows: tuple[int, ...], row: int | None, exitcode: int | None):
        self.rows, self.row, self.exitcode = rows, row, exitcode
        super().__init__(f"worker died ({exit_text(exitcode)}) scoring rows {rows[0]}..{rows[-1]}")


class LoadFailed(Exception):
    """A worker could not build the reward function (the text says why)."""


def exit_text(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        return f"killed by signal {signal.Signals(-exitcode).name}"
    return f"exit code {exitcode}"


@dataclass
class _Worker:
    process: Any  # a spawn-context Process
    conn: Connection
    progress: Any  # shared doubles: [start time of the current row (0: between rows), position]
    chunk: tuple[int, ...] | None = None  # the rows sent to it, not yet answered
    seq: int = 0  # that chunk's id: a reply is checked against it


class RewardPool:
    """``workers`` processes scoring with ``spec``'s function, each started when first needed
    and replaced when killed. One chunk in flight per worker: a second one sent ahead would
    save the worker's wait for its next chunk (~15% at 1 worker on `builtin:math`), but a chunk
    of long responses overfills the pipe, so that send would block the driver while the worker
    computes, and for good if the worker hangs in C code (past any timeout)."""

    def __init__(self, spec: RewardSpec, workers: int, timeout_s: float | None = None):
        self.spec, self.workers, self.timeout_s = spec, workers, timeout_s
        self._slots: list[_Worker | None] = [None] * workers
        self._ctx = mp.get_context("spawn")
        self._seq = 0
        # garbage collection or interpreter exit stops the workers even without close()
        self._finalizer = weakref.finalize(self, _stop_all, self._slots)

    def close(self) -> None:
        self._finalizer()

    def score(self, texts: Sequence[str], truths: Sequence[str],
              extras: Sequence[dict] | None = None) -> list[Row]:
        """One Row per (text, truth[, extra_info]), in order (None: timed out). Raises
        WorkerDied or LoadFailed; any exception leaves no worker busy, so the next call starts
        clean."""
        extras = extras if extras is not None else [{}] * len(texts)
        out: list[Row] = [None] * len(texts)
        todo = deque(_chunks(len(texts), self.workers))
        try:
            while todo or self._busy():
                self._dispatch(todo, texts, truths, extras)
                self._collect(out)
                if self.timeout_s is not None:
                    self._kill_hung(todo)
        except BaseException:
            self._stop_busy()  # their replies would answer the next call's chunks
            raise
        return out

    # --- one turn of the loop -----------------------------------------------------------

    def _busy(self) -> list[_Worker]:
        return [w for w in self._slots if w is not None and w.chunk is not None]

    def _dispatch(self, todo: deque, texts: Sequence[str], truths: Sequence[str],
                  extras: Sequence[dict]) -> None:
        """Idle running workers first: a chunk put back after a kill should not wait for the
        replacement's start-up (spawn re-imports the driver's main module) while one is free."""
        idle = [i for i, w in enumerate(self._slots) if w is not None and w.chunk is None]
        empty = [i for i, w in enumerate(self._slots) if w is None]
        for i in idle + empty:
            if not todo:
                return
            self._send(i, todo.popleft(), texts, truths, extras)

    def _send(self, i: int, chunk: tuple[int, ...], texts: Sequence[str], truths: Sequence[str],
              extras: Sequence[dict]) -> None:
        worker = self._slots[i] or self._start(i)
        self._seq += 1
        worker.chunk, worker.seq = chunk, self._seq
        try:
            worker.conn.send((self._seq, [texts[r] for r in chunk], [truths[r] for r in chunk],
                              [extras[r] for r in chunk]))
        except (BrokenPipeError, ConnectionResetError, EOFError):
            pass  # it died: _collect sees its sentinel and reports it

    def _start(self, i: int) -> _Worker:
        ours, theirs = self._ctx.Pipe()
        progress = self._ctx.RawArray("d", 2)
        # daemon: never outlives the driver (so the function cannot use multiprocessing itself)
        process = self._ctx.Process(target=_serve, args=(theirs, progress, self.spec), daemon=True,
                                    name=f"reward-worker-{i}")
        process.start()
        theirs.close()
        self._slots[i] = _Worker(process, ours, progress)
        return self._slots[i]

    def _collect(self, out: list[Row]) -> None:
        """Wait for a reply, a death or (with a timeout) the earliest deadline; take replies."""
        busy = self._busy()
        ready = set(wait([w.conn for w in busy] + [w.process.sentinel for w in busy],
                         timeout=self._wait_s(busy)))
        for w in busy:
            if w.conn in ready or w.conn.poll():
                try:
                    seq, payload = w.conn.recv()
                except (EOFError, ConnectionResetError):
                    raise self._died(w) from None
                if isinstance(payload, str):
                    raise LoadFailed(payload)
                assert seq == w.seq, "every abandoned call stops its busy workers"
                for r, row in zip(w.chunk, payload):
                    out[r] = row
                w.chunk = None
            elif w.process.sentinel in ready:
                raise self._died(w)

    def _wait_s(self, busy: list[_Worker]) -> float | None:
        if self.timeout_s is None:
            return None
        starts = [w.progress[0] for w in busy if w.progress[0] > 0]
        if not starts:  # none has begun a row yet (still starting up): look again later
            return self.timeout_s
        return max(min(starts) + self.timeout_s - time.monotonic(), 0.0) + 0.001

    def _died(self, w: _Worker) -> WorkerDied:
        w.process.join(timeout=1.0)  # its pipe closes just before it exits: take its own exit code
        self._drop(w)
        row = w.chunk[int(w.progress[1])] if w.progress[0] > 0 else None
        return WorkerDied(w.chunk, row, w.process.exitcode)

    def _kill_hung(self, todo: deque) -> None:
        now = time.monotonic()
        for w in self._busy():
            start = w.progress[0]
            if start <= 0 or now - start < self.timeout_s:
                continue
            self._drop(w)  # SIGKILL: progress no longer moves
            # a row that began just before the kill has not run out of time: re-score it
            hung = w.chunk[int(w.progress[1])] if w.progress[0] == start else None
            rest = tuple(r for r in w.chunk if r != hung)  # hung's Row stays None: timed out
            if rest:
                todo.appendleft(rest)

    def _drop(self, w: _Worker) -> None:
        _stop(w)
        self._slots[self._slots.index(w)] = None

    def _stop_busy(self) -> None:
        for w in self._busy():
            self._drop(w)


def _chunks(n: int, workers: int) -> list[tuple[int, ...]]:
    size = min(max(math.ceil(n / (workers * CHUNKS_PER_WORKER)), 1), MAX_CHUNK)
    return [tuple(range(start, min(start + size, n))) for start in range(0, n, size)]


def _stop(w: _Worker) -> None:
    w.process.kill()
    w.process.join()
    w.conn.close()


def _stop_all(slots: list[_Worker | None]) -> None:
    for i, w in enumerate(slots):
        if w is not None:
            _stop(w)
            slots[i] = None


def _serve(conn: Connection, progress: Any, spec: RewardSpec) -> None:
    """A worker's life: build the function, then score chunks until told to stop or orphaned."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's: it kills us
    try:
        fn, failure = resolve_reward(spec), ""
    except Exception as exc:  # reported with the first chunk, where the driver can name it
        fn, failure = None, f"{type(exc).__name__}: {exc}"
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the driver is gone
            return
        if message is None:
            return
        seq, texts, truths, extras = message
        if fn is None:
            conn.send((seq, failure))
            continue
        rows: list[Row] = []
        for pos, (text, truth, extra) in enumerate(zip(texts, truths, extras)):
            # the start time first: a kill between the two writes reads as "moved on" (_kill_hung)
            progress[0] = time.monotonic()
            progress[1] = pos
            try:
                rows.append(evaluate(fn, spec, text, truth, extra))
            except BadReward as bad:
                rows.append(str(bad))
        progress[0] = 0.0
        conn.send((seq, rows))
