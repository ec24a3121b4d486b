"""agent-generate: multi-turn, tool-using rollout (the generate role, like `generate`).

For each prompt, n samples, each a conversation: the model writes a turn; tool calls in it
(``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; ``compact``:
``<call>TOOL: ARGUMENT</call>``) run, their responses are appended, the model goes on; until a
turn calls no tool (its answer), ``max_turns``, ``max_tokens`` response tokens in all, or an
environment's episode end (an OpenEnv server as a tool: :mod:`dapo_flow.envs.openenv`). Same
output columns as ``generate`` (the response holds every turn and observation) plus
``loss_mask`` (1 on the model's tokens, 0 on the tools'; `update`, `advantage`, `kl` honour
it), ``num_turns``, ``num_tool_calls``, ``tool_errors``, ``tool_reward`` and per tool
``tool_reward_<name>``, and ``conversation`` (the turns as text, for the logged samples). A
mixture-of-experts model trained with ``train.routing_replay`` also gets ``routed_experts``, as
from ``generate``: every prompt, model and tool token's experts, each from the forward that first
processed it (stitched across the turns: :meth:`dapo_flow.agent.requests.Request.turn`). A
malformed call, an unknown tool, bad arguments, a tool that raises or times out: the model
sees ``error: ...`` and the call counts in ``tool_errors``; the rollout goes on. Machinery: :mod:`dapo_flow.agent`; tools: :mod:`dapo_flow.tools`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
from pydantic import BaseModel, Field, field_validator, model_validator

from dapo_flow.agent.rollout import AgentLimits, rollout_metrics, run_agent
from dapo_flow.data.arrow_utils import routes_to_arrow, token_lists, with_columns
from dapo_flow.core import columns as C
from dapo_flow.core.contract import OpContext, Sampling
from dapo_flow.models.sampling import SamplingConfig
from dapo_flow.tools.base import ToolSpec
from dapo_flow.operators.generate import CallSeeds, Params as GenerateParams, records_routes
from dapo_flow.reductions import Rate, Seconds, Total


class Params(GenerateParams):
    tools: list[ToolSpec] = Field(default_factory=lambda: [ToolSpec(name="calculator")], min_length=1)
    """The tools the model may call: `{name: calculator}` (the default), `{name: python,
    timeout_s: 10}`, `{name: NAME, impl: pkg.module:Class, config: {...}}` (see dapo_flow/tools;
    a `file.py:Class` path resolves against the working directory, as a reward file does), or an
    OpenEnv environment, `{name: NAME, impl: openenv, config: {url: ... or app: ...}}` (see
    dapo_flow/envs/openenv.py)."""
    format: Literal["hermes", "compact"] = "hermes"
    """How the model writes a call: `hermes` (Qwen / Hermes `<tool_call>` JSON; tool responses go
    through the chat template when the tokenizer has one) or `compact` (`<call>TOOL: ARG</call>`,
    `<result>TEXT</result>`: the built-in tiny models)."""
    max_turns: int = Field(4, ge=1, le=64)
    """Model turns per sample; a turn that calls a tool at the limit ends the sample unanswered."""
    max_tool_calls_per_turn: int = Field(1, ge=1, le=64)
    """Calls run per turn; more are one error observation."""
    max_tokens: int = Field(64, ge=1, le=65536)
    """Response tokens in all (every turn and tool response: verl's response_length)."""

    @field_validator("tools")
    @classmethod
    def _loadable_tools(cls, tools: list[ToolSpec]) -> list[ToolSpec]:
        from dapo_flow.tools.base import ToolError
        from dapo_flow.tools.registry import load_tools

        try:
            loaded = load_tools(tools)  # every problem at once: unknown, unimportable, bad schema, duplicate names
        except ToolError as exc:  # a ValueError: validate reports it at the node's params.tools line
            raise ValueError(str(exc).replace("\n", "; ")) from None
        return [_with_defaults(spec, loaded[spec.name]) for spec in tools]

    @model_validator(mode="after")
    def _callable_in_format(self) -> "Params":
        from dapo_flow.tools.calls import CALL_FORMATS
        from dapo_flow.tools.registry import load_tools

        problems = CALL_FORMATS[self.format].tool_problems(
            {name: tool.schema for name, tool in load_tools(self.tools).items()})
        if problems:
            raise ValueError("; ".join(problems))
        return self


def _with_defaults(spec: ToolSpec, tool) -> ToolSpec:
    """``spec`` with its tool's whole validated config (defaults filled), so `explain` and the
    run's MLflow params say how the tool ran (the python tool's isolation, say). ``timeout_s``
    (and ``name``) stay on the entry, where the graph sets them."""
    from dapo_flow.tools.registry import ENTRY_FIELDS

    config = getattr(tool, "config", None)
    if not isinstance(config, BaseModel):
        return spec
    return spec.model_copy(update={"config": config.model_dump(mode="json", exclude=set(ENTRY_FIELDS))})


class AgentGenerate:
    """Prompt rows in, n multi-turn sample rows per prompt out."""

    Params = Params
    REQUIRES = C.typed(C.PROMPT_ID, C.PROMPT_IDS)
    # added when the model trains with routing replay (a model setting, not a param of the node)
    PRODUCES_WITH_TRAIN = {"routing_replay": C.typed(C.ROUTED_EXPERTS)}
    CARDINALITY = "expand"
    NEEDS_MODEL = True
    ROLE = "generate"

    @classmethod
    def sampling_settings(cls, params: Params) -> Sampling:
        return Sampling(n=params.n, max_tokens=params.max_tokens, greedy=params.temperature == 0 or params.top_k == 1,
                        call_format=params.format)

    @classmethod
    def produces(cls, params: Params) -> dict[str, pa.DataType]:
        return {**C.typed(C.SAMPLE_IDX, C.RESPONSE_IDS, C.RESPONSE_TEXT, C.RESPONSE_LEN, C.TRUNCATED,
                          C.ROLLOUT_LOGP, C.ROLLOUT_VERSION, C.LOSS_MASK, C.NUM_TURNS, C.NUM_TOOL_CALLS, C.TOOL_ERRORS,
                          C.TOOL_REWARD, C.CONVERSATION),
                **{tool_reward_column(t.name): pa.float32() for t in params.tools}}

    def __init__(self, params: Params, ctx: OpContext):
        self.params = params
        self.ctx = ctx
        self.seeds = CallSeeds(ctx.seed)  # as generate's: the same prompt seeds, call by call
        self._metrics: dict[str, float] = {}
        self._tools = None

    def state_dict(self) -> dict:
        return self.seeds.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.seeds.load_state_dict(state)

    def last_metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def _loaded_tools(self):
        if self._tools is None:  # built once per worker: a tool may hold state across calls
            from dapo_flow.tools.registry import load_tools

            # a file.py:Class resolves where the driver started, not in the actor's cwd (as score's reward files)
            self._tools = load_tools(self.params.tools, base_dir=Path(self.ctx.workdir or os.getcwd()))
        return self._tools

    def __call__(self, batch: pa.Table) -> pa.Table:
        p = self.params
        model = self.ctx.model
        cfg = SamplingConfig(n=p.n, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, max_tokens=p.max_tokens,
                             record_routes=records_routes(model))
        seeds = self.seeds.take(batch)
        rows = batch.select([c for c in (C.GROUND_TRUTH, C.DATA_SOURCE, C.PROMPT_ID) if c in batch.column_names])
        kwargs = rows.to_pylist()  # each tool's create(instance, ground_truth=..., data_source=..., prompt_id=...)
        out = run_agent(model.generator, model.tokenizer, self._loaded_tools(), {t.name: t.timeout_s for t in p.tools},
                        token_lists(batch.column(C.PROMPT_IDS)), kwargs, list(seeds), cfg,
                        AgentLimits(p.max_turns, p.max_tool_calls_per_turn, p.max_tokens, p.format))
        reqs = out.requests
        responses = [r.response_ids for r in reqs]
        self._metrics = {
            "gen/tokens": Total(out.tokens_generated),
            "gen/seconds": Seconds(out.engine_seconds),
            "gen/tokens_per_s": Rate(out.tokens_generated / max(out.engine_seconds, 1e-9)),
            **rollout_metrics(out, p.max_turns),
        }
        total = sum(out.tool_rewards.values()) if out.tool_rewards else np.zeros(len(reqs))
        # as generate: the column comes where the engine recorded routes (one without routers records none)
        recorded = cfg.record_routes and all(r.routes is not None for r in reqs)
        routes = {C.ROUTED_EXPERTS: routes_to_arrow([r.routes for r in reqs])} if recorded else {}
        return with_columns(batch.take(pa.array([r.row for r in reqs], pa.int32())), {
            **routes,
            C.SAMPLE_IDX: np.array([r.sample_idx for r in reqs], dtype=np.int32),
            C.RESPONSE_IDS: pa.array(responses, C.TOKENS),
            C.RESPONSE_TEXT: model.tokenizer.batch_decode(responses, skip_special_tokens=True),
            C.RESPONSE_LEN: np.array([len(ids) for ids in responses], dtype=np.int32),
            C.TRUNCATED: np.array([r.truncated for r in reqs], dtype=bool),
            C.ROLLOUT_LOGP: pa.array([r.logprobs for r in reqs], C.TOKEN_FLOATS),
            C.ROLLOUT_VERSION: pa.array([r.versions for r in reqs], C.TOKENS),
            C.LOSS_MASK: pa.array([r.loss_mask for r in reqs], C.TOKEN_FLAGS),
            C.NUM_TURNS: np.array([r.turns for r in reqs], dtype=np.int32),
            C.NUM_TOOL_CALLS: np.array([r.tool_calls for r in reqs], dtype=np.int32),
            C.TOOL_ERRORS: np.array([r.tool_errors for r in reqs], dtype=np.int32),
            C.TOOL_REWARD: np.asarray(total, dtype=np.float32),
            C.CONVERSATION: [conversation(r, model.tokenizer) for r in reqs],
            **{tool_reward_column(name): v.astype(np.float32) for name, v in out.tool_rewards.items()},
        })


def conversation(request, tokenizer) -> str:
    """The response turn by turn, for people: ``[assistant] ...`` and ``[tool] ...`` lines."""
    return "\n".join(f"[{role}] {tokenizer.decode(request.response_ids[a:b], skip_special_tokens=True).strip()}"
                     for role, a, b in request.segments)


def tool_reward_column(tool: str) -> str:
    return f"{C.TOOL_REWARD}_{tool}"
