"""Will it fit? Bytes per worker for training and rollout, from the model's architecture alone.

Pure arithmetic on a :class:`ModelShape` (read from a Hugging Face ``config.json``), the
``train:`` / ``rollout:`` settings and the micro-batch size: no torch, no Ray, nothing loaded.
Every formula, its assumptions and what is left out are in ``docs/memory.md``;
``tests/test_memory.py`` measures real training micro-batches against it.

A :class:`Budget` is a list of named :class:`Term` s. A term is alive throughout (parameters,
optimizer state) or only at some moments of a step (``phases``): activations and logits exist
during a micro-batch's forward/backward, optimizer temporaries during the step, never both. The
peak is the largest moment, which is what ``fits`` checks.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping

GiB = 2**30
MiB = 2**20
FP32 = 4
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# CUDA context, cuBLAS/cuDNN workspaces and NCCL's own buffers outside torch's allocator: a
# fixed 0.5-1 GiB per process in practice (not measured here: no GPU in the tests)
GPU_OVERHEAD_BYTES = int(0.75 * GiB)
# float32 (response tokens, vocab) buffers alive at the logits' backward peak (HFPolicy: the
# scaled logits and softmax probs saved for backward, the gather/logsumexp gradients and their
# sum); measured 4.7-5.4 (docs/memory.md)
LOGITS_PEAK_BUFFERS = 5.0
# ... with an entropy bonus in the loss (update's entropy_coef > 0) its backward adds the
# softmax's and the product's gradients; measured 7.2-7.4
LOGITS_PEAK_BUFFERS_ENTROPY = 7.5
# ... and still alive while the decoder layers run backward when the entropy is only a metric:
# its graph keeps the scaled logits and probs (dapo_flow/operators/update.py keeps `entropy` through
# loss.backward()); with an entropy bonus that graph has run and freed them
LOGITS_HELD_BUFFERS = 2
# chunked logprobs on a float32 head outside autocast take the fused path (algos.logprobs): one
# (chunk, vocab) buffer reused for the whole call, a second beside it for the entropy (its exp in
# the forward; the probabilities beside the gradient in an entropy bonus's backward)
LOGITS_FUSED_BUFFERS = 2.0
# ... and in low precision (a bf16 head, or autocast) the chunk's 16-bit logits (forward) or the
# logits' gradient cast to 16 bits (backward) beside them: half a float32 buffer more
LOW_PRECISION_CHUNK_BUFFERS = 0.5
LOGITS_FUSED_LOW_PRECISION_BUFFERS = LOGITS_FUSED_BUFFERS + LOW_PRECISION_CHUNK_BUFFERS
# sampling one token (HFPolicy._sample): float32 (rows, vocab) logits, scaled, filtered
# (sort values + int64 indices for top-p), softmax
SAMPLING_BUFFERS = 6

Where = Literal["device", "host"]

# a frozen model's forward (inference mode, tensors freed as soon as used): a decoder layer's MLP
# holds gate, up, silu(gate) and their product, (tokens, intermediate) each; measured 4.0
FORWARD_MLP_BUFFERS = 4
# logprobs_from_logits's logsumexp runs in chunks of 2^24 elements: at most 64 MiB of exp()
LOGSUMEXP_CHUNK_BYTES = (1 << 24) * FP32
# ... and so does its backward: two of the LOGITS_PEAK_BUFFERS (x - logsumexp and its exp) are one
# logsumexp chunk's, so logits over 64 MiB (the whole response's, or one chunk's of chunked logprobs
# on the generic path) peak lower, one buffer below 5 once a chunk is half the logits or less
# (measured, V 32000, unchunked: 640 rows in chunks of 524 and 116, 4.65 buffers; 768 rows 4.37;
# 896 rows 4.18; 1536 rows 4.01; the same logits with logsumexp unchunked, 5.01)
LOGSUMEXP_BACKWARD_BUFFERS = 2

LOGITS_BACKWARD = "backward of the logits"
LAYER_BACKWARD = "backward of a layer"
OPTIMIZER_STEP = "optimizer step"
FWD_BWD = (LOGITS_BACKWARD, LAYER_BACKWARD)
FROZEN_LAYERS = "frozen forward (layers)"
FROZEN_HEAD = "frozen forward (output head)"


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer (Llama / Qwen2 / Mistral block) as far as memory cares."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    qkv_bias: bool = False  # Qwen2: q/k/v projections have biases
    o_bias: bool = False  # Llama attention_bias: o_proj too
    mlp_bias: bool = False
    head: str = "lm"  # `lm`: the vocabulary-wide output head; `value` / `reward`: one output
    qk_norm: bool = False  # Qwen3: an RMSNorm of head_dim on q and on k
    # mixture of experts (Qwen2/Qwen3-MoE): 0 experts = dense. A sparse layer's MLP is a router
    # (hidden -> experts), `num_experts` gate/up/down experts of `moe_intermediate_size`, of
    # which each token uses `num_experts_per_tok`, and (Qwen2-MoE) a shared expert every token
    # uses with its sigmoid gate (hidden -> 1)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    sparse_layers: tuple[int, ...] = ()  # which layers are sparse (the others: a dense MLP)

    @property
    def out_features(self) -> int:
        """Outputs of the head per position: the vocabulary, or 1 for a critic's or reward model's."""
        return self.vocab_size if self.head == "lm" else 1

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "ModelShape":
        """From config.json's keys (Llama, Qwen2, Mistral spelling); missing optional keys take
        those classes' defaults (head_dim hidden/heads, kv heads = heads, untied)."""
        heads = int(config["num_attention_heads"])
        qwen2 = config.get("model_type") in ("qwen2", "qwen2_moe")  # q/k/v biases
        attention_bias = bool(config.get("attention_bias", False))
        return cls(
            vocab_size=int(config["vocab_size"]),
            hidden_size=int(config["hidden_size"]),
            intermediate_size=int(config["intermediate_size"]),
            num_hidden_layers=int(config["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or int(config["hidden_size"]) // heads),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_position_embeddings=int(config.get("max_position_embeddings") or 2048),
            qkv_bias=qwen2 or attention_bias,
            o_bias=attention_bias and not qwen2,
            mlp_bias=bool(config.get("mlp_bias", False)),
            qk_norm=config.get("model_type") in ("qwen3", "qwen3_moe"),
            **_experts(config),
        )

    @classmethod
    def from_model_dir(cls, path: Path | str) -> "ModelShape":
        """From ``path/config.json`` (a Hugging Face model directory)."""
        return cls.from_config(json.loads((Path(path).expanduser() / "config.json").read_text()))

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def attention_params(self) -> int:
        """One layer's attention and its two RMSNorms: q/k/v/o (GQA: k, v have kv_dim rows), Qwen3's q/k norms."""
        h, q, kv = self.hidden_size, self.q_dim, self.kv_dim
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv) * self.qkv_bias + h * self.o_bias
        return attn + 2 * h + 2 * self.head_dim * self.qk_norm

    def mlp_params(self, layer: int, active: bool = False) -> int:
        """Layer ``layer``'s MLP: dense gate/up/down, or a sparse block's router, experts (all
        of them, or ``active``: those one token uses) and shared expert."""
        h = self.hidden_size
        if layer not in self.sparse_layers:
            return 3 * h * self.intermediate_size + (2 * self.intermediate_size + h) * self.mlp_bias
        experts = self.num_experts_per_tok if active else self.num_experts
        shared = 3 * h * self.shared_expert_intermediate_size + h if self.shared_expert_intermediate_size else 0
        return h * self.num_experts + experts * 3 * h * self.moe_intermediate_size + shared

    def layer_params(self) -> int:
        """The largest decoder layer (FSDP2 gathers a layer at a time): attention, norms, MLP."""
        return self.attention_params() + max(self.mlp_params(i) for i in range(self.num_hidden_layers))

    def root_params(self) -> int:
        """What is not in a decoder layer: embeddings, final norm, the output head (the lm_head
        unless tied; a value or reward head's hidden x 1)."""
        embed = self.vocab_size * self.hidden_size
        tied = self.head == "lm" and self.tie_word_embeddings
        return embed + (0 if tied else self.out_features * self.hidden_size) + self.hidden_size

    def num_params(self) -> int:
        """Every parameter: every expert of every layer (what is stored, trained and synced)."""
        layers = sum(self.mlp_params(i) for i in range(self.num_hidden_layers))
        return self.num_hidden_layers * self.attention_params() + layers + self.root_params()

    def active_params(self) -> int:
        """The parameters one token runs through: a sparse layer's top-k experts only (the
        "A3B" of Qwen3-30B-A3B; embeddings counted, as Qwen counts them). A dense model's all."""
        layers = sum(self.mlp_params(i, active=True) for i in range(self.num_hidden_layers))
        return self.num_hidden_layers * self.attention_params() + layers + self.root_params()

    @property
    def mlp_width(self) -> int:
        """The widest MLP one token runs through (what its activations scale with): the dense
        intermediate size, or a sparse layer's top-k experts' and shared expert's together."""
        sparse = self.num_experts_per_tok * self.moe_intermediate_size + self.shared_expert_intermediate_size
        dense = self.intermediate_size if len(self.sparse_layers) < self.num_hidden_layers else 0
        return max(dense, sparse if self.sparse_layers else 0)


def _experts(config: Mapping[str, Any]) -> dict[str, Any]:
    """ModelShape's mixture-of-experts fields from a Qwen2/Qwen3-MoE config.json (``num_experts``,
    which transformers 5 writes as Mixtral's ``num_local_experts``); none for a dense model. A
    layer is sparse unless listed in ``mlp_only_layers`` or off ``decoder_sparse_step``, as HF
    builds them."""
    experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    if not experts:
        return {}
    layers, step = int(config["num_hidden_layers"]), int(config.get("decoder_sparse_step") or 1)
    dense = set(config.get("mlp_only_layers") or ())
    return {"num_experts": experts, "num_experts_per_tok": int(config["num_experts_per_tok"]),
            "moe_intermediate_size": int(config["moe_intermediate_size"]),
            "shared_expert_intermediate_size": int(config.get("shared_expert_intermediate_size") or 0),
            "sparse_layers": tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)}


@dataclass(frozen=True)
class Term:
    """``bytes`` of one kind of memory. ``phases``: the moments it is alive at (empty: all the
    time); ``fix``: the setting that shrinks it, for the "does not fit" message."""

    name: str
    bytes: int
    where: Where = "device"
    phases: tuple[str, ...] = ()
    fix: str = ""


@dataclass(frozen=True)
class Budget:
    """One actor's memory per worker. "device": the memory it computes in (the GPU's, or RAM
    for an actor without one); "host": RAM it uses besides (offloaded state)."""

    title: str
    terms: tuple[Term, ...]

    def phases(self) -> list[str]:
        seen: dict[str, None] = {}
        for t in self.terms:
            seen.update(dict.fromkeys(t.phases))
        return list(seen)

    def alive(self, phase: str | None, where: Where = "device") -> list[Term]:
        """The terms in ``where`` at ``phase`` (None: only those alive throughout)."""
        return [t for t in self.terms if t.where == where and (not t.phases or phase in t.phases)]

    def peak_phase(self, where: Where = "device") -> str | None:
        """The moment with the most bytes in ``where`` (None when no term has phases)."""
        return max(self.phases(), key=lambda p: sum(t.bytes for t in self.alive(p, where)), default=None)

    def peak(self, where: Where = "device") -> int:
        return sum(t.bytes for t in self.alive(self.peak_phase(where), where))

    @property
    def total(self) -> int:
        """Peak device bytes."""
        return self.peak("device")

    def biggest(self, where: Where = "device") -> Term | None:
        return max(self.alive(self.peak_phase(where), where), key=lambda t: t.bytes, default=None)

    def rows(self) -> list[tuple[str, int, str]]:
        """(term name, bytes, where) for every term."""
        return [(t.name, t.bytes, t.where) for t in self.terms]

    def fits(self, capacity_bytes: int, where: Where = "device") -> str | None:
        """None when the peak fits in ``capacity_bytes``; else what does not fit, its biggest
        term and the setting that shrinks it."""
        need = self.peak(where)
        if need <= capacity_bytes:
            return None
        big = self.biggest(where)
        assert big is not None  # need > capacity >= 0
        at = f" ({self.peak_phase(where)})" if self.peak_phase(where) else ""
        text = (f"{self.title}: needs about {_size(need)} of {where} memory at its peak{at}, more "
                f"than the {_size(capacity_bytes)} there is; the biggest term is {big.name} "
                f"({_size(big.bytes)})")
        return text + (f"; fix: {big.fix}" if big.fix else "")

    def format(self) -> str:
        """A header line, then one aligned line per term: name, size, where, when (the peak in
        GiB, in MiB when under 1 GiB; the terms in the same unit, those that would read 0.00 GiB in MiB)."""
        unit = GiB if max(self.total, self.peak("host")) >= GiB else MiB
        phase = self.peak_phase("device")
        head = f"{self.title}: peak {_size(self.total, unit)} device" + (f" ({phase})" if phase else "")
        if any(t.where == "host" for t in self.terms):
            head += f", {_size(self.peak('host'), unit)} host"
        width = max((len(t.name) for t in self.terms), default=0)
        lines = [f"  {t.name:<{width}}  {_size(t.bytes, MiB if t.bytes < GiB / 100 else unit):>11}  {t.where:<6}  "
                 f"{_when(t.phases)}".rstrip()
                 for t in self.terms]
        return "\n".join([head, *lines])


def _size(n: int, unit: int | None = None) -> str:
    """``n`` bytes in GiB (two decimals) or MiB (one); by default GiB from 1 GiB up."""
    unit = unit or (GiB if n >= GiB else MiB)
    return f"{n / GiB:.2f} GiB" if unit == GiB else f"{n / MiB:.1f} MiB"


def _when(phases: tuple[str, ...]) -> str:
    return "forward/backward" if set(phases) == set(FWD_BWD) else ", ".join(phases)


def layer_activation_bytes(shape: ModelShape, compute_bytes: int, *, repeated_kv: bool = False,
                           autocast: bool = False) -> int:
    """Bytes one decoder layer saves for its backward, per token (HF Llama/Qwen2 block, SDPA
    with a flash / memory-efficient kernel: no (seq, seq) score matrix).

    Two RMSNorms: each saves its input upcast to float32 and its normed output; attention: q, k
    after RoPE and v (SDPA's inputs), SDPA's output and its contiguous (tokens, q_dim) copy that
    o_proj saves, float32 logsumexp per head; MLP: gate, silu(gate), up and their product.
    ``repeated_kv``: k and v are saved at q width (HF repeats the kv heads when a padding mask
    keeps SDPA from its GQA path). ``autocast``: float32 weights under torch.autocast, so the
    residual stream and the norms' outputs stay float32 and each projection saves its own bf16
    cast of its input (q, k, v of the first norm's output, gate and up of the second's).
    """
    h, c = shape.hidden_size, compute_bytes
    kv = shape.q_dim if repeated_kv else shape.kv_dim
    norms = 2 * h * (FP32 + FP32) + 5 * h * c if autocast else 2 * h * (FP32 + c)
    attention = c * (3 * shape.q_dim + 2 * kv) + FP32 * shape.num_attention_heads
    mlp = 4 * shape.mlp_width * c
    if shape.sparse_layers:  # HF's expert loop: each of a token's k experts saves its own copy of
        # the token's input and its output before the routing weight; the router, its logits and
        # float32 probabilities
        mlp += 2 * shape.num_experts_per_tok * h * c + shape.num_experts * (c + FP32)
    return norms + attention + mlp


def estimate_training(
    shape: ModelShape, *, micro_batch_tokens: int, response_tokens_per_micro_batch: int, workers: int = 1,
    strategy: Literal["fsdp2", "ddp", "none"] | None = None, dtype: str = "float32",
    mixed_precision: Literal["bf16"] | None = None, grad_checkpointing: bool = False, cpu_offload: bool = False,
    rows_per_micro_batch: int = 1, padded: bool | None = None, entropy_in_loss: bool = False,
    logprob_chunk_tokens: int | None = None, optimizer: str = "adamw", on_gpu: bool = True,
    title: str = "training", lora_params: int = 0, packed: bool = False, sequence_parallel: int = 1,
) -> Budget:
    """Bytes per worker of one update step (a micro-batch's forward and backward, then AdamW).

    ``micro_batch_tokens``: positions one forward sees, rows x (longest prompt + longest
    response) in the micro-batch, padding included; ``response_tokens_per_micro_batch``: rows x
    longest response (the positions HFPolicy takes logits for). ``padded`` (default: when
    ``rows_per_micro_batch`` > 1, as RL rows differ in length): SDPA then gets a mask,
    (rows, 1, seq, seq) per layer, and GQA's kv heads are repeated. ``entropy_in_loss``: the
    update has an entropy bonus (entropy_coef > 0), so the logits' backward is wider.
    ``logprob_chunk_tokens``: ``train.logprob_chunk_tokens`` (logits of at most that many tokens
    at a time). ``strategy`` None: fsdp2 when workers > 1 (as ``train.strategy``); ddp: every
    worker holds the whole state (as one worker). ``mixed_precision`` ``"bf16"``: computed values
    (activations, gathered parameters) in bf16 over float32 state, the master weights, whatever
    ``dtype`` (which is then the copies' that are not trained). Without FSDP2 that is
    torch.autocast, which also keeps a bf16 copy of the weights its matmuls use. ``on_gpu``: add
    the fixed CUDA overhead and price the step as torch's foreach AdamW (CPU: per-tensor).
    ``lora_params``: LoRA adapters of this many parameters (:func:`lora_param_count`) are all
    that trains: gradients, AdamW moments and the step's temporaries are theirs, the base is
    stored in ``dtype`` beside them; activations as without (the adapters' own, rank-wide, are
    small against a layer's). ``packed`` (``train.pack``): the rows run packed into bins of the
    longest row's length (dapo_flow.models.packing), each under a block-diagonal mask: in the
    worst case (every row as long as the longest) what the padded rows take.
    ``sequence_parallel`` k (``train.sequence_parallel``): each sequence's tokens split over k
    workers (dapo_flow.models.sequence_parallel), so a worker keeps 1/k of the micro-batch's
    activations and logits; the attention mask is still the whole sequence's.
    """
    sharded = _checked_sharding(dtype, optimizer, micro_batch_tokens, response_tokens_per_micro_batch,
                                logprob_chunk_tokens, workers, strategy, cpu_offload, mixed_precision,
                                sequence_parallel)
    # parameters, gradients, AdamW moments (torch keeps them alike): float32 master weights under
    # mixed precision, whatever dtype
    store = FP32 if mixed_precision else DTYPE_BYTES[dtype]
    compute = 2 if mixed_precision == "bf16" else store
    if lora_params:  # what trains is the adapters, float32 (peft's choice too); the base keeps its dtype
        store = FP32
    shard = workers if sharded else 1
    terms = _state_terms(shape, dtype, store, shard, sharded, cpu_offload, on_gpu, lora_params)
    if on_gpu:
        terms.append(Term("CUDA context and workspaces", GPU_OVERHEAD_BYTES))
    if sharded:
        terms += _gathered(shape, compute, store, mixed_precision)
    bf16_base = bool(lora_params) and bool(mixed_precision) and DTYPE_BYTES[dtype] == compute
    if not sharded and mixed_precision and not bf16_base:  # a bf16 base needs no bf16 copies
        terms += _autocast_weights(shape, compute, grad_checkpointing)
    padded = rows_per_micro_batch > 1 if padded is None else padded
    terms += _activations(shape, compute, micro_batch_tokens, response_tokens_per_micro_batch,
                          rows_per_micro_batch, padded or packed, grad_checkpointing, mixed_precision, entropy_in_loss,
                          logprob_chunk_tokens,
                          # a bf16 base under LoRA: the residual stream is bf16 too (autocast keeps
                          # the float32 one of a float32 model's)
                          autocast=bool(mixed_precision) and not sharded and not bf16_base, packed=packed,
                          split=sequence_parallel)
    return Budget(title, tuple(t for t in terms if t.bytes > 0))


def _checked_sharding(dtype: str, optimizer: str, micro_batch_tokens: int, response_tokens_per_micro_batch: int,
                      logprob_chunk_tokens: int | None, workers: int, strategy: str | None, cpu_offload: bool,
                      mixed_precision: str | None, sequence_parallel: int) -> bool:
    """Whether :func:`estimate_training`'s state is sharded (FSDP2), after refusing what it
    cannot price."""
    if sequence_parallel < 1:
        raise ValueError("sequence_parallel must be >= 1")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r}: use one of {sorted(DTYPE_BYTES)}")
    if optimizer != "adamw":
        raise ValueError(f"optimizer {optimizer!r}: only adamw is estimated")
    if not 0 < response_tokens_per_micro_batch <= micro_batch_tokens:
        raise ValueError("response tokens must be > 0 and at most the micro-batch's tokens")
    if logprob_chunk_tokens is not None and logprob_chunk_tokens < 1:
        raise ValueError("logprob_chunk_tokens must be >= 1 (or None: all at once)")
    resolved = strategy or ("fsdp2" if workers > 1 else "none")
    sharded = resolved == "fsdp2"
    if not sharded and ((workers > 1 and resolved != "ddp") or cpu_offload):
        raise ValueError("workers > 1 need strategy fsdp2 or ddp; cpu_offload fsdp2")
    if mixed_precision not in (None, "bf16"):
        raise ValueError(f"mixed_precision {mixed_precision!r}: use None or bf16")
    return sharded


def _state_terms(shape: ModelShape, dtype: str, store: int, shard: int, sharded: bool, cpu_offload: bool,
                 on_gpu: bool, lora_params: int) -> list[Term]:
    """The training state of one worker: the weights (under LoRA the frozen base in ``dtype``
    beside the adapters), what trains' gradients and AdamW moments (``store`` bytes each),
    and the optimizer step's temporaries; each a 1/``shard`` shard when ``sharded``."""
    p = shape.num_params()
    state_at: Where = "host" if cpu_offload else "device"
    state_fix = "more train.workers (FSDP2 shards it)" + (
        "" if cpu_offload else ", or train.cpu_offload: true" + ("" if sharded else " (strategy: fsdp2)"))
    of = f" (1/{shard} shard)" if sharded else ""
    if lora_params:  # the base frozen in its dtype beside the adapters
        trained = lora_params
        terms = [Term(f"base weights (frozen){of}", p * DTYPE_BYTES[dtype] // shard, state_at, fix=state_fix),
                 Term(f"LoRA adapters{of}", lora_params * store // shard, state_at)]
    else:
        trained = p
        terms = [Term(f"parameters{of}", p * store // shard, state_at, fix=state_fix)]
    return terms + [
        Term(f"gradients{of}", trained * store // shard, state_at, fix=state_fix),
        Term(f"AdamW moments{of}", 2 * trained * store // shard, state_at, fix=state_fix),
        _step_temporaries(shape, store, shard, on_gpu, state_at, trained if lora_params else None),
    ]


def _step_temporaries(shape: ModelShape, store: int, shard: int, on_gpu: bool, where: Where,
                      lora_params: int | None = None) -> Term:
    """torch's foreach AdamW (its default on GPU) makes one sqrt(exp_avg_sq) for all parameters
    at once; the per-tensor loop (CPU) one for the largest tensor (the embeddings; under LoRA
    an adapter matrix, a bound of its size: all of them)."""
    if lora_params is not None:
        n = lora_params
    else:
        n = shape.num_params() if on_gpu else shape.vocab_size * shape.hidden_size
    return Term("optimizer step temporaries", n * store // shard, where, (OPTIMIZER_STEP,))


LINEAR_SHAPES = {  # a Llama/Qwen2-style decoder layer's linears: name -> (in, out) of the shape
    "q_proj": lambda s: (s.hidden_size, s.q_dim), "k_proj": lambda s: (s.hidden_size, s.kv_dim),
    "v_proj": lambda s: (s.hidden_size, s.kv_dim), "o_proj": lambda s: (s.q_dim, s.hidden_size),
    "gate_proj": lambda s: (s.hidden_size, s.intermediate_size),
    "up_proj": lambda s: (s.hidden_size, s.intermediate_size),
    "down_proj": lambda s: (s.intermediate_size, s.hidden_size),
}


def lora_param_count(shape: ModelShape, rank: int, target_modules: str | list[str]) -> int:
    """Parameters of rank-``rank`` adapters (A: rank x in, B: out x rank) on every decoder
    layer's targeted linears (`all-linear`: the seven of a Llama/Qwen2 layer; names outside
    them are not counted)."""
    names = LINEAR_SHAPES if target_modules == "all-linear" else [t for t in target_modules if t in LINEAR_SHAPES]
    per_layer = sum(rank * sum(LINEAR_SHAPES[n](shape)) for n in names)
    return shape.num_hidden_layers * per_layer


def _gathered(shape: ModelShape, compute: int, store: int, mixed_precision: str | None) -> list[Term]:
    """FSDP2's unsharded copies during forward/backward (in the compute dtype): the root (held
    from its pre-forward to its post-forward, again over the whole backward), the layer running
    and the one prefetched, and in the backward a layer's unsharded gradients plus their
    reduce-scatter input (float32 under bf16 mixed precision) and the root's gradients."""
    fix = "" if mixed_precision else "train.mixed_precision: bf16 (gathers in bf16)"
    layer, root = shape.layer_params(), shape.root_params()
    reduce = compute + (store if store != compute else 0)
    return [
        Term("gathered root (embeddings, lm_head)", root * compute, phases=FWD_BWD, fix=fix),
        Term("gathered decoder layers (2)", 2 * layer * compute, phases=FWD_BWD, fix=fix),
        Term("unsharded gradients (layer + root)", layer * reduce + root * compute, phases=(LAYER_BACKWARD,), fix=fix),
    ]


def _autocast_weights(shape: ModelShape, compute: int, checkpointing: bool) -> list[Term]:
    """torch.autocast's bf16 copies of the weights its matmuls use (every decoder layer's
    projections and the lm_head; not the embeddings or norms), cast once per forward and saved
    for the backward. With gradient checkpointing a layer's copies are recomputed with the
    layer: the lm_head's and one layer's stay."""
    h = shape.hidden_size
    layer = sum(i * o for i, o in (dims(shape) for dims in LINEAR_SHAPES.values()))
    kept = 1 if checkpointing else shape.num_hidden_layers
    return [Term("bf16 weight copies (autocast)", (kept * layer + shape.out_features * h) * compute,
                 phases=FWD_BWD, fix="train.grad_checkpointing: true (recomputes a layer's copies)"
                 if not checkpointing else "more train.workers with strategy fsdp2")]


def _activations(shape: ModelShape, compute: int, tokens: int, response: int, rows: int, padded: bool,
                 checkpointing: bool, mixed_precision: str | None, entropy_in_loss: bool,
                 chunk: int | None, autocast: bool = False, packed: bool = False, split: int = 1) -> list[Term]:
    """What one micro-batch's forward keeps for its backward, and the logits.

    Per token: each layer's saved tensors (:func:`layer_activation_bytes`); with gradient
    checkpointing only each layer's input, plus one layer recomputed in its backward. Always:
    the final norm's input and output, the lm_head input (copied when rows > 1; chunked: see
    :func:`_logits`), and a layer's gradient temporaries in its backward (~2 x intermediate per
    token). ``autocast`` (mixed precision without FSDP2): the residual stream, so the layers'
    inputs and the final norm's output, stays float32; the lm_head saves its bf16 cast of its input.
    ``split`` k: sequence parallelism, a worker's 1/k slice of every sequence (every term per
    token shrinks); the mask covers whole sequences. Responses sit at the end of each row, so
    one worker's slice may be all response: its logits are priced at the slice, not response / k.
    """
    seq = math.ceil(tokens / rows)  # the whole sequence, before the split
    if split > 1:
        tokens = math.ceil(tokens / split)
        response = min(response, tokens)
    per_layer = layer_activation_bytes(shape, compute, repeated_kv=padded and shape.kv_dim != shape.q_dim,
                                       autocast=autocast)
    h, layers = shape.hidden_size, shape.num_hidden_layers
    resid = FP32 if autocast else compute  # the hidden states between layers
    head_input = rows > 1 or autocast  # a copy (of the kept positions; autocast: its bf16 cast)
    tail = tokens * h * (FP32 + resid) + (response * h * compute if head_input and chunk is None else 0)
    budget_fix = "a smaller train.max_tokens_per_micro_batch (or fewer rows per micro-batch)"
    act_fix = (budget_fix if checkpointing else "train.grad_checkpointing: true") + (
        "" if mixed_precision or compute == 2 else ", or train.mixed_precision: bf16")
    saved = tokens * (layers * (h * resid if checkpointing else per_layer)) + tail
    name = "activations (layer inputs)" if checkpointing else "activations saved for backward"
    terms = [Term(name, saved, phases=FWD_BWD, fix=act_fix)]
    if checkpointing:
        terms.append(Term("one decoder layer recomputed", tokens * per_layer, phases=(LAYER_BACKWARD,), fix=budget_fix))
    terms.append(Term("layer backward temporaries", tokens * 2 * shape.mlp_width * compute,
                      phases=(LAYER_BACKWARD,), fix=budget_fix))
    if padded:  # SDPA turns the bool mask into an additive one per call and saves it
        # packed: a block-diagonal mask per bin of the longest row's length, at most one per row
        kept = 1 if checkpointing else layers
        name = "attention masks (packed rows)" if packed else "attention masks (padded rows)"
        terms.append(Term(name, rows * seq * seq * (kept * compute + 1), phases=FWD_BWD, fix=budget_fix))
    # chunked logprobs take the fused path, in float32 or in low precision (algos.logprobs)
    fused = LOGITS_FUSED_BUFFERS if compute == FP32 and not mixed_precision else LOGITS_FUSED_LOW_PRECISION_BUFFERS
    return terms + _logits(shape, resid, response, entropy_in_loss, chunk, budget_fix, fused)


def _logits(shape: ModelShape, hidden_bytes: int, response: int, entropy_in_loss: bool, chunk: int | None,
            budget_fix: str, fused: float | None = None) -> list[Term]:
    """The float32 logits of the response positions and what their backward adds.

    Unchunked: (response, vocab) buffers, LOGITS_PEAK_BUFFERS(_ENTROPY) of them at the logits'
    backward (fewer when logsumexp's chunks are smaller than the logits: LOGSUMEXP_BACKWARD_BUFFERS),
    LOGITS_HELD_BUFFERS still held by the entropy graph while the layers run backward.
    Chunked (``chunk`` tokens at a time, each chunk's logits recomputed in the backward): the
    same buffer counts for one chunk, none held after; instead the response positions' hidden
    states (gathered, padding left out: at most response x hidden) are kept for the backward, and
    during it the hidden states' gradient and the lm_head's gradient, summed over the chunks in
    float32, are alive. ``fused``: the fused path's buffers per chunk instead
    (LOGITS_FUSED_BUFFERS in float32, LOGITS_FUSED_LOW_PRECISION_BUFFERS in low precision); None,
    the generic path's.
    """
    v, h = shape.out_features, shape.hidden_size
    peak = LOGITS_PEAK_BUFFERS_ENTROPY if entropy_in_loss else LOGITS_PEAK_BUFFERS

    def logsumexp_chunked(rows: int) -> float:
        """The buffers fewer at the peak when logsumexp splits (rows, v) logits (an entropy
        bonus's own backward makes its peak: measured the same with logsumexp chunked or not)."""
        part = max(1, LOGSUMEXP_CHUNK_BYTES // (v * FP32)) / max(rows, 1)  # the largest chunk's share
        return 0.0 if entropy_in_loss else LOGSUMEXP_BACKWARD_BUFFERS * (1 - min(1.0, max(0.5, part)))

    if shape.head != "lm":  # a critic's values / a reward model's scores: one float per position
        return [Term("head outputs and their gradients (float32)", int(peak * response * FP32),
                     phases=(LOGITS_BACKWARD,), fix=budget_fix)]
    if chunk is None:
        logits = response * v * FP32
        fix = f"train.logprob_chunk_tokens (chunked logprobs), or {budget_fix}"
        peak -= logsumexp_chunked(response)
        terms = [Term("logits and their gradients (float32)", int(peak * logits), phases=(LOGITS_BACKWARD,), fix=fix)]
        if not entropy_in_loss:
            terms.append(Term("logits kept by the entropy graph", LOGITS_HELD_BUFFERS * logits,
                              phases=(LAYER_BACKWARD,), fix=fix))
        return terms
    logits = min(response, chunk) * v * FP32
    peak = fused if fused is not None else peak - logsumexp_chunked(min(response, chunk))
    return [
        Term("logits of one chunk and their gradients (float32)", int(peak * logits), phases=(LOGITS_BACKWARD,),
             fix="a smaller train.logprob_chunk_tokens"),
        Term("response hidden states (chunked logprobs)", response * h * hidden_bytes, phases=(LOGITS_BACKWARD,),
             fix=budget_fix),
        Term("hidden-state and lm_head gradients over the chunks", response * h * hidden_bytes + v * h * FP32,
             phases=(LOGITS_BACKWARD,), fix=budget_fix),
    ]


def estimate_forward(
    shape: ModelShape,
    *,
    micro_batch_tokens: int,
    response_tokens_per_micro_batch: int,
    rows_per_micro_batch: int = 1,
    padded: bool | None = None,
    compute_bytes: int = FP32,
    logprob_chunk_tokens: int | None = None,
) -> list[Term]:
    """What a frozen model's pass over one micro-batch adds to its weights: a reference's or a
    judge's logprobs, a critic's values, a reward model's scores (HFPolicy in inference mode,
    which frees each tensor once used, so only one layer's temporaries live at a time).

    Two moments. The layers: the residual stream and its normed copy, and the larger of the
    MLP's FORWARD_MLP_BUFFERS (tokens, intermediate) buffers and attention's q, k, v, output and
    the padding mask SDPA gets (they are not alive together). The output head (a causal LM's
    only; a value or reward head gives one float per position):
    unchunked, the model's logits of the response positions, their float32 scaled copy, and
    either the float32 cast being scaled (a 16-bit model) or one logsumexp chunk of exp();
    chunked (``logprob_chunk_tokens``), one chunk's float32 logits, reused chunk after chunk
    (and a 16-bit model's chunk of logits before its cast), beside the response positions'
    hidden states. 16-bit layers add RMSNorm's float32 copy. Measured on CPU within 10% (tests/test_memory.py).
    Shape: terms with phases FROZEN_LAYERS / FROZEN_HEAD.
    """
    if not 0 < response_tokens_per_micro_batch <= micro_batch_tokens:
        raise ValueError("response tokens must be > 0 and at most the micro-batch's tokens")
    tokens, response, rows = micro_batch_tokens, response_tokens_per_micro_batch, rows_per_micro_batch
    h, c = shape.hidden_size, compute_bytes
    fix = "a smaller micro_batch_size on the node that runs it (rows per forward)"
    upcast = h * FP32 if c != FP32 else 0  # RMSNorm's float32 copy of its input
    mlp = tokens * FORWARD_MLP_BUFFERS * shape.mlp_width * c
    attention = tokens * (2 * shape.q_dim + 2 * shape.kv_dim) * c  # q, k, v and the output
    if rows > 1 if padded is None else padded:  # SDPA's additive mask, made per call
        seq = math.ceil(tokens / rows)
        attention += rows * seq * seq * (c + 1)
    terms = [Term("a layer's forward temporaries", tokens * (2 * h * c + upcast) + max(mlp, attention),
                  phases=(FROZEN_LAYERS,), fix=fix)]
    if shape.head != "lm":
        return terms
    v = shape.out_features
    if logprob_chunk_tokens is None:
        # the model's logits, their scaled float32 copy, and beside them either the float32 cast
        # being scaled (16-bit models) or, later, a logsumexp chunk of exp()
        logits = response * v * FP32
        cast = logits if c != FP32 else 0
        terms.append(Term("logits of the response (and their float32 copies)",
                          logits * c // FP32 + logits + max(cast, min(logits, LOGSUMEXP_CHUNK_BYTES)),
                          phases=(FROZEN_HEAD,), fix=f"train.logprob_chunk_tokens (chunked logprobs), or {fix}"))
    else:
        # the fused path reuses one float32 buffer (a frozen pass wants no entropy); a 16-bit
        # head's chunk of logits, cast into it, beside it (half a buffer more)
        buffers = 1 if c == FP32 else 1 + LOW_PRECISION_CHUNK_BUFFERS
        chunk = int(min(response, logprob_chunk_tokens) * v * FP32 * buffers)
        terms += [Term("logits of one chunk (float32)", chunk, phases=(FROZEN_HEAD,),
                       fix="a smaller train.logprob_chunk_tokens"),
                  Term("response hidden states (chunked logprobs)", response * h * c, phases=(FROZEN_HEAD,), fix=fix)]
    terms.append(Term("the last hidden states", tokens * h * c, phases=(FROZEN_HEAD,), fix=fix))
    return terms


def estimate_rollout(
    shape: ModelShape,
    *,
    max_model_len: int,
    batch_rows: int,
    dtype: str = "float32",
    backend: str = "hf",
    gpu_memory_utilization: float = 0.6,
    gpu_mem_gib: float | None = None,
    kv_cache_gib: float | None = None,
    on_gpu: bool = True,
    mixed_precision: Literal["bf16"] | None = None,
    title: str = "rollout",
) -> Budget:
    """Bytes of a rollout engine (one per worker).

    ``hf``: the weights, a KV cache of ``batch_rows`` x ``max_model_len`` positions (keys and
    values of every layer, in ``dtype``) plus one layer's copy while it grows (DynamicCache
    concatenates), and the sampling buffers. ``mixed_precision`` ``"bf16"`` (a policy trained
    with it samples under torch.autocast): the keys and values are bf16, and autocast keeps bf16
    copies of the weights its matmuls use for the whole generation (it caches the casts of
    weights that require gradients). On an H200 that put a 0.36B policy's rollout of 128 rows x
    278 positions at 0.96x its measured peak; float32 keys and values and no copies, 0.86x.
    ``vllm`` on GPU: the share ``gpu_memory_utilization`` x ``gpu_mem_gib`` it claims (weights
    and KV cache inside it); on CPU: the weights plus ``kv_cache_gib`` (whole GiB, default 1).
    """
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r}: use one of {sorted(DTYPE_BYTES)}")
    b = DTYPE_BYTES[dtype]
    weights = Term("weights", shape.num_params() * b, fix="a smaller model or dtype: bfloat16")
    overhead = [Term("CUDA context and workspaces", GPU_OVERHEAD_BYTES)] if on_gpu else []
    if backend == "vllm":
        if not on_gpu:
            kv = math.ceil(kv_cache_gib or 1) * GiB  # vLLM reads whole GiB
            return Budget(title, (weights, Term("vLLM KV cache (kv_cache_gib)", kv,
                                                fix="a smaller rollout.kv_cache_gib")))
        if gpu_mem_gib is None:
            raise ValueError("vllm on GPU: gpu_mem_gib (the GPU's memory) is needed")
        share = int(gpu_memory_utilization * gpu_mem_gib * GiB)
        return Budget(title, (Term("vLLM engine (gpu_memory_utilization share)", share,
                                   fix="a lower rollout.gpu_memory_utilization"),))
    if backend != "hf":
        raise ValueError(f"backend {backend!r}: only hf and vllm are estimated")
    if mixed_precision not in (None, "bf16"):
        raise ValueError(f"mixed_precision {mixed_precision!r}: use None or bf16")
    compute = 2 if mixed_precision else b
    per_layer = batch_rows * max_model_len * 2 * shape.kv_dim * compute
    kv_fix = "fewer rows per generation batch, a shorter max_model_len, or backend: vllm"
    autocast = [Term(t.name, t.bytes, t.where, fix="backend: vllm (its own bf16 weights)")
                for t in _autocast_weights(shape, compute, checkpointing=False)] if mixed_precision else []
    return Budget(title, (
        weights,
        *autocast,
        Term("KV cache", per_layer * shape.num_hidden_layers, fix=kv_fix),
        Term("KV cache growth copy (one layer)", per_layer, fix=kv_fix),
        Term("sampling logits (float32)", SAMPLING_BUFFERS * batch_rows * shape.vocab_size * FP32,
             fix="fewer rows per generation batch"),
        *overhead,
    ))
