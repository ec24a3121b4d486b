"""Column names and their Arrow types: the one place they are spelled.

Every operator declares its inputs and outputs with these constants; the compiler
propagates them along the graph's edges so miswiring fails before Ray starts.
Token sequences are ``list<int32>``, per-token values ``list<float32>``, and
per-sequence scalars ``float32``.
"""

from __future__ import annotations

from collections.abc import Mapping

import pyarrow as pa

TOKENS = pa.list_(pa.int32())
TOKEN_FLOATS = pa.list_(pa.float32())
TOKEN_FLAGS = pa.list_(pa.int8())  # a 0/1 flag per token (loss_mask)
TOKEN_TOPK_IDS = pa.list_(pa.list_(pa.int32()))  # K ids per response token
TOKEN_TOPK_FLOATS = pa.list_(pa.list_(pa.float32()))  # K values per response token

# --- prompt rows (the graph's `prompts` source) -------------------------------
PROMPT_ID = "prompt_id"  # group id: all samples of one prompt share it (by value)
PROMPT_TEXT = "prompt_text"
PROMPT_IDS = "prompt_ids"  # prompt token ids after the chat template
GROUND_TRUTH = "ground_truth"
DATA_SOURCE = "data_source"

# --- rollout rows (one per sample) --------------------------------------------
SAMPLE_IDX = "sample_idx"
RESPONSE_IDS = "response_ids"
RESPONSE_TEXT = "response_text"
RESPONSE_LEN = "response_len"  # valid response tokens, EOS included
TRUNCATED = "truncated"  # hit max_tokens without EOS
ROLLOUT_LOGP = "rollout_logp"  # sampled-token logprobs from the rollout engine
ROLLOUT_VERSION = "rollout_version"  # per response token: the policy version (RL steps trained into
# the weights) that sampled it; under run.partial_rollouts one response can span several
ROUTED_EXPERTS = "routed_experts"  # a mixture-of-experts rollout's expert choices (routing replay,
# train.routing_replay): for each prompt + response token, each MoE layer's top-k expert indices,
# flat in (token, layer, k) order (the model's layers and k give the shape); -1 where a token's
# choice was not recorded (the last response token, which the rollout never fed to the model)
ROUTED = pa.list_(pa.int16())  # expert indices: int16 holds the 128-256 experts of large MoEs

# --- rewards --------------------------------------------------------------------
SCORE = "score"  # verifier score before shaping
ACC = "acc"  # 1.0 if correct else 0.0; kept before the overlong penalty
OVERLONG_PENALTY = "overlong_penalty"
REWARD = "reward"  # sequence reward after shaping; lands on the last valid token
KL = "kl"  # per sequence: KL(policy || ref) summed over valid tokens (the `kl` op, before coef)

# --- training -------------------------------------------------------------------
OLD_LOGP = "old_logp"  # recomputed by the trainer before the update
REF_LOGP = "ref_logp"
TEACHER_LOGP = "teacher_logp"  # a frozen teacher's logprobs of the student's sampled tokens (distillation)
TEACHER_TOPK_IDS = "teacher_topk_ids"  # per response position, the teacher's K most likely token ids
TEACHER_TOPK_LOGP = "teacher_topk_logp"  # ... and their logprobs (top-K distillation: update's distill_topk_coef)
ENTROPY = "entropy"
ADVANTAGE = "advantage"  # per sequence; broadcast over response tokens by `update`
TOKEN_ADVANTAGE = "token_advantage"  # per response token (token-level estimators: REINFORCE++)
VALUES = "values"  # per response token: a critic's V of the state each token is sampled from
BASELINE = "baseline"  # per sequence: the reward of its prompt's baseline response (ReMax: the greedy one)
RETURNS = "returns"  # per response token: the critic's regression targets (GAE: advantages + values)
LOSS_MASK = "loss_mask"  # per response token: 1 where the model generated it and it takes loss; 0 on a
# tool's / observation's tokens in a multi-turn response, and on a whole row overlong filtering drops
NUM_TURNS = "num_turns"  # agent-generate: the model's turns in the response
NUM_TOOL_CALLS = "num_tool_calls"  # agent-generate: tool calls run
TOOL_ERRORS = "tool_errors"  # agent-generate: calls that failed (malformed, unknown tool, raised, timed out)
CONVERSATION = "conversation"  # agent-generate: the response turn by turn, "[assistant] ..." / "[tool] ..." lines
TOOL_REWARD = "tool_reward"  # agent-generate: the tools' rewards summed (per tool: tool_reward_<name>)
HARNESS_REWARD = "harness_reward"  # harness-generate: the harness's own reward (NaN: it gave none)
ROLLOUT_IS_WEIGHT = "rollout_is_weight"  # per response token: the rollout-correction IS weight
# (pi_train / pi_rollout, truncated or bounded) `update` multiplies each token's loss by
BATCH_ROW = "batch_row"  # a row's position in the whole batch a training group shares out to its
# workers for an update (set by the executor), so the group cuts mini-batches as one worker would

SCHEMA: dict[str, pa.DataType] = {
    PROMPT_ID: pa.string(),
    PROMPT_TEXT: pa.string(),
    PROMPT_IDS: TOKENS,
    GROUND_TRUTH: pa.string(),
    DATA_SOURCE: pa.string(),
    SAMPLE_IDX: pa.int32(),
    RESPONSE_IDS: TOKENS,
    RESPONSE_TEXT: pa.string(),
    RESPONSE_LEN: pa.int32(),
    TRUNCATED: pa.bool_(),
    ROLLOUT_LOGP: TOKEN_FLOATS,
    ROLLOUT_VERSION: TOKENS,
    ROUTED_EXPERTS: ROUTED,
    SCORE: pa.float32(),
    ACC: pa.float32(),
    OVERLONG_PENALTY: pa.float32(),
    REWARD: pa.float32(),
    KL: pa.float32(),
    OLD_LOGP: TOKEN_FLOATS,
    REF_LOGP: TOKEN_FLOATS,
    TEACHER_LOGP: TOKEN_FLOATS,
    TEACHER_TOPK_IDS: TOKEN_TOPK_IDS,
    TEACHER_TOPK_LOGP: TOKEN_TOPK_FLOATS,
    ENTROPY: TOKEN_FLOATS,
    ADVANTAGE: pa.float32(),
    LOSS_MASK: TOKEN_FLAGS,
    TOKEN_ADVANTAGE: TOKEN_FLOATS,
    VALUES: TOKEN_FLOATS,
    RETURNS: TOKEN_FLOATS,
    BASELINE: pa.float32(),
    NUM_TURNS: pa.int32(),
    NUM_TOOL_CALLS: pa.int32(),
    TOOL_ERRORS: pa.int32(),
    TOOL_REWARD: pa.float32(),
    HARNESS_REWARD: pa.float32(),
    CONVERSATION: pa.string(),
    ROLLOUT_IS_WEIGHT: TOKEN_FLOATS,
    BATCH_ROW: pa.int64(),
}

PROMPT_COLUMNS = (PROMPT_ID, PROMPT_TEXT, PROMPT_IDS, GROUND_TRUTH, DATA_SOURCE)

# Schema metadata of a part of a generation batch (run.gen_stop_early). CONTINUES_CALL: the rest of
# a batch whose first part the generating node's last call took: its prompts take that call's
# seeds. PROMPT_WIDTH: the longest prompt of the whole batch, in tokens: an engine that pads prompts
# pads each part to it. So a batch generated in parts samples, bitwise, what it would have whole.
CONTINUES_CALL = b"dapo_flow.continues_call"
PROMPT_WIDTH = b"dapo_flow.prompt_width"


def batch_part(table: pa.Table, *, continues: bool, prompt_width: int) -> pa.Table:
    """``table``, a part of a generation batch whose longest prompt has ``prompt_width`` tokens,
    marked (with ``continues``) as the rest of the batch of the last generate call."""
    marks = {PROMPT_WIDTH: str(prompt_width).encode(), **({CONTINUES_CALL: b"1"} if continues else {})}
    return table.replace_schema_metadata({**(table.schema.metadata or {}), **marks})


def continues_call(table: pa.Table) -> bool:
    """Whether ``table`` is the rest of the last generate call's batch (:func:`batch_part`)."""
    return (table.schema.metadata or {}).get(CONTINUES_CALL) == b"1"


def prompt_width(table: pa.Table) -> int | None:
    """The longest prompt of the generation batch ``table`` is a part of (:func:`batch_part`)."""
    width = (table.schema.metadata or {}).get(PROMPT_WIDTH)
    return int(width) if width is not None else None


def reward_source(choice: str, available: Mapping[str, pa.DataType] | None = None) -> str:
    """The column a `reward_column` param reads: `reward` or `score` as named, or for `auto`
    `reward` when an upstream node produces it (or while upstream is unknown), else `score`."""
    if choice != "auto":
        return choice
    return REWARD if available is None or REWARD in available else SCORE


def typed(*names: str) -> dict[str, pa.DataType]:
    """``{name: arrow type}`` for known column names, in the order given."""
    return {name: SCHEMA[name] for name in names}


def prompt_schema() -> pa.Schema:
    """Schema of the tables the `prompts` source feeds into the graph."""
    return pa.schema([(name, SCHEMA[name]) for name in PROMPT_COLUMNS])
