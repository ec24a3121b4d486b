"""generate: sample n responses per prompt with the node's model (GRPO/DAPO rollout).

One output row per sample; samples of a prompt are contiguous and share its
``prompt_id`` (the group id). Rollout logprobs are log-softmax(logits / temperature)
of the sampled tokens, as verl records them; each token's ``rollout_version`` is the policy
version of the weights that sampled it.

A mixture-of-experts model trained with ``train.routing_replay`` also gets each sample's expert
choices (``routed_experts``: every prompt and response token's top-k experts per MoE layer, which
the update replays); that column comes only then: it is declared under the model's setting
(``PRODUCES_WITH_TRAIN``), which validate and ``explain`` read with the model's ``train`` section.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa
from pydantic import BaseModel, Field

from dapo_flow.core import columns as C
from dapo_flow.data.arrow_utils import routes_to_arrow, token_lists, with_columns
from dapo_flow.core.contract import OpContext, PARAMS_CONFIG, Sampling
from dapo_flow.reductions import Rate, Seconds, Total


class Params(BaseModel):
    model_config = PARAMS_CONFIG

    n: int = Field(8, ge=1, le=1024)
    """Samples per prompt (the group size)."""
    temperature: float = Field(1.0, ge=0.0, le=10.0)
    """Sampling temperature; 0 is greedy."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""
    top_k: int = Field(-1, ge=-1)
    """Top-k sampling; -1 disables it."""
    max_tokens: int = Field(16, ge=1, le=65536)
    """Maximum response tokens (verl max_response_length)."""


class Generate:
    """Prompt rows in, n sample rows per prompt out."""

    Params = Params
    REQUIRES = C.typed(C.PROMPT_ID, C.PROMPT_IDS)
    PRODUCES = C.typed(
        C.SAMPLE_IDX, C.RESPONSE_IDS, C.RESPONSE_TEXT, C.RESPONSE_LEN, C.TRUNCATED, C.ROLLOUT_LOGP,
        C.ROLLOUT_VERSION,
    )
    # added when the model trains with routing replay (a model setting, not a param of the node)
    PRODUCES_WITH_TRAIN = {"routing_replay": C.typed(C.ROUTED_EXPERTS)}
    CARDINALITY = "expand"
    NEEDS_MODEL = True
    ROLE = "generate"
    # a generation batch generated in parts (run.gen_stop_early) samples what it samples whole: the
    # parts share the batch's call seeds and prompt width (agent-generate and harness-generate
    # batch their turns across a call's episodes: whole batches only)
    BATCH_PARTS = True

    @classmethod
    def sampling_settings(cls, params: Params) -> Sampling:
        return Sampling(n=params.n, max_tokens=params.max_tokens, greedy=params.temperature == 0 or params.top_k == 1)

    def __init__(self, params: Params, ctx: OpContext):
        self.params = params
        self.ctx = ctx
        self.seeds = CallSeeds(ctx.seed)
        self._metrics: dict[str, float] = {}

    def state_dict(self) -> dict:
        return self.seeds.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.seeds.load_state_dict(state)

    def __call__(self, batch: pa.Table) -> pa.Table:
        from dapo_flow.models.sampling import SamplingConfig

        p = self.params
        cfg = SamplingConfig(
            n=p.n,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            max_tokens=p.max_tokens,
            seed=self.ctx.seed * 1_000_003 + self.seeds.call_of(batch),
            prompt_seeds=self.seeds.take(batch),
            record_routes=self._records_routes(),
            prompt_width=C.prompt_width(batch),
        )
        model = self.ctx.model
        out = model.generator.generate(token_lists(batch.column(C.PROMPT_IDS)), cfg)
        rows = batch.take(pa.array(out.prompt_index, pa.int32()))
        lengths = np.array([len(r) for r in out.response_ids], dtype=np.int32)
        tokens = pa.array(out.response_ids, type=C.TOKENS)
        logp = pa.array(out.logprobs, type=C.TOKEN_FLOATS)
        texts = model.tokenizer.batch_decode(out.response_ids, skip_special_tokens=True)
        self._metrics = {
            "gen/tokens": Total(out.tokens_generated),
            "gen/seconds": Seconds(out.seconds),
            "gen/tokens_per_s": Rate(out.tokens_generated / max(out.seconds, 1e-9)),
        }
        routes = {C.ROUTED_EXPERTS: routes_to_arrow(out.routes)} if out.routes is not None else {}
        return with_columns(
            rows,
            {
                **routes,
                C.SAMPLE_IDX: out.sample_idx.astype(np.int32),
                C.RESPONSE_IDS: tokens,
                C.RESPONSE_TEXT: texts,
                C.RESPONSE_LEN: lengths,
                C.TRUNCATED: np.asarray(out.truncated, dtype=bool),
                C.ROLLOUT_LOGP: logp,
                C.ROLLOUT_VERSION: pa.array(out.token_versions(model.weights_version), type=C.TOKENS),
            },
        )

    def last_metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def _records_routes(self) -> bool:
        return records_routes(self.ctx.model)


def records_routes(model) -> bool:
    """Whether a rollout with ``model`` records its tokens' experts: the model trains with routing
    replay (an engine without routers records none, so no column comes)."""
    spec = getattr(model, "spec", None)
    return bool(spec is not None and spec.train.routing_replay)


class CallSeeds:
    """A generating node's calls so far and each prompt's seed in the next one; checkpointed
    (``calls``) so that a resumed run samples what it would have sampled."""

    def __init__(self, seed: int):
        self.seed = seed
        self.calls = 0

    def take(self, batch: pa.Table) -> tuple[int, ...]:
        """One seed per prompt of ``batch`` from (graph seed, call, prompt id), then the next
        call: a prompt samples the same responses whichever worker, replica or batch position it
        lands on, so the samples do not depend on how many engines share the work, nor on
        whether its generation batch was generated whole or in parts (:meth:`call_of`)."""
        call = self.call_of(batch)
        seeds = tuple(prompt_seed(self.seed, call, pid) for pid in batch.column(C.PROMPT_ID).to_pylist())
        self.calls = call + 1
        return seeds

    def call_of(self, batch: pa.Table) -> int:
        """The call whose seeds ``batch`` takes: the next one, or for the rest of a generation
        batch (``C.continues_call``) the last one, which took its first part."""
        return self.calls - 1 if self.calls > 0 and C.continues_call(batch) else self.calls

    def state_dict(self) -> dict:
        return {"calls": self.calls}

    def load_state_dict(self, state: dict) -> None:
        self.calls = int(state["calls"])


def prompt_seed(seed: int, call: int, prompt_id: str) -> int:
    """A 63-bit seed for one prompt's samples in one call (stable across processes and Python
    versions: a hash of the id's bytes, not ``hash()``)."""
    digest = hashlib.blake2b(f"{seed}:{call}:{prompt_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


