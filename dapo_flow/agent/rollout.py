"""The agent loop: every request of a batch through its state machine, in rounds.

A round: every RUNNING request's next turn in one engine call (so turns of different requests
batch together; a request never waits for another's tools), then every call of every
TOOL_CALLING request at once (:func:`~dapo_flow.agent.tool_runner.run_calls`), their responses
appended as observation tokens. A turn ends at EOS. Each request's turns are seeded from its
own seed and turn number: its samples do not depend on which requests share its rounds.
"""

from __future__ import annotations

import hashlib
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from dapo_flow.agent.observations import Observations
from dapo_flow.agent.requests import STOPS, Request, Status
from dapo_flow.agent.tool_runner import CallJob, failed, run_calls
from dapo_flow.errors import RunError
from dapo_flow.models.sampling import SamplingConfig
from dapo_flow.tools.base import Tool, ToolError, ToolResult, error_result
from dapo_flow.tools.calls import CALL_FORMATS, ParsedCalls, parse_calls


@dataclass(frozen=True)
class AgentLimits:
    max_turns: int
    max_tool_calls_per_turn: int
    budget: int  # response tokens in all (turns and observations)
    call_format: str = "hermes"
    chat_template: bool = True  # hermes observations through the tokenizer's chat template


@dataclass
class AgentRollout:
    """The finished requests (prompt-major, sample-minor), what the tools gave them, and the
    numbers of the rollout. ``engine_batches``: requests per engine call, in order."""

    requests: list[Request]
    tool_rewards: dict[str, np.ndarray]  # tool name -> (requests,) calc_reward + the calls' rewards
    engine_batches: list[int] = field(default_factory=list)
    tokens_generated: int = 0
    engine_seconds: float = 0.0
    tool_seconds: float = 0.0
    tool_metrics: dict[str, float] = field(default_factory=dict)


def request_seed(prompt_seed: int, sample_idx: int, turn: int = -1) -> int:
    """A 63-bit seed for one sample (``turn`` -1) or one of its turns."""
    digest = hashlib.blake2b(f"{prompt_seed}:{sample_idx}:{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def run_agent(engine: Any, tokenizer: Any, tools: Mapping[str, Tool], timeouts: Mapping[str, float],
              prompt_ids: list[list[int]], create_kwargs: list[dict], prompt_seeds: list[int],
              cfg: SamplingConfig, limits: AgentLimits) -> AgentRollout:
    """``cfg.n`` requests per prompt run to completion (``cfg.max_tokens`` is ignored: the
    budget is ``limits.budget``); with ``cfg.record_routes`` each request's tokens' experts
    (:attr:`Request.routes`) where the engine records them."""
    fmt = CALL_FORMATS[limits.call_format]
    observations = Observations(fmt, tokenizer, limits.chat_template)
    schemas = {name: tool.schema for name, tool in tools.items()}
    requests = [Request(row=p, sample_idx=j, prompt_ids=list(ids), seed=request_seed(prompt_seeds[p], j),
                        budget=limits.budget, max_turns=limits.max_turns)
                for p, ids in enumerate(prompt_ids) for j in range(cfg.n)]
    ids = [f"{r.row}-{r.sample_idx}-{r.seed}" for r in requests]
    rewards: dict[str, np.ndarray] = {name: np.zeros(len(requests)) for name in tools}
    metric_sums: dict[tuple[str, str], float] = defaultdict(float)  # (tool, metric) -> sum over its calls
    calls_of: dict[str, int] = defaultdict(int)
    out = AgentRollout(requests, rewards)
    created: list[int] = []
    try:
        for k, r in enumerate(requests):
            for name, tool in tools.items():
                _user_call(name, "create", tool.create, ids[k], **create_kwargs[r.row])
            created.append(k)
            r.start()
        while running := [k for k, r in enumerate(requests) if r.status is Status.RUNNING]:
            _model_turns(engine, tokenizer, fmt, schemas, cfg, limits, [requests[k] for k in running], out)
            calling = [k for k, r in enumerate(requests) if r.status is Status.TOOL_CALLING]
            start = time.perf_counter()
            jobs = [(k, CallJob(ids[k], call)) for k in calling for call in requests[k].calls.calls]
            results = run_calls(tools, timeouts, [job for _, job in jobs])
            out.tool_seconds += time.perf_counter() - start
            by_request: dict[int, list[tuple[int, ToolResult]]] = defaultdict(list)
            for (k, job), result in zip(jobs, results):
                by_request[k].append((job.call.index, result))
                rewards[job.call.name][k] += float(result.reward)
                calls_of[job.call.name] += 1
                for key, value in result.metrics.items():
                    metric_sums[job.call.name, key] += float(value)
            for k in calling:
                r = requests[k]
                answered = by_request[k] + [(e.index, error_result(e.message)) for e in r.calls.errors]
                answered.sort(key=lambda item: item[0])
                ended_with = tokenizer.decode(r.response_ids[-1:], skip_special_tokens=False)
                r.observe(observations.tokens([res.text for _, res in answered], ended_with),
                          calls_run=len(r.calls.calls), errors=sum(failed(res) for _, res in answered),
                          attempts=len(answered), done=any(res.done for _, res in answered))
        for k in created:
            for name, tool in tools.items():
                rewards[name][k] += float(_user_call(name, "calc_reward", tool.calc_reward, ids[k]))
    finally:
        for k in created:
            for name, tool in tools.items():
                try:
                    tool.release(ids[k])
                except Exception:  # noqa: BLE001 - releasing must not hide the error that got here
                    pass
    # a tool's metric averaged over all its calls (a call that does not report it counts 0)
    out.tool_metrics = {f"tool/{tool}/{key}": total / calls_of[tool] for (tool, key), total in metric_sums.items()}
    return out


def _model_turns(engine: Any, tokenizer: Any, fmt: Any, schemas: Mapping[str, Any], cfg: SamplingConfig,
                 limits: AgentLimits, running: list[Request], out: AgentRollout) -> None:
    """One engine call: the next turn of every running request (up to the largest remaining
    budget; a request's turn past its own budget is cut by :meth:`Request.turn`)."""
    turn_cfg = SamplingConfig(n=1, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                              max_tokens=max(r.remaining for r in running),
                              prompt_seeds=tuple(request_seed(r.seed, 0, r.turns) for r in running),
                              record_routes=cfg.record_routes)
    rolled = engine.generate([r.context for r in running], turn_cfg)
    out.engine_batches.append(len(running))
    out.tokens_generated += int(rolled.tokens_generated)
    out.engine_seconds += float(rolled.seconds)
    texts = tokenizer.batch_decode(rolled.response_ids, skip_special_tokens=True)
    none = ParsedCalls((), ())
    versions = rolled.token_versions(engine.weights_version)
    routes = rolled.routes if rolled.routes is not None else [None] * len(running)  # the context's and the turn's
    # the weights that routed them: the call's last (new weights recompute every row's cache, and
    # its record, also the rows that had ended: RouteLog)
    routed_by = max((v for vs in versions for v in vs), default=engine.weights_version)
    for r, ids, logps, truncated, text, vs, rt in zip(running, rolled.response_ids, rolled.logprobs,
                                                      rolled.truncated, texts, versions, routes):
        finished = not bool(truncated)
        calls = parse_calls(text, fmt, schemas, limits.max_tool_calls_per_turn) if finished else none
        r.turn(list(ids), list(logps), finished, calls, versions=list(vs), routes=rt, routes_version=routed_by)


def _user_call(tool: str, method: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """A tool's create / calc_reward: an exception there is the tool's bug, named as such."""
    try:
        return fn(*args, **kwargs)
    except ToolError as exc:  # the tool's own words: what went wrong and the fix (an unreachable server)
        raise RunError(f"tool '{tool}': {method}(): {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - user code: name it
        raise RunError(f"tool '{tool}': {method}() raised {type(exc).__name__}: {exc}\n"
                       f"    fix: the tool's {method} must not fail (a failing call belongs in execute, "
                       "which returns an error result)") from exc


def rollout_metrics(rollout: AgentRollout, max_turns: int) -> dict[str, float]:
    """Per-sample means of turns, calls, errors and stops; tool-call success rate; per turn, how
    many requests reached it and their tokens in it; the tools' own metrics (means per call)."""
    reqs = rollout.requests
    if not reqs:
        return {}
    calls = np.array([r.tool_calls for r in reqs], dtype=float)
    errors = np.array([r.tool_errors for r in reqs], dtype=float)
    attempted = float(sum(r.tool_attempts for r in reqs))
    out = {
        "agent/turns_mean": float(np.mean([r.turns for r in reqs])),
        "agent/tool_calls_mean": float(calls.mean()),
        "agent/tool_errors_mean": float(errors.mean()),
        "agent/tool_call_success": float(1.0 - errors.sum() / attempted) if attempted else 0.0,
        "agent/used_tool_frac": float(np.mean(calls > 0)),
        "agent/rounds": float(len(rollout.engine_batches)),
        "agent/tool_seconds": rollout.tool_seconds,
        **{f"agent/stop_{stop}": float(np.mean([r.stop == stop for r in reqs])) for stop in STOPS},
    }
    for t in range(max_turns):
        tokens = [r.turn_tokens[t] for r in reqs if len(r.turn_tokens) > t]
        out[f"agent/turn{t + 1}_requests"] = float(len(tokens))
        if tokens:
            out[f"agent/turn{t + 1}_tokens_mean"] = float(np.mean(tokens))
    out.update(rollout.tool_metrics)
    return out
