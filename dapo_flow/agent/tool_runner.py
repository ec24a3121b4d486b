"""Running tool calls: every call of a round at once, each in its own thread with its tool's
timeout, so that one slow tool (a sandboxed program, a search) does not hold up the others.

A call that raises, returns something other than a ToolResult, or runs past its timeout gets an
error result the model sees; the rollout never stops for a tool. A timed-out call's thread is a
daemon left to finish on its own: Python cannot stop a thread, so a tool that may hang must
bound itself (the built-in ``python`` sandbox kills its process; its timeout is the same one).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Mapping

from dapo_flow.tools.base import Tool, ToolResult, error_result
from dapo_flow.tools.calls import ParsedCall

TIMEOUT_MARGIN_S = 0.5  # over the tool's own limit: a sandbox that kills its program reports it first


@dataclass(frozen=True)
class CallJob:
    """One call to run: whose (``instance_id``: the request's), and what."""

    instance_id: str
    call: ParsedCall


def run_calls(tools: Mapping[str, Tool], timeouts: Mapping[str, float], jobs: list[CallJob]) -> list[ToolResult]:
    """The results of ``jobs``, in order; all run at once."""
    results: list[Any] = [None] * len(jobs)

    def work(k: int, job: CallJob) -> None:
        try:
            out = tools[job.call.name].execute(job.instance_id, dict(job.call.arguments))
            results[k] = out if isinstance(out, ToolResult) else error_result(
                f"tool '{job.call.name}' returned {type(out).__name__}, not a ToolResult", raised=1.0)
        except Exception as exc:  # noqa: BLE001 - a tool's failure is the model's observation
            results[k] = error_result(f"tool '{job.call.name}' failed: {type(exc).__name__}: {exc}", raised=1.0)

    start = time.monotonic()
    threads = []
    for k, job in enumerate(jobs):
        thread = threading.Thread(target=work, args=(k, job), daemon=True, name=f"tool-{job.call.name}")
        thread.start()
        threads.append(thread)
    for k, (job, thread) in enumerate(zip(jobs, threads)):
        limit = timeouts.get(job.call.name, 5.0) + TIMEOUT_MARGIN_S
        thread.join(max(0.0, start + limit - time.monotonic()))
        if thread.is_alive() or results[k] is None:
            results[k] = error_result(f"tool '{job.call.name}' timed out after {limit:g} s", timeout=1.0)
    return results


def failed(result: ToolResult) -> bool:
    """Whether a call's result reports a failure (its ``error`` metric)."""
    return float(result.metrics.get("error", 0.0)) > 0
