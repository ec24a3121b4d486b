"""harness-generate: rollouts by a user's agent harness talking to the model over the OpenAI API
(the generate role, like `generate` and `agent-generate`).

For each prompt row, ``n`` samples; each sample is one call of the harness (``run(client,
task)``, :mod:`dapo_flow.endpoint.harness`) with an ``openai`` client pointed at an endpoint in
front of the node's rollout engine (:mod:`dapo_flow.endpoint`: started on the first call, in the
process that holds the engine, on 127.0.0.1 with a per-run token) and the prompt row as
``task``. The endpoint records the exact tokens of each sample's requests; a sample is one
training sequence: the first request's prompt (it replaces the row's ``prompt_ids``), then the
sampled tokens (loss mask 1) and the tokens the harness put between requests (tool results,
user turns: loss mask 0), as AReaL's and SkyRL's OpenAI proxies record them. Every request
samples with this node's temperature / top_p / top_k, whatever it asks, so the rollout logprobs
are the distribution the trainer recomputes; its ``max_tokens`` holds within the sample's budget.

Output: the columns `agent-generate` produces (``num_turns``: the sample's completions;
``num_tool_calls``: the runs of tokens the harness inserted; ``tool_errors`` / ``tool_reward``:
0) and ``harness_reward``, the harness's reward (NaN when it gave none), which
``score`` reads with ``reward: builtin:harness``. A harness that raises, times out, never calls
the model, rewrites the history it sent, or passes ``max_requests``: its sample is masked (loss
mask all 0), logged and counted in ``harness/masked_<reason>``; the step goes on.
"""

from __future__ import annotations

import os
import uuid
from collections import Counter
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
from pydantic import Field, field_validator

from dapo_flow.agent.rollout import request_seed
from dapo_flow.core import columns as C
from dapo_flow.core.contract import OpContext, Sampling
from dapo_flow.data.arrow_utils import with_columns
from dapo_flow.endpoint.episodes import MASK_REASONS
from dapo_flow.operators.generate import CallSeeds, Params as GenerateParams
from dapo_flow.reductions import Rate, Seconds, Total


class Params(GenerateParams):
    harness: str = Field("harness.py:run", min_length=3)
    """The harness: `file.py:run` (relative to the directory the run starts in) or `module:run`;
    `async def run(client, task)` or a plain function, returning a reward, a dict with `score`, or None.
    `verifiers:ENV_ID`: a verifiers environment's own rollout and rubric, on prompts from source
    `verifiers:ENV_ID` (dapo_flow/envs/verifiers_env.py)."""
    max_tokens: int = Field(256, ge=1, le=65536)
    """Response tokens in all per sample: every completion and every token the harness inserts."""
    max_requests: int = Field(32, ge=1, le=4096)
    """Requests per sample; past it the endpoint answers 429 and the sample is masked."""
    timeout_s: float = Field(300.0, gt=0, le=86400)
    """Seconds a harness call may take; past it the sample is masked."""
    concurrency: int = Field(256, ge=1, le=4096)
    """Harness calls running at once (their requests are batched into the engine together)."""
    format: Literal["hermes", "compact"] = "hermes"
    """The model's tool-call format, for the endpoint's `tool_calls` (and chat layout without a
    chat template): `hermes` (`<tool_call>` JSON) or `compact` (`<call>TOOL: ARG</call>`: the built-in models)."""
    host: str = "127.0.0.1"
    """Where the endpoint binds; another host than loopback warns (the token still guards it)."""
    port: int = Field(0, ge=0, le=65535)
    """The endpoint's port; 0: a free one."""
    engine_threads: Literal["adaptive", "fixed"] = "adaptive"
    """The engine shares its process with the harness's clients: `adaptive` computes a call that
    every open sample waits on with every torch thread, others with one left to the clients
    (fastest; the rollout logprobs' last bits, ~1e-6, then depend on timing: torch's CPU attention
    rounds differently on another thread count); `fixed` always leaves one (logprobs reproducible
    to the bit, as a sync run's)."""

    @field_validator("harness")
    @classmethod
    def _reference(cls, value: str) -> str:
        from dapo_flow.envs import verifiers_env

        if verifiers_env.is_verifiers(value):
            problem = verifiers_env.harness_problem(value)
            if problem:
                raise ValueError(problem)
            return value
        target, sep, name = value.rpartition(":")
        if not sep or not target or not name.isidentifier():
            raise ValueError(f"harness {value!r} must be 'file.py:function' or 'module:function'")
        return value


#: the endpoints this process serves, by (node id, engine): one per harness node, its variants share it
_ENDPOINTS: dict[tuple[str, int], Any] = {}


class HarnessGenerate:
    """Prompt rows in, n harness samples per prompt out."""

    Params = Params
    REQUIRES = C.typed(C.PROMPT_ID, C.PROMPT_IDS)
    PRODUCES = C.typed(C.PROMPT_IDS, C.SAMPLE_IDX, C.RESPONSE_IDS, C.RESPONSE_TEXT, C.RESPONSE_LEN, C.TRUNCATED,
                       C.ROLLOUT_LOGP, C.ROLLOUT_VERSION, C.LOSS_MASK, C.NUM_TURNS, C.NUM_TOOL_CALLS,
                       C.TOOL_ERRORS, C.TOOL_REWARD, C.CONVERSATION, C.HARNESS_REWARD)
    CARDINALITY = "expand"
    NEEDS_MODEL = True
    ROLE = "generate"

    @classmethod
    def sampling_settings(cls, params: Params) -> Sampling:
        return Sampling(n=params.n, max_tokens=params.max_tokens, greedy=params.temperature == 0 or params.top_k == 1,
                        call_format=params.format)

    @classmethod
    def explain_notes(cls, params: Params) -> list[str]:
        port = f"{params.port}" if params.port else "PORT"
        free = "" if params.port else ", PORT a free one"
        return [f"endpoint http://{params.host}:{port}/v1 in its model's process{free}, a bearer token per run "
                "(printed when it starts)"]

    def __init__(self, params: Params, ctx: OpContext):
        from dapo_flow.core.imports import load_object

        self.params = params
        self.ctx = ctx
        self.seeds = CallSeeds(ctx.seed)
        from dapo_flow.envs import verifiers_env

        self.fn = (verifiers_env.harness(params.harness) if verifiers_env.is_verifiers(params.harness)
                   else load_object(params.harness, base_dir=Path(ctx.workdir or os.getcwd())))
        self._key: tuple[str, int] | None = None  # the endpoint this instance started
        self._metrics: dict[str, float] = {}

    def state_dict(self) -> dict:
        return self.seeds.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.seeds.load_state_dict(state)

    def last_metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def _endpoint(self):
        """The node's endpoint in this process, started on first use and shared with the node's
        variants (validation's copies with other n / temperature: one address for the run)."""
        generator = self.ctx.model.generator
        key = (self.ctx.node_id, id(generator))
        if key not in _ENDPOINTS:
            from dapo_flow.endpoint.server import Endpoint

            p = self.params
            name = next((n for n, m in self.ctx.models.items() if m is self.ctx.model), self.ctx.node_id)
            _ENDPOINTS[key] = Endpoint(generator, model_name=name, call_format=p.format, host=p.host,
                                       port=p.port, require_episode=True, spare_threads=1,  # for the clients
                                       all_threads_when_waited=p.engine_threads == "adaptive").start()
            print(f"harness-generate '{self.ctx.node_id}': OpenAI-compatible endpoint {_ENDPOINTS[key].base_url} "
                  f"(model '{name}')", flush=True)
            self._key = key  # this instance started it: its close() stops it
        return _ENDPOINTS[key]

    def close(self) -> None:
        endpoint = _ENDPOINTS.pop(self._key, None) if self._key else None
        if endpoint is not None:
            endpoint.close()

    def __call__(self, batch: pa.Table) -> pa.Table:
        from dapo_flow.endpoint.harness import run_episodes

        p = self.params
        endpoint = self._endpoint()
        endpoint.served.sampling = (p.temperature, p.top_p, p.top_k)  # this call's (validation's differ)
        tasks = batch.to_pylist()
        seeds = self.seeds.take(batch)
        call = uuid.uuid4().hex[:8]
        jobs = [(row, j, f"{self.ctx.node_id}-{call}-{row}-{j}") for row in range(batch.num_rows) for j in range(p.n)]
        for row, j, episode in jobs:
            endpoint.book.register(episode, request_seed(seeds[row], j), p.max_requests, p.max_tokens)
        stats, calls_before = endpoint.batcher.stats, endpoint.batcher.stats.calls
        tokens_before, seconds_before = stats.tokens, stats.seconds
        done = run_episodes(self.fn, endpoint.base_url, endpoint.token,
                            [(episode, tasks[row]) for row, _, episode in jobs],
                            timeout_s=p.timeout_s, concurrency=p.concurrency,
                            on_done=lambda episode, o: (endpoint.book.finish(episode, o.masked), o))
        records, outcomes = [r for r, _ in done], [o for _, o in done]
        return self._table(batch, jobs, records, outcomes, stats.calls - calls_before,
                           stats.tokens - tokens_before, stats.seconds - seconds_before)

    def _table(self, batch, jobs, records, outcomes, engine_calls: int, tokens: int, seconds: float) -> pa.Table:
        tok = self.ctx.model.tokenizer
        version = self.ctx.model.generator.weights_version
        eos = tok.eos_token_id
        prompts = batch.column(C.PROMPT_IDS).to_pylist()
        # a sample without a completion still needs one response token: a masked EOS
        responses = [r.response_ids or [eos] for r in records]
        inserted = [sum(1 for a, b in zip([1] + r.loss_mask, r.loss_mask) if a == 1 and b == 0) for r in records]
        reasons = Counter(r.masked for r in records if r.masked)
        rewards = np.array([np.nan if o.reward is None else o.reward for o in outcomes], dtype=np.float32)
        n = max(len(records), 1)
        self._metrics = {
            "gen/tokens": Total(tokens), "gen/seconds": Seconds(seconds),
            "gen/tokens_per_s": Rate(tokens / max(seconds, 1e-9)),
            "harness/engine_calls": Total(engine_calls),
            "harness/requests_mean": float(np.mean([r.requests for r in records])) if records else 0.0,
            "harness/masked_frac": sum(reasons.values()) / n,
            **{f"harness/masked_{reason}": reasons[reason] / n for reason in MASK_REASONS},
            "harness/reward_mean": float(np.nanmean(rewards)) if np.isfinite(rewards).any() else 0.0,
        }
        return with_columns(batch.take(pa.array([row for row, _, _ in jobs], pa.int32())), {
            C.PROMPT_IDS: pa.array([r.prompt_ids or prompts[row] for (row, _, _), r in zip(jobs, records)], C.TOKENS),
            C.SAMPLE_IDX: np.array([j for _, j, _ in jobs], dtype=np.int32),
            C.RESPONSE_IDS: pa.array(responses, C.TOKENS),
            C.RESPONSE_TEXT: tok.batch_decode(responses, skip_special_tokens=True),
            C.RESPONSE_LEN: np.array([len(ids) for ids in responses], dtype=np.int32),
            C.TRUNCATED: np.array([r.truncated for r in records], dtype=bool),
            C.ROLLOUT_LOGP: pa.array([r.logprobs or [0.0] for r in records], C.TOKEN_FLOATS),
            C.ROLLOUT_VERSION: pa.array([r.versions or [version] for r in records], C.TOKENS),
            C.LOSS_MASK: pa.array([r.training_mask or [0] for r in records], C.TOKEN_FLAGS),
            C.NUM_TURNS: np.array([r.completions for r in records], dtype=np.int32),
            C.NUM_TOOL_CALLS: np.array(inserted, dtype=np.int32),
            C.TOOL_ERRORS: np.zeros(len(records), dtype=np.int32),
            C.TOOL_REWARD: np.zeros(len(records), dtype=np.float32),
            C.CONVERSATION: [_conversation(tok, r, o) for r, o in zip(records, outcomes)],
            C.HARNESS_REWARD: rewards,
        })


def _conversation(tokenizer, record, outcome) -> str:
    """The sample for people: ``[assistant]`` / ``[inserted]`` runs, and why it is masked."""
    lines, start = [], 0
    mask = record.loss_mask
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            role = "assistant" if mask[start] else "inserted"
            lines.append(f"[{role}] {tokenizer.decode(record.response_ids[start:i], skip_special_tokens=True).strip()}")
            start = i
    if record.masked:
        lines.append(f"[masked: {record.masked}] {outcome.error}".rstrip())
    return "\n".join(lines)
