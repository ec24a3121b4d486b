"""Hugging Face (torch) policy: batched sampling with exact logprobs, logprob recomputation, weights.

Layout used everywhere (verl's): prompts LEFT-padded to width P, responses RIGHT-padded to
width R, so every response starts at column P and the logits that predict it are columns
P-1 .. P+R-2. Position ids count only real tokens (``cumsum(mask) - 1``), which makes a row's
logprobs independent of how much padding its batch needed.
"""

from __future__ import annotations

import time
import warnings
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import numpy as np
import torch

from dapo_flow.algos.logprobs import chunked_linear_logprobs, entropy_from_logits, logprobs_from_logits, vocab_logprobs
from dapo_flow.errors import ModelError
from dapo_flow.models.devices import prepare_device, to_device, to_host
from dapo_flow.models.sampling import Rollouts, SamplingConfig, sample_keys, uniforms
from dapo_flow.models.weight_gate import WeightGate

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MIXED_PRECISION = {"bf16": torch.bfloat16}  # train.mixed_precision -> the autocast compute dtype


NONFINITE_LOGITS = (
    "sampling failed: the model's next-token logits are nan/inf (its weights hold nan/inf, or "
    "float16/bfloat16 activations overflow)\n"
    "    fix: load it with dtype: float32, or check its weights for nan/inf (e.g. a checkpoint "
    "saved after training diverged)"
)


def left_pad(seqs: list[list[int]], pad_id: int, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Shape: ragged -> ids (B, width) long, mask (B, width) long; tokens flush right. Rows are
    padded as lists and made one tensor each: a tensor write per row cost ~17 us, 6-10 ms of an update
    of 192 short rows (benchmarks/step_floor.py)."""
    width = max(map(len, seqs), default=0) if width is None else width
    ids = [[pad_id] * (width - len(s)) + list(s) for s in seqs]
    mask = [[0] * (width - len(s)) + [1] * len(s) for s in seqs]
    return _rows(ids, width), _rows(mask, width)


def right_pad(seqs: list[list[int]], pad_id: int, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Shape: ragged -> ids (B, width) long, mask (B, width) long; tokens flush left."""
    width = max(map(len, seqs), default=0) if width is None else width
    ids = [list(s) + [pad_id] * (width - len(s)) for s in seqs]
    mask = [[1] * len(s) + [0] * (width - len(s)) for s in seqs]
    return _rows(ids, width), _rows(mask, width)


def _rows(rows: list[list[int]], width: int) -> torch.Tensor:
    """Equal-length rows as one long tensor. Shape: -> (len(rows), width), (0, width) for none."""
    return torch.tensor(rows, dtype=torch.long).reshape(len(rows), width)


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Padding-aware position ids: 0 at each row's first real token. Shape: (B, T) -> (B, T)."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Logits with tokens outside the top-k / nucleus set to -inf (the top token always kept)."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= top_p  # mass before this token already >= p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


@contextmanager
def hf_progress_bars_off() -> Iterator[None]:
    """Silence transformers' tqdm bars ("Loading weights", "Writing model shards"), then restore."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def response_logprobs_of(
    model: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_tokens: int | None = None,
    top_k: int = 0,
    at_ids: torch.Tensor | None = None,
) -> tuple:
    """One forward of a causal LM over prompt+response rows (:meth:`HFPolicy.pack`'s layout) and
    the per-token log p of each response under ``softmax(logits / temperature)``, and its entropy.
    With ``top_k`` or ``at_ids`` a third result, :func:`_vocab_pick`'s (ids, logp) at K tokens of
    every response position (not with ``chunk_tokens``).

    ``chunk_tokens`` None: float32 logits of every response position at once, (b, R, vocab).
    Else the output head runs on the real (unpadded) response positions ``chunk_tokens`` at a
    time (:func:`~dapo_flow.algos.logprobs.chunked_linear_logprobs`: each chunk's logits are
    freed after its forward and recomputed in the backward), the same values and gradients.
    The chunks run inside the model's own forward, in place of its output head
    (:func:`_forward_replaced`), so a model sharded by FSDP2 has its head's weight gathered there.
    Shape: inputs' input_ids / attention_mask / position_ids (b, P+R); response_ids,
    response_mask (b, R) -> logp (b, R) float32 (0 at padding), entropy (b, R) or None.
    """
    width = response_ids.shape[1]
    keep = width + 1  # only the positions that predict response tokens (the last one is dropped)
    if chunk_tokens is None:
        out = model(**inputs, use_cache=False, logits_to_keep=keep)
        logits = out.logits[:, :-1].float() / temperature  # (b, R, V)
        logp = logprobs_from_logits(logits, response_ids).masked_fill(~response_mask, 0.0)
        ent = entropy_from_logits(logits).masked_fill(~response_mask, 0.0) if with_entropy else None
        pick = _vocab_pick(logits, response_mask, top_k, at_ids)
        return (logp, ent) if pick is None else (logp, ent, pick)

    return _logprobs_at(model, dict(inputs, logits_to_keep=keep),
                        lambda hidden: hidden[:, :-1][response_mask],  # padding gets no logits at all
                        response_ids[response_mask], response_mask, temperature=temperature,
                        with_entropy=with_entropy, chunk_tokens=chunk_tokens,
                        setting="train.logprob_chunk_tokens: null", top_k=top_k, at_ids=at_ids)


def _vocab_pick(logits: torch.Tensor, mask: torch.Tensor, top_k: int, at_ids: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """log p at K tokens of each position (:func:`~dapo_flow.algos.logprobs.vocab_logprobs`): the
    ``top_k`` most likely (a teacher's, for top-K distillation) or ``at_ids`` (a student's at its
    teacher's top-K); None when neither is asked. Padding gets id 0 and logp 0.
    Shape: logits (b, R, V), mask (b, R), at_ids (b, R, K) -> ids (b, R, K) int64, logp (b, R, K)."""
    if not top_k and at_ids is None:
        return None
    ids, logp = vocab_logprobs(logits, top_k=top_k, ids=None if at_ids is None else at_ids.to(logits.device))
    pad = ~mask[..., None]
    return ids.masked_fill(pad, 0), logp.masked_fill(pad, 0.0)


def shared_prompt_logprobs_of(model: torch.nn.Module, prompt_ids: list[list[int]], response_ids: list[list[int]],
                               pad_id: int, device: torch.device, *, temperature: float = 1.0,
                               with_entropy: bool = False, top_k: int = 0, at_ids: torch.Tensor | None = None
                               ) -> tuple:
    """:func:`response_logprobs_of` with each distinct prompt run once (``train.share_prompts``):
    the rows of a group share their prompt, and a prompt's positions attend only to the prompt
    (causal), so one forward over the distinct prompts gives every row's prompt keys and values.
    They are indexed out per row as a KV cache (differentiable: the prompt's gradient is the sum
    of its rows'), then one forward over the responses less their last token (it predicts
    nothing). The prompt's last position gives the logits of the first response token. The same
    values and gradients to float rounding (the prompt's gradient sums over rows in another
    order); with ``n`` samples per prompt the prompt tokens cost ~1/n of the padded pass's.
    With ``top_k`` or ``at_ids`` a fourth result, :func:`_vocab_pick`'s.
    Shape: -> logp (B, R) float32 (0 at padding), entropy (B, R) or None, response_mask (B, R) bool."""
    distinct: dict[tuple[int, ...], int] = {}
    row_prompt = [distinct.setdefault(tuple(p), len(distinct)) for p in prompt_ids]
    p_ids, p_mask = left_pad([list(p) for p in distinct], pad_id)
    r_ids, r_mask = right_pad(response_ids, pad_id, max(1, max(map(len, response_ids), default=1)))
    index = torch.tensor(row_prompt, device=device)
    p_ids, p_mask, r_ids, r_mask = (t.to(device) for t in (p_ids, p_mask, r_ids, r_mask))
    out = model(input_ids=p_ids, attention_mask=p_mask, position_ids=positions(p_mask), use_cache=True,
                logits_to_keep=1)
    logits = out.logits[index]  # (B, 1, V): the first response token's
    if r_ids.shape[1] > 1:
        cache = out.past_key_values
        cache.reorder_cache(index)  # (distinct, ...) -> (B, ...) by index_select: gradients add up per prompt
        mask = torch.cat([p_mask[index], r_mask[:, :-1]], dim=1)
        rest = model(input_ids=r_ids[:, :-1], attention_mask=mask, position_ids=positions(mask)[:, p_ids.shape[1]:],
                     past_key_values=cache, use_cache=True)
        logits = torch.cat([logits, rest.logits], dim=1)  # (B, R, V)
    logits = logits.float() / temperature
    response_mask = r_mask.bool()
    logp = logprobs_from_logits(logits, r_ids).masked_fill(~response_mask, 0.0)
    ent = entropy_from_logits(logits).masked_fill(~response_mask, 0.0) if with_entropy else None
    pick = _vocab_pick(logits, response_mask, top_k, at_ids)
    return (logp, ent, response_mask) if pick is None else (logp, ent, response_mask, pick)


def packed_logprobs_of(model: torch.nn.Module, packed, device: torch.device, *, temperature: float = 1.0,
                       with_entropy: bool = False, chunk_tokens: int | None = None, top_k: int = 0,
                       at_ids: torch.Tensor | None = None) -> tuple:
    """:func:`response_logprobs_of` on rows packed into bins
    (:class:`~dapo_flow.models.packing.Packed`): one forward without padding or attention mask
    (position ids restart per row, so attention stays in each row), the output head run only on
    the positions that predict a response token (all at once, or ``chunk_tokens`` at a time),
    inside the model's forward as there; ``top_k`` / ``at_ids`` as there. Shape: -> logp (b, R)
    float32 (0 at padding), entropy (b, R) or None, in ``packed.response_mask``'s layout."""
    predict = packed.predict.to(device)
    inputs = {"input_ids": packed.input_ids.to(device), "position_ids": packed.position_ids.to(device)}
    return _logprobs_at(model, inputs, lambda hidden: hidden.reshape(-1, hidden.shape[-1])[predict],
                        packed.targets.to(device), packed.response_mask.to(device), temperature=temperature,
                        with_entropy=with_entropy, chunk_tokens=chunk_tokens, setting="train.pack: false",
                        top_k=top_k, at_ids=at_ids)


def _logprobs_at(model: torch.nn.Module, inputs: dict, select, targets: torch.Tensor, mask: torch.Tensor, *,
                 temperature: float, with_entropy: bool, chunk_tokens: int | None, setting: str,
                 top_k: int = 0, at_ids: torch.Tensor | None = None) -> tuple:
    """One forward of ``model`` on ``inputs`` whose output head runs only on the hidden states
    ``select`` picks, (N, h), the positions predicting ``targets`` (N,): their float32 logits all
    at once, or ``chunk_tokens`` at a time (:func:`~dapo_flow.algos.logprobs.chunked_linear_logprobs`).
    The head runs inside the model's own forward (:func:`_forward_replaced`), so a model sharded
    by FSDP2 has its weight gathered there. ``setting``: what turns this path off (the fix when
    the model's head is not a linear layer). ``top_k`` / ``at_ids`` (b, R, K): a third result,
    :func:`_vocab_pick`'s, from the same logits (not with ``chunk_tokens``, whose chunks keep no
    logits). Shape: -> logp (b, R) float32 (0 where ``mask``, (b, R), is False), entropy (b, R)
    or None."""
    import torch.nn.functional as F

    picking = bool(top_k) or at_ids is not None
    if picking and chunk_tokens is not None:
        raise ModelError("top-K logprobs (distillation's teacher_topk) are not built for chunked logprobs: "
                         "set train.logprob_chunk_tokens: null on this model")
    picked_ids = at_ids.to(mask.device)[mask] if at_ids is not None else None  # (N, K), the order of select

    lm_head = model.get_output_embeddings()
    if not isinstance(lm_head, torch.nn.Linear):
        raise ModelError(f"chunked and packed logprobs need a linear output head; {type(model).__name__}'s "
                         f"is {type(lm_head).__name__}: set {setting}")

    def head(hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The head's stand-in. Shape: hidden -> logp (b, R)[, entropy (b, R)]. Separate tensors,
        not one stacked, so an entropy that is only logged gets no (zero) gradient; and a model
        that post-processes its logits (scales, soft-caps) fails on the tuple, loudly."""
        real = select(hidden)  # (N, h)
        ids = k_logp = None
        if chunk_tokens is None:
            logits = F.linear(real, lm_head.weight, lm_head.bias).float() / temperature  # (N, V)
            logp = logprobs_from_logits(logits, targets)
            ent = entropy_from_logits(logits) if with_entropy else None
            if picking:  # (N, K) each
                ids, k_logp = vocab_logprobs(logits, top_k=top_k, ids=picked_ids)
        else:
            logp, ent = chunked_linear_logprobs(real, lm_head.weight, targets, bias=lm_head.bias,
                                                chunk_tokens=chunk_tokens, temperature=temperature,
                                                with_entropy=with_entropy)
        return tuple(_unpack(v, mask) for v in (logp, ent, ids, k_logp) if v is not None)

    with _forward_replaced(lm_head, head):
        out = model(**inputs, use_cache=False).logits  # head's tuple
    ent = out[1] if with_entropy else None
    if not picking:
        return out[0], ent
    return out[0], ent, (out[-2], out[-1])


def split_logprobs_of(model: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                      keep: torch.Tensor, predict: torch.Tensor, targets: torch.Tensor, group: Any, *,
                      temperature: float = 1.0, with_entropy: bool = False, chunk_tokens: int | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One forward of a causal LM split over a sequence-parallel ``group`` (Ulysses,
    :mod:`dapo_flow.models.sequence_parallel`; the model installed there): this worker runs its
    slice of every sequence, its output head only on the positions of its slice that predict a
    token (all at once or ``chunk_tokens`` at a time, as :func:`_logprobs_at`), and each
    position's log p(``targets``) and entropy come back whole on every worker of the group; a
    worker's backward covers its slice (the group's gradients add up). ``keep``: real tokens
    (the others are no one's keys); position ids restart per packed row.
    Shape: input_ids, position_ids, keep, predict, targets (B, L) -> logp (B, L) float32 (0
    where not ``predict``), entropy (B, L) or None."""
    from dapo_flow.models import sequence_parallel as sp

    k, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    mine = sp.split_sequence(predict, k, rank, value=False)  # (B, l)
    logp, ent = _logprobs_at(model, sp.slice_inputs(input_ids, position_ids, keep, group),
                             lambda hidden: hidden[mine], sp.split_sequence(targets, k, rank)[mine], mine,
                             temperature=temperature, with_entropy=with_entropy, chunk_tokens=chunk_tokens,
                             setting="train.sequence_parallel: 1")
    length = input_ids.shape[1]
    whole = [sp.gather_sequence(v, group)[:, :length] for v in (logp, ent) if v is not None]
    return whole[0], whole[1] if with_entropy else None


def _unpack(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values`` of the True positions of ``mask`` in place, 0 elsewhere.
    Shape: (N, ...), (b, R) -> (b, R, ...)."""
    out = values.new_zeros(mask.shape + values.shape[1:])
    out[mask] = values
    return out


def _rows_of(pick: dict, rows: slice) -> dict:
    """:meth:`HFPolicy.response_logprobs`' top-K request for a pass over ``rows``: ``at_ids`` sliced."""
    return {**pick, "at_ids": pick["at_ids"][rows]} if pick.get("at_ids") is not None else pick


def _joined(parts: list[tuple], mask: torch.Tensor, with_entropy: bool, pick: dict) -> tuple:
    """Micro-batch passes' results, (logp, entropy[, (ids, logp_k)]) each, joined along the rows
    as :meth:`HFPolicy.response_logprobs` returns them (zeros for no rows).
    Shape: -> logp (B, R), entropy (B, R) or None, mask (B, R)[, ((B, R, K), (B, R, K))]."""
    logp = torch.cat([p[0] for p in parts]) if parts else mask.float()
    ent = torch.cat([p[1] for p in parts]) if with_entropy and parts else None
    if not pick:
        return logp, ent, mask
    if parts:
        return logp, ent, mask, (torch.cat([p[2][0] for p in parts]), torch.cat([p[2][1] for p in parts]))
    k = pick["top_k"] or pick["at_ids"].shape[-1]
    return logp, ent, mask, (mask.new_zeros(mask.shape + (k,), dtype=torch.long),
                             mask.new_zeros(mask.shape + (k,), dtype=torch.float32))


@contextmanager
def _forward_replaced(module: torch.nn.Module, forward) -> Iterator[None]:
    """``module`` computes ``forward`` instead of its own forward for the block (an instance
    attribute, deleted after, so the class's forward is back).

    Why the output head is replaced rather than called separately after ``model.model``: the
    chunks then run inside the model's own forward. Under FSDP2 that is where the root's
    parameters (embeddings, final norm, the head's weight) are gathered, and the root registers
    the hook that gathers them again for the backward on what its forward returns; outside it
    the head's weight would be a shard."""
    module.forward = forward
    try:
        yield
    finally:
        del module.forward


@contextmanager
def _loading(path: Path, what: str) -> Iterator[None]:
    """ModelError (the directory and what it lacks) for a model directory transformers cannot
    load: no weights, corrupt weights, no tokenizer files."""
    try:
        yield
    except (OSError, ValueError) as exc:
        raise ModelError(f"{path}: cannot load {what}: {str(exc).strip().splitlines()[0]}\n    fix: a Hugging Face "
                         "model directory holds config.json, its weights (model.safetensors or pytorch_model.bin) "
                         "and its tokenizer files; a built-in model's: `dapo-flow models build NAME --force`") from None
    except Exception as exc:
        if type(exc).__name__ != "SafetensorError":  # corrupt or truncated weights
            raise
        raise ModelError(f"{path}: cannot load {what}: its weights are damaged ({exc})\n    fix: copy the "
                         "model directory again; a built-in model's: `dapo-flow models build NAME --force`") from None




class HFPolicy:
    """A causal LM held in torch: rollouts, logprobs (optionally with grad), weight export/import.

    ``head``: `lm` loads the causal LM (sampling, logprobs); `value` the value model of a
    PPO critic (:mod:`dapo_flow.models.heads`: :meth:`response_values`; it does not sample).
    ``grad_checkpointing``: gradient passes recompute each decoder layer's activations in
    the backward pass (HF gradient checkpointing, non-reentrant) instead of storing them.
    ``logprob_chunk_tokens``: logprobs and entropy over at most this many response tokens
    at a time, each chunk's logits recomputed in the backward (:func:`response_logprobs_of`).
    ``mixed_precision`` ``"bf16"``: every forward of the policy (gradient passes, logprobs,
    sampling) computes under ``torch.autocast(bf16)`` while the weights, their gradients and
    the optimizer's state stay in ``dtype``: float32 for a trained copy, the master weights
    (``load_resource`` loads it so whatever the model's ``dtype``); logits are cast to
    float32 before any log-softmax. Not with :meth:`shard` (FSDP2 casts the parameters
    itself: pass ``mixed_precision`` there). ``lora`` (``train.lora``): LoRA adapters on the
    model (:mod:`dapo_flow.models.lora`), the only weights that train; ``adapters``: a
    directory of trained ones to load into them (a checkpoint's). ``pack``: logprob and
    value passes run on the rows packed end to end into a few sequences
    (:mod:`dapo_flow.models.packing`: next to no padding; the same values)."""

    max_batch_samples: int = 2048  # rows per generation batch; prompts*n above this are chunked
    host_sync_every: int = 16  # decoding steps between the host's looks at an accelerator's state

    def __init__(
        self,
        path: Path | str,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        seed: int = 0,
        trainable: bool = False,
        grad_checkpointing: bool = False,
        logprob_chunk_tokens: int | None = None,
        mixed_precision: str | None = None,
        head: str = "lm",
        lora: Any = None,
        adapters: Path | None = None,
        pack: bool = False,
        share_prompts: bool = False,
    ) -> None:
        from dapo_flow.models.heads import load_torch_model, skip_unneeded_transformers_imports

        skip_unneeded_transformers_imports()  # before the first transformers import below
        from dapo_flow.models import resolve_model

        if dtype not in DTYPES:
            raise ModelError(f"unknown dtype '{dtype}'; use one of {sorted(DTYPES)}")
        if mixed_precision is not None and mixed_precision not in MIXED_PRECISION:
            raise ModelError(f"mixed_precision {mixed_precision!r}: use None or one of {sorted(MIXED_PRECISION)}")
        self.mixed_precision = mixed_precision
        self.path = resolve_model(str(path))
        self.device = torch.device(device)
        self.seed = seed
        torch.manual_seed(seed)  # anything stochastic inside the model (none for Llama: no dropout)
        prepare_device(self.device)
        with hf_progress_bars_off(), _loading(self.path, "the model"):
            self.model = load_torch_model(self.path, head, DTYPES[dtype]).to(self.device)
        self.head = head
        self.model.eval()  # no dropout in RL: rollout and training must see the same function
        self.model.requires_grad_(trainable)
        self.lora = lora
        if lora is not None:
            self._add_adapters(lora, trainable, adapters)
        self.grad_checkpointing = grad_checkpointing
        self.logprob_chunk_tokens = logprob_chunk_tokens
        self.packed = pack
        self.share_prompts = share_prompts
        if share_prompts and (pack or logprob_chunk_tokens is not None or grad_checkpointing):
            clash = ("train.pack" if pack else "train.logprob_chunk_tokens" if logprob_chunk_tokens is not None
                     else "train.grad_checkpointing")
            raise ModelError(f"{self.path}: train.share_prompts runs each prompt once with a KV cache, which "
                             f"{clash} does not take: turn one of them off")
        capped = getattr(self.model.config, "final_logit_softcapping", None)
        if capped and (logprob_chunk_tokens is not None or pack):
            setting = "train.logprob_chunk_tokens: null" if logprob_chunk_tokens is not None else "train.pack: false"
            raise ModelError(f"{self.path}: the model soft-caps its logits after the output head, which "
                             f"chunked and packed logprobs leave out; set {setting}")
        if grad_checkpointing:  # active only in train mode: gradient passes switch to it (_grad_mode)
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self._load_tokenizer()
        self.sharded = False  # True once shard() made it one FSDP2 shard of a training group
        self.replicated = False  # True once replicate() made it one DDP replica of a training group
        self.world_size = 1
        # sequence parallelism (split_sequences): the workers that split each sequence of a
        # gradient pass, and the ranks holding other rows (one per replica), or None
        self.sequence_group = self.replica_group = None
        # the weights' policy version, and the lock between decode steps and weight loads
        self.gate = WeightGate()

    def _load_tokenizer(self) -> None:
        """The model's tokenizer, its end-of-sequence ids (the first is what a response ends
        with) and the padding id."""
        from transformers import AutoTokenizer

        with _loading(self.path, "the tokenizer"):
            self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.eos_ids = self._eos_ids()
        self.eos_id = self.eos_ids[0]
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else self.eos_id  # pads are masked; any id works

    def _add_adapters(self, lora: Any, trainable: bool, adapters: Path | None) -> None:
        from dapo_flow.models import lora as lora_lib

        if self.head != "lm":
            raise ModelError(f"{self.path}: train.lora on a model with `head: {self.head}`: its new head "
                             "must train in full, which adapters do not do; train it without lora")
        try:
            lora_lib.add_adapters(self.model, lora, trainable=trainable)
        except ValueError as exc:
            raise ModelError(f"{self.path}: {exc}") from None
        if adapters is not None:
            try:
                lora_lib.load_adapter_state(self.model, lora_lib.read_adapters(Path(adapters)))
            except ValueError as exc:
                raise ModelError(f"{adapters}: {exc}") from None

    @contextmanager
    def base_weights(self) -> Iterator[None]:
        """Forwards inside see the weights a reference model shares with this policy: under
        LoRA the base (adapters off: no second copy of the model); else the policy itself."""
        if self.lora is None:
            yield
            return
        from dapo_flow.models.lora import adapters_disabled

        with adapters_disabled(self.model):
            yield

    # --- a training group's shard (FSDP2) --------------------------------------------------------

    def shard(self, *, mixed_precision: str | None = None, cpu_offload: bool = False) -> None:
        """Make this policy one FSDP2 shard of the training group this process has joined
        (:func:`dapo_flow.models.fsdp.init_group`); an optimizer must be made afterwards.
        Gradient passes are then collectives: every worker runs the same number of them (the
        trainer, dapo_flow/training/trainer.py, agrees the counts). Sampling and logprobs
        without gradients run on the gathered weights (:meth:`gathered`), each worker on its
        own rows."""
        import torch.distributed as dist

        from dapo_flow.models import fsdp

        if self.mixed_precision is not None:
            raise ModelError("a policy made with mixed_precision computes under torch.autocast; FSDP2 "
                             "has its own policy: make it without, and pass mixed_precision to shard()")

        fsdp.shard_model(self.model, mixed_precision=mixed_precision, cpu_offload=cpu_offload)
        self.sharded, self.world_size = True, dist.get_world_size()

    def split_sequences(self, k: int) -> None:
        """Ulysses sequence parallelism over ``k`` consecutive workers of this FSDP2 group
        (:mod:`dapo_flow.models.sequence_parallel`): each gradient pass of logprobs runs this
        worker's 1/k slice of every sequence, attention exchanging heads for tokens with the
        others. Those k workers get the same rows of an update (the runtime deals rows to the
        group's replicas); passes without gradients run whole rows, each worker its own."""
        from dapo_flow.models import fsdp, sequence_parallel

        if not self.sharded:
            raise ModelError("sequence parallelism splits sequences inside an FSDP2 group: shard() first")
        if self.head != "lm":
            raise ModelError(f"{self.path}: sequence parallelism splits a language model's logprobs, "
                             f"not a `head: {self.head}` model's outputs: set train.sequence_parallel: 1")
        try:
            sequence_parallel.check_heads(self.model.config, k)
            self.sequence_group, self.replica_group = fsdp.sequence_parallel_groups(k)
            sequence_parallel.install(self.model, self.sequence_group)
        except ValueError as exc:
            raise ModelError(f"{self.path}: {exc}; set another train.sequence_parallel") from None

    def replicate(self) -> None:
        """Make this policy one DDP replica of the training group this process has joined: every
        worker holds the whole model (rank 0's weights, broadcast once) and its own optimizer;
        :meth:`reduce_gradients` averages the gradients before each optimizer step, so the
        replicas stay identical. No collective in forwards or backwards: for models that fit one
        worker, whose per-layer FSDP2 collectives would cost more than they save."""
        import torch.distributed as dist

        with torch.no_grad():
            for tensor in self.model.state_dict().values():
                dist.broadcast(tensor, src=0)
        self.replicated, self.world_size = True, dist.get_world_size()

    def reduce_gradients(self) -> None:
        """DDP: average every gradient over the group in one flat all-reduce (a parameter this
        worker's rows did not reach counts as zero). A no-op unless :meth:`replicate` ran (FSDP2
        reduces inside the backward)."""
        if not self.replicated:
            return
        import torch.distributed as dist
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        params = [p for p in self.model.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat)  # SUM: gloo has no AVG
        flat /= self.world_size
        for p, g in zip(params, _unflatten_dense_tensors(flat, grads)):
            p.grad = g

    def compute_precision(self) -> AbstractContextManager:
        """The context every forward of the policy runs in: ``torch.autocast`` to the
        mixed-precision dtype on this policy's device, or nothing (the weights' dtype)."""
        if self.mixed_precision is None:
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=MIXED_PRECISION[self.mixed_precision])

    @contextmanager
    def gathered(self) -> Iterator[None]:
        """The full weights on this worker for the block (one all-gather per layer on entry, by
        every worker of the group at once), so that forwards inside need no collective: each
        worker samples or scores its own rows, as many forwards as it needs, the way a hybrid
        engine's rollout does. The shards are restored on exit. Unsharded: nothing to do."""
        if not self.sharded:
            yield
            return
        from dapo_flow.models import fsdp

        with fsdp.unsharded(self.model):
            yield

    def _eos_ids(self) -> list[int]:
        """All stop ids: the tokenizer's EOS first, then generation_config's (may be a list)."""
        ids: list[int] = []
        gen_cfg = getattr(self.model, "generation_config", None)
        for value in (self.tokenizer.eos_token_id, getattr(gen_cfg, "eos_token_id", None)):
            for v in value if isinstance(value, (list, tuple)) else [value]:
                if v is not None and int(v) not in ids:
                    ids.append(int(v))
        if not ids:
            raise ModelError(f"{self.path}: no EOS token in the tokenizer or generation_config.json")
        return ids

    # --- sampling -------------------------------------------------------------------------------

    def generate(self, prompt_ids: list[list[int]], cfg: SamplingConfig) -> Rollouts:
        """``cfg.n`` samples per prompt. Each sample draws from its own generator, seeded by its
        prompt's seed (``cfg.seeds_for``) and its index: what a prompt samples does not depend on
        the other prompts of the batch, on the chunking, or on which replica or worker runs it.
        New weights loaded beside it (:attr:`gate`) take over from the next token: each token's
        version says which weights sampled it."""
        start = time.perf_counter()
        seeds = cfg.seeds_for(len(prompt_ids))
        responses: list[list[int]] = []
        logprobs: list[list[float]] = []
        truncated: list[bool] = []
        versions: list[list[int]] = []
        routes: list[np.ndarray] | None = [] if self._records_routes(cfg) else None
        with self.gathered():
            at = 0
            for chunk in self._prompt_chunks(prompt_ids, cfg.n):
                keys = sample_keys(seeds[at:at + len(chunk)], cfg.n)
                at += len(chunk)
                r, lp, tr, v, rt = self._generate_batch(chunk, cfg, keys)
                responses += r
                routes = routes + rt if routes is not None else None
                logprobs += lp
                truncated += tr
                versions += v
        return Rollouts.contiguous(len(prompt_ids), cfg.n, responses, logprobs, truncated,
                                   time.perf_counter() - start, versions=versions, routes=routes)

    def _records_routes(self, cfg: SamplingConfig) -> bool:
        """Whether this rollout records its tokens' expert choices: asked for, and the model has routers."""
        return cfg.record_routes and self.routing is not None

    @property
    def routing(self):
        """The model's routers (:func:`~dapo_flow.models.moe.routing_of`); None for a dense model."""
        if not hasattr(self, "_routing"):
            from dapo_flow.models.moe import routing_of

            self._routing = routing_of(self.model)
        return self._routing

    def _check_rows(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> None:
        """A response for each prompt, and prompts :meth:`_check_prompts` accepts."""
        if len(prompt_ids) != len(response_ids):
            raise ValueError(f"{len(prompt_ids)} prompts but {len(response_ids)} responses")
        self._check_prompts(prompt_ids)

    def _check_prompts(self, prompt_ids: list[list[int]]) -> None:
        """ModelError for a prompt the model cannot take: an empty one, or one holding a token id
        past its vocabulary (the embedding lookup would fail with a bare IndexError)."""
        if any(len(p) == 0 for p in prompt_ids):
            raise ModelError("empty prompt: every prompt needs at least one token (e.g. BOS)")
        vocab = self.model.get_input_embeddings().num_embeddings
        top = max((max(p) for p in prompt_ids), default=-1)
        if top >= vocab:
            raise ModelError(f"{self.path}: a prompt holds token id {top}, past the model's {vocab}-token "
                             "vocabulary: the prompts were tokenized for another model (a checkpoint of "
                             "another graph's model?)\n    fix: evaluate a checkpoint with the graph it was "
                             "trained with, or tokenize with this model's tokenizer")

    def _prompt_chunks(self, prompt_ids: list[list[int]], n: int) -> Iterator[list[list[int]]]:
        self._check_prompts(prompt_ids)
        per_chunk = max(1, self.max_batch_samples // n)
        for i in range(0, len(prompt_ids), per_chunk):
            yield prompt_ids[i : i + per_chunk]

    @torch.inference_mode()
    def _generate_batch(
        self, prompts: list[list[int]], cfg: SamplingConfig, keys: np.ndarray
    ) -> tuple[list[list[int]], list[list[float]], list[bool], list[list[int]], list[np.ndarray]]:
        """Sampled in the precision of the update's forwards (:meth:`compute_precision`): under
        bf16 autocast the sampled tokens' logprobs (``source: rollout`` old logprobs) are the
        trainer's up to bf16 rounding of the KV-cached decoding (docs/semantics.md). With
        ``cfg.record_routes`` (a model with routers) also each sample's expert choices
        (:class:`~dapo_flow.models.moe.RouteLog`), else an empty list."""
        from dapo_flow.models.moe import RouteLog, routing_recorded

        log = RouteLog(self.routing, cfg.n, cfg.max_tokens) if self._records_routes(cfg) else None
        with self.compute_precision(), routing_recorded(self.routing, log.seen) if log else nullcontext():
            responses, lps, truncated, versions = self._generate_batch_in(prompts, cfg, keys, log)
        routes = log.rows(prompts, [len(r) for r in responses]) if log else []
        return responses, lps, truncated, versions, routes

    def _prefill(self, ids: torch.Tensor, mask: torch.Tensor):
        """The KV cache of left-padded ``ids`` and the logits of each row's next token."""
        out = self.model(
            input_ids=ids, attention_mask=mask, position_ids=positions(mask), use_cache=True, logits_to_keep=1
        )
        return out.past_key_values, out.logits[:, -1].float()

    def _generate_batch_in(
        self, prompts: list[list[int]], cfg: SamplingConfig, keys: np.ndarray, log=None
    ) -> tuple[list[list[int]], list[list[float]], list[bool], list[list[int]]]:
        """The decode loop: ``cfg.n`` samples of each prompt, up to ``cfg.max_tokens`` tokens each;
        (responses, their tokens' logprobs, truncated, each token's weights version), a list per sample."""
        width = max(max(map(len, prompts), default=0), cfg.prompt_width or 0)
        prompt_ids, prompt_mask = left_pad(prompts, self.pad_id, width)
        prompt_ids, prompt_mask = prompt_ids.to(self.device), prompt_mask.to(self.device)
        # the version of the weights behind the cache and logits
        cache, logits, weights = self._prefill_samples(prompt_ids, prompt_mask, cfg.n, log)
        row_mask = prompt_mask.repeat_interleave(cfg.n, 0)  # (S, P): each sample row's prompt
        mask = row_mask
        next_pos = mask.sum(-1, keepdim=True)  # (S, 1): position of the first response token
        num = logits.shape[0]
        eos = torch.tensor(self.eos_ids, device=self.device)
        tokens, lps, lengths, done, finite = self._decode_buffers(num, cfg.max_tokens)
        step_versions: list[int] = []  # the weights' version at each step (all rows alike)
        # The host looks at the device every `every` tokens only (a CUDA sync each time): the
        # uniforms of the next `every` steps go over in one copy, and a batch whose samples all
        # ended decodes up to every-1 more steps, whose tokens are dropped (same results).
        every = 1 if self.device.type == "cpu" else self.host_sync_every
        for t in range(cfg.max_tokens):
            if t % every == 0:
                steps = range(t, min(t + every, cfg.max_tokens))
                block = torch.from_numpy(np.stack([uniforms(keys, s) for s in steps])).to(self.device)
            with self.gate.step() as version:
                if version != weights:  # new weights came: recompute the cache with them (partial rollout)
                    cache, logits, mask = self._refill(prompt_ids, row_mask, tokens[:, :t], cfg.n, log)
                    weights = version
                tok, lp, ok = self._sample(logits, cfg, block[t % every])
                step_versions.append(weights)
                finite &= ok
                tokens[:, t] = tok.masked_fill(done, self.pad_id)
                lps[:, t] = lp
                lengths += (~done).long()
                done |= torch.isin(tok, eos)
                if t + 1 == cfg.max_tokens or ((t + 1) % every == 0 and not bool(finite & ~done.all())):
                    break
                # Finished rows keep decoding (cheaper than compacting the cache); their tokens are
                # dropped (a recomputed cache reads pads there: only their own later tokens see them).
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                out = self.model(
                    input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos,
                    past_key_values=cache, use_cache=True,
                )
                logits = out.logits[:, -1].float()
                if log is not None:  # response token t was fed at column P + t
                    log.write(num, prompt_ids.shape[1] + t)
                next_pos = next_pos + 1
        return self._decoded(tokens, lps, lengths, done, finite, step_versions)

    def _decode_buffers(self, num: int, max_tokens: int
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """What the decode loop writes, on this policy's device: tokens (S, T) pad-filled, their
        logprobs (S, T), each row's length (S,), whether it ended (S,), and whether every step's
        distribution was finite ()."""
        tokens = torch.full((num, max_tokens), self.pad_id, dtype=torch.long, device=self.device)
        lps = torch.zeros((num, max_tokens), dtype=torch.float32, device=self.device)
        lengths = torch.zeros(num, dtype=torch.long, device=self.device)
        done = torch.zeros(num, dtype=torch.bool, device=self.device)
        finite = torch.ones((), dtype=torch.bool, device=self.device)
        return tokens, lps, lengths, done, finite

    def _refill(self, prompt_ids: torch.Tensor, row_mask: torch.Tensor, sampled: torch.Tensor, n: int, log=None
                ) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """The KV cache of each sample's prompt and its ``sampled`` tokens so far, recomputed by new
        weights (a partial rollout): (cache, next-token logits (S, V), attention mask (S, P+t)).
        Shape: prompt_ids (P', P), row_mask (S, P), sampled (S, t); S = P' * n."""
        mask = torch.cat([row_mask, torch.ones_like(sampled)], dim=1)
        cache, logits = self._prefill(torch.cat([prompt_ids.repeat_interleave(n, 0), sampled], dim=1), mask)
        if log is not None:  # the new weights' choices replace the old ones'
            log.write(sampled.shape[0], 0)
        return cache, logits, mask

    @staticmethod
    def _decoded(tokens: torch.Tensor, lps: torch.Tensor, lengths: torch.Tensor, done: torch.Tensor,
                 finite: torch.Tensor, step_versions: list[int]
                 ) -> tuple[list[list[int]], list[list[float]], list[bool], list[list[int]]]:
        """The decode loop's buffers as host lists, each row cut to its length: (responses,
        logprobs, truncated, versions); ModelError if a step's distribution was not finite."""
        if not bool(finite):
            raise ModelError(NONFINITE_LOGITS)
        lens = lengths.tolist()
        tok_rows, lp_rows = tokens.tolist(), lps.tolist()
        responses = [row[:n] for row, n in zip(tok_rows, lens)]
        return (responses, [row[:n] for row, n in zip(lp_rows, lens)], (~done).tolist(),
                [step_versions[:n] for n in lens])

    def _prefill_samples(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, n: int, log=None
                         ) -> tuple[Any, torch.Tensor, int]:
        """Each prompt prefilled once, its KV cache fanned out to its ``n`` samples: (cache,
        last logits (P*n, V), the weights' version). Shape: prompt_ids, prompt_mask (P, L)."""
        with self.gate.step() as version:
            cache, logits = self._prefill(prompt_ids, prompt_mask)
            if log is not None:  # each prompt token's experts, for its n samples
                log.write(prompt_ids.shape[0], 0)
            logits = logits.repeat_interleave(n, 0)  # (S, V)
            if n > 1:
                cache.batch_repeat_interleave(n)
        return cache, logits, version

    @staticmethod
    def _sample(logits: torch.Tensor, cfg: SamplingConfig, u: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Next tokens and their logprobs under log_softmax(logits / T); row s takes the token
        where its uniform ``u[s]`` falls in the cumulative distribution (inverse-CDF sampling,
        float64); and whether every row's distribution was finite (a 0-dim bool on the logits'
        device, read by the caller when it next syncs). Shape: (S, V), (S,) -> (S,), (S,), ()."""
        if cfg.temperature == 0:
            tok = logits.argmax(-1)
            return tok, logprobs_from_logits(logits, tok), torch.isfinite(logits).all()
        scaled = logits / cfg.temperature
        probs = filter_top_k_top_p(scaled, cfg.top_k, cfg.top_p).softmax(-1)
        cdf = probs.double().cumsum(-1)
        finite = torch.isfinite(cdf[:, -1]).all()
        # side=right: the first token whose cumulative mass exceeds u, never a zero-mass one
        tok = torch.searchsorted(cdf, (u.double() * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
        tok = tok.clamp_(max=probs.shape[-1] - 1)
        return tok, logprobs_from_logits(scaled, tok), finite

    def to_device(self, value: Any) -> Any:
        """Host arrays (numpy, tensors; nested in dicts, lists, tuples) on this policy's device:
        how a loss's inputs from the batch meet the outputs of a gradient pass
        (:mod:`dapo_flow.models.devices`)."""
        return to_device(value, self.device)

    # --- logprob recomputation --------------------------------------------------------------------

    def pack(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> dict[str, torch.Tensor]:
        """Model inputs for prompt+response rows (prompt left-padded, response right-padded).

        Shape: input_ids / attention_mask / position_ids (B, P+R); response_ids and
        response_mask (B, R); response_start () = P, so the logits predicting the response are
        ``logits[:, P-1 : P+R-1]``.
        """
        self._check_rows(prompt_ids, response_ids)
        p_ids, p_mask = left_pad(prompt_ids, self.pad_id)
        r_ids, r_mask = right_pad(response_ids, self.pad_id, max(1, max(map(len, response_ids), default=1)))
        mask = torch.cat([p_mask, r_mask], dim=1)
        return {
            "input_ids": torch.cat([p_ids, r_ids], dim=1),
            "attention_mask": mask,
            "position_ids": positions(mask),
            "response_ids": r_ids,
            "response_mask": r_mask.bool(),
            "response_start": torch.tensor(p_ids.shape[1]),
        }

    def response_logprobs(
        self,
        prompt_ids: list[list[int]],
        response_ids: list[list[int]],
        *,
        temperature: float = 1.0,
        micro_batch_size: int = 64,
        with_entropy: bool = False,
        grad: bool = False,
        routes: list | None = None,
        tally: Any = None,
        top_k: int = 0,
        at_ids: torch.Tensor | None = None,
    ) -> tuple:
        """Per-token log p(response | prompt) under ``softmax(logits / temperature)``.

        ``top_k`` > 0 (a teacher's, for top-K distillation) or ``at_ids`` (B, R, K) (a student's,
        at its teacher's top-K): a fourth result ``(ids, logp)``, each (B, R, K), log p at the K
        most likely tokens of each response position (decreasing) or at ``at_ids``, from the same
        logits (gathered, no second vocabulary-wide tensor); id 0 and logp 0 at padding. Not
        with chunked logprobs (``train.logprob_chunk_tokens``) nor sequence parallelism.

        ``routes``: each row's recorded expert choices (a rollout's, :attr:`Rollouts.routes`), replayed
        in every pass (R3, :func:`~dapo_flow.models.moe.routing_replayed`): each token goes to
        the experts the rollout sent it to, weighted by the current router; ``tally``
        (:class:`~dapo_flow.models.moe.ReplayTally`) adds up how often the router would have
        chosen them itself.

        ``grad=True``: one autograd pass over all rows (the caller micro-batches the update),
        the results on this policy's device (bring the loss's other inputs with
        :meth:`to_device`); otherwise inference mode, ``micro_batch_size`` rows at a time, the
        results on the host.
        Shape: -> logp (B, R) float32 (0 at padding), entropy (B, R) or None, response_mask (B, R) bool.
        """
        temp = temperature or 1.0  # greedy rollouts are scored at temperature 1
        pick = {"top_k": top_k, "at_ids": at_ids} if top_k or at_ids is not None else {}
        if pick and (top_k and at_ids is not None):
            raise ValueError("response_logprobs takes top_k or at_ids, not both")
        if grad and self.share_prompts:
            if routes is not None or self.sequence_group is not None:
                what = "routing replay" if routes is not None else "sequence parallelism"
                raise ModelError(f"{self.path}: {what} with train.share_prompts is not built: "
                                 "set train.share_prompts: false")
            self._check_rows(prompt_ids, response_ids)
            with self._grad_mode(), self.compute_precision():
                return shared_prompt_logprobs_of(self.model, prompt_ids, response_ids, self.pad_id, self.device,
                                                 temperature=temp, with_entropy=with_entropy, **pick)
        if grad and self.sequence_group is not None:
            if pick:  # validate refuses the pair (update's distill_topk_coef); a direct caller gets told too
                raise ModelError(f"{self.path}: top-K logprobs (distill_topk_coef) with sequence parallelism are "
                                 "not built: set train.sequence_parallel: 1")
            if routes is not None:  # validate refuses the pair; a direct caller gets told too
                raise ModelError(f"{self.path}: routing replay with sequence parallelism is not built: "
                                 "set train.routing_replay: false or train.sequence_parallel: 1")
            return self._split_logprobs(prompt_ids, response_ids, temp, with_entropy)
        replay = self._replay(prompt_ids, response_ids, routes, tally)
        if self.packed:
            return self._packed_logprobs(prompt_ids, response_ids, temp, micro_batch_size, with_entropy, grad,
                                         replay, **pick)

        def one_pass(rows: slice) -> tuple:
            with replay(rows):
                return self._logprobs_pass(batch, rows, temp, with_entropy, **_rows_of(pick, rows))

        batch = {k: v.to(self.device) for k, v in self.pack(prompt_ids, response_ids).items()}
        if grad:
            with self._grad_mode():
                out = one_pass(slice(None))
            return (out[0], out[1], batch["response_mask"], *out[2:])
        with self.gathered(), torch.inference_mode():
            parts = [one_pass(slice(i, i + micro_batch_size)) for i in range(0, len(prompt_ids), micro_batch_size)]
        return to_host(_joined(parts, batch["response_mask"], with_entropy, pick))

    def _replay(self, prompt_ids: list[list[int]], response_ids: list[list[int]], routes: list | None, tally: Any):
        """``replay(rows)``: the context a pass over ``rows`` (a slice of these rows) runs in: the
        rows' recorded routes replayed (:func:`~dapo_flow.models.moe.routing_replayed`), laid out
        as that pass lays out its tokens; nothing without ``routes``."""
        if routes is None or not prompt_ids:  # nothing to replay (no rows: no forward either)
            return lambda rows: nullcontext()
        from dapo_flow.models.moe import ReplayTally, flat_choices, routing_replayed

        if self.routing is None:
            raise ModelError(f"{self.path}: routing replay asked for, but the model has no experts (no routers)")
        if len(routes) != len(prompt_ids):
            raise ValueError(f"{len(routes)} rows of routes for {len(prompt_ids)} rows")
        routes = [torch.as_tensor(r) for r in routes]
        tally = tally if tally is not None else ReplayTally()
        # the layouts move to the model's device here, once per pass, as the batch does (not per layer)
        if self.packed:  # each pass packs its own rows: lay its routes out the same way
            return lambda rows: routing_replayed(self.routing, flat_choices(
                routes[rows], prompt_ids[rows], response_ids[rows], packed=True).to(self.device), tally)
        # one padded layout for all rows (pack()'s widths), sliced per pass as the batch is
        flat = flat_choices(routes, prompt_ids, response_ids, packed=False).to(self.device)  # (B x W, L, k)
        flat = flat.reshape(len(prompt_ids), -1, *flat.shape[1:])  # (B, W, L, k)
        return lambda rows: routing_replayed(self.routing, flat[rows].reshape(-1, *flat.shape[2:]), tally)

    def _packed_logprobs(self, prompt_ids: list[list[int]], response_ids: list[list[int]], temperature: float,
                         micro_batch_size: int, with_entropy: bool, grad: bool, replay=None, **pick
                         ) -> tuple:
        """:meth:`response_logprobs` with each pass's rows packed into bins (``train.pack``)."""
        from dapo_flow.models.packing import pack_rows

        self._check_prompts(prompt_ids)
        width = max(1, max(map(len, response_ids), default=1))  # as pack(): one column at least

        def one_pass(rows: slice) -> tuple:
            packed = pack_rows(prompt_ids[rows], response_ids[rows], width)
            with self.compute_precision(), replay(rows) if replay else nullcontext():
                return packed_logprobs_of(self.model, packed, self.device, temperature=temperature,
                                          with_entropy=with_entropy, chunk_tokens=self.logprob_chunk_tokens,
                                          **_rows_of(pick, rows))

        mask = right_pad(response_ids, self.pad_id, width)[1].bool()  # (B, R), as pack() makes it
        if grad:
            if not prompt_ids:
                return _joined([], mask.to(self.device), False, pick)
            with self._grad_mode():
                out = one_pass(slice(None))
            return (out[0], out[1], mask.to(self.device), *out[2:])
        with self.gathered(), torch.inference_mode():
            parts = [one_pass(slice(i, i + micro_batch_size)) for i in range(0, len(prompt_ids), micro_batch_size)]
        return to_host(_joined(parts, mask, with_entropy, pick))

    def _split_logprobs(self, prompt_ids: list[list[int]], response_ids: list[list[int]], temperature: float,
                        with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """:meth:`response_logprobs`' gradient pass split over the sequence-parallel group: the
        rows packed (``train.pack``) or padded as the unsplit pass lays them out, each position
        predicting a response token marked, then :func:`split_logprobs_of`."""
        from dapo_flow.models.packing import pack_rows

        self._check_prompts(prompt_ids)
        width = max(1, max(map(len, response_ids), default=1))
        mask = right_pad(response_ids, self.pad_id, width)[1].bool()  # (B, R)
        if self.packed:
            packed = pack_rows(prompt_ids, response_ids, width)
            ids, pos = packed.input_ids, packed.position_ids
            keep = torch.ones_like(ids, dtype=torch.bool)  # a bin's tail is a segment of its own
            flat, targets = packed.predict, packed.targets
        else:
            batch = self.pack(prompt_ids, response_ids)
            mask = batch["response_mask"]
            ids, pos, keep = batch["input_ids"], batch["position_ids"], batch["attention_mask"].bool()
            start = int(batch["response_start"])  # response token j is predicted at start - 1 + j
            rows, cols = mask.nonzero(as_tuple=True)
            flat = rows * ids.shape[1] + start - 1 + cols
            targets = batch["response_ids"][mask]
        predict = torch.zeros(ids.numel(), dtype=torch.bool)
        predict[flat] = True
        target_ids = torch.zeros(ids.numel(), dtype=torch.long)
        target_ids[flat] = targets
        dev = self.device
        with self._grad_mode(), self.compute_precision():
            logp, ent = split_logprobs_of(self.model, ids.to(dev), pos.to(dev), keep.to(dev),
                                          predict.view(ids.shape).to(dev), target_ids.view(ids.shape).to(dev),
                                          self.sequence_group, temperature=temperature, with_entropy=with_entropy,
                                          chunk_tokens=self.logprob_chunk_tokens)
        flat, mask = flat.to(dev), mask.to(dev)
        out = [_unpack(v.reshape(-1)[flat], mask) for v in (logp, ent) if v is not None]
        return out[0], out[1] if with_entropy else None, mask

    def response_values(
        self,
        prompt_ids: list[list[int]],
        response_ids: list[list[int]],
        *,
        micro_batch_size: int = 64,
        grad: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A value model's value of each response token's state: V_t is read at the position
        before token t (the prompt's last token for the first), as verl's critic reads
        ``values[:, -R-1:-1]``: the value of the context the token is sampled from.

        ``grad=True``: one autograd pass over all rows, on this policy's device; otherwise
        inference mode, ``micro_batch_size`` rows at a time, on the host.
        Shape: -> values (B, R) float32 (0 at padding), response_mask (B, R) bool.
        """
        batch = self._scalar_head_batch("value", prompt_ids, response_ids)
        empty = batch["response_mask"].float()  # (0, R) when there are no rows
        if self.packed:  # the rows' ids, packed per pass (the padded batch gives the mask and width)
            batch = {**batch, "prompts": prompt_ids, "responses": response_ids}
        one_pass = self._packed_values_pass if self.packed else self._values_pass
        values = self._by_rows(one_pass, batch, micro_batch_size, grad, empty)
        return (values, batch["response_mask"]) if grad else to_host((values, batch["response_mask"]))

    def response_scores(self, prompt_ids: list[list[int]], response_ids: list[list[int]], *,
                        micro_batch_size: int = 64, grad: bool = False) -> torch.Tensor:
        """A reward model's score of each response: its head read at the sequence's last real
        token (the response's last, EOS included; the prompt's for an empty response), as HF's
        sequence classifiers and verl's RM worker read it. Read here rather than through the
        model's own forward, which finds the last token from the pad id and so misreads
        left-padded prompts. ``grad=True``: one autograd pass over all rows (training a reward
        model: on this policy's device); otherwise inference mode, ``micro_batch_size`` rows at a
        time, on the host.
        Shape: -> scores (B,) float32."""
        batch = self._scalar_head_batch("reward", prompt_ids, response_ids)
        scores = self._by_rows(self._scores_pass, batch, micro_batch_size, grad, torch.zeros(0, device=self.device))
        return scores if grad else to_host(scores)

    def _scalar_head_batch(self, head: str, prompt_ids: list[list[int]],
                           response_ids: list[list[int]]) -> dict[str, torch.Tensor]:
        """:meth:`pack`'s rows on this device, for a model of ``head`` (`value` or `reward`)."""
        if self.head != head:
            gives, what = ("values", "a critic") if head == "value" else ("sequence scores", "a reward model")
            raise ModelError(f"{self.path} is loaded with `head: {self.head}`, which gives no {gives}: "
                             f"declare the model with `head: {head}` ({what})")
        return {k: v.to(self.device) for k, v in self.pack(prompt_ids, response_ids).items()}

    def _by_rows(self, one_pass, batch: dict[str, torch.Tensor], micro_batch_size: int, grad: bool,
                 empty: torch.Tensor) -> torch.Tensor:
        """``one_pass(batch, rows)`` over all rows: one autograd pass with ``grad``, else
        ``micro_batch_size`` rows at a time in inference mode on the gathered weights; the
        results concatenated along the rows (``empty`` when there are none)."""
        if grad:
            with self._grad_mode():
                return one_pass(batch, slice(None))
        rows = batch["input_ids"].shape[0]
        with self.gathered(), torch.inference_mode():
            parts = [one_pass(batch, slice(i, i + micro_batch_size)) for i in range(0, rows, micro_batch_size)]
        return torch.cat(parts) if parts else empty

    def _values_pass(self, batch: dict[str, torch.Tensor], rows: slice) -> torch.Tensor:
        inputs = {k: batch[k][rows] for k in ("input_ids", "attention_mask", "position_ids")}
        start, mask = int(batch["response_start"]), batch["response_mask"][rows]
        with self.compute_precision():
            out = self.model(**inputs, use_cache=False).logits  # (b, P+R, 1)
        values = out[:, start - 1 : start - 1 + mask.shape[1], 0].float()
        return values.masked_fill(~mask, 0.0)

    def _packed_values_pass(self, batch: dict, rows: slice) -> torch.Tensor:
        """:meth:`_values_pass` on ``rows`` packed into bins. Shape: -> (b, R) float32."""
        from dapo_flow.models.packing import pack_rows

        packed = pack_rows(batch["prompts"][rows], batch["responses"][rows], batch["response_mask"].shape[1])
        with self.compute_precision():
            out = self.model(input_ids=packed.input_ids.to(self.device),
                             position_ids=packed.position_ids.to(self.device), use_cache=False).logits  # (bins, L, 1)
        return packed.unpack(out.reshape(-1)[packed.predict.to(self.device)].float())

    def _scores_pass(self, batch: dict[str, torch.Tensor], rows: slice) -> torch.Tensor:
        """The score head at each row's last real token. Shape: -> (b,) float32."""
        from dapo_flow.models.heads import value_head

        last = int(batch["response_start"]) + batch["response_mask"][rows].sum(1) - 1  # (b,)
        backbone = getattr(self.model, self.model.base_model_prefix)
        with self.compute_precision():
            hidden = backbone(input_ids=batch["input_ids"][rows], attention_mask=batch["attention_mask"][rows],
                              position_ids=batch["position_ids"][rows], use_cache=False).last_hidden_state
            at_last = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
            return value_head(self.model)(at_last)[:, 0].float()

    @contextmanager
    def _grad_mode(self) -> Iterator[None]:
        """Train mode for a gradient pass when checkpointing (HF recomputes layers only in train
        mode; the model has no dropout, so nothing else changes), eval mode again after, so
        generation keeps its KV cache."""
        with ExitStack() as stack:
            if self.lora is not None and self.lora.dropout > 0:  # the adapters' dropout: gradient passes only
                from dapo_flow.models.lora import dropout_active

                stack.enter_context(dropout_active(self.model))
            if self.grad_checkpointing:
                self.model.train()
                stack.callback(self.model.eval)
            yield

    def _logprobs_pass(
        self, batch: dict[str, torch.Tensor], rows: slice, temperature: float, with_entropy: bool, **pick
    ) -> tuple:
        inputs = {k: batch[k][rows] for k in ("input_ids", "attention_mask", "position_ids")}
        with self.compute_precision():  # the same precision with and without gradients: ratios start at 1
            return response_logprobs_of(self.model, inputs, batch["response_ids"][rows],
                                        batch["response_mask"][rows], temperature=temperature,
                                        with_entropy=with_entropy, chunk_tokens=self.logprob_chunk_tokens, **pick)

    # --- weights ----------------------------------------------------------------------------------

    def named_weights(self) -> dict[str, np.ndarray]:
        """float32 copies of every weight, ``lm_head.weight`` included even when tied. Sharded:
        every worker of the group must call it (each gets the full weights)."""
        out = {k: v.detach().to("cpu", torch.float32, copy=True).numpy() for k, v in self._weights()}
        if self.head == "lm" and "lm_head.weight" not in out:  # tied embeddings: engines such as vLLM still want it
            head = self.model.get_output_embeddings().weight
            out["lm_head.weight"] = _full(head).detach().to("cpu", torch.float32, copy=True).numpy()
        return out

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every weight as (HF name, full tensor in the model's dtype), one at a time, views of the
        model's own where it is not sharded: a weight sync streams them into an engine with about
        one tensor of extra memory, never a copy of the model. ``lm_head.weight`` is included
        when tied. Sharded: each tensor is gathered on the way (a collective: every worker of the
        group iterates in step)."""
        names = set()
        for name, value in self._weights():
            names.add(name)
            yield name, value.detach()
        if self.head == "lm" and "lm_head.weight" not in names:  # tied embeddings: engines such as vLLM still want it
            yield "lm_head.weight", _full(self.model.get_output_embeddings().weight).detach()

    def weight_manifest(self) -> list:
        """What :meth:`iter_weights` yields, without gathering anything: each weight's name,
        full shape and dtype, in the same order (a broadcast sync's plan: models.weight_bus)."""
        from dapo_flow.models.weight_bus import manifest_of

        if self.lora is not None:
            from dapo_flow.models.lora import merged_manifest_pairs

            pairs = merged_manifest_pairs(self.model)
        else:
            pairs = list(self.model.state_dict().items())
        if self.head == "lm" and "lm_head.weight" not in dict(pairs):
            pairs.append(("lm_head.weight", self.model.get_output_embeddings().weight))
        return manifest_of(pairs)

    def _weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) of every weight of the state dict: under LoRA the merged
        model's, under the base names (what an engine without adapters loads)."""
        if self.lora is not None:
            from dapo_flow.models.lora import merged_weights

            yield from merged_weights(self.model, _full)
            return
        for name, value in self.model.state_dict().items():
            yield name, _full(value)

    @property
    def weights_version(self) -> int:
        """The policy version of the weights (RL steps trained into them; each sampled token
        reports the version that sampled it)."""
        return self.gate.version

    def set_weights_version(self, version: int) -> None:
        """The weights are now ``version`` (the trainer changed them in place, or they were
        loaded from a checkpoint of it)."""
        self.gate.set_version(version)

    def load_weights(self, weights: Mapping[str, Any] | Iterable[tuple[str, Any]],
                     version: int | None = None) -> None:
        """Copy ``weights`` (a mapping, as from :meth:`named_weights`, or (name, tensor) pairs,
        as from :meth:`iter_weights`) into the model, in place; every weight must come. Each is
        cast to this model's own dtype (float32 master weights into a bfloat16 rollout copy).
        ``version``: the policy version they are (None: as before). A generation running in
        another thread pauses between two tokens for the load and goes on with these weights."""
        if self.sharded or self.lora is not None:
            raise ModelError("a trained policy (a group's shard, or LoRA's) takes no weights from outside "
                             "(it is the source of weight syncs, not a target)")
        with self.gate.loading(version):
            self._load_weights(weights)

    def _load_weights(self, weights: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> None:
        params = self.model.state_dict()
        seen, unknown = set(), []
        with torch.no_grad():
            for name, value in (weights.items() if isinstance(weights, Mapping) else weights):
                if name not in params:
                    if name != "lm_head.weight":  # of a tied model: the embedding's tensor
                        unknown.append(name)
                    continue
                target = params[name]
                if tuple(target.shape) != tuple(value.shape):
                    raise ModelError(f"weight '{name}': shape {tuple(value.shape)} != model's {tuple(target.shape)}")
                target.copy_(weight_tensor(value))
                seen.add(name)
        missing = sorted(set(params) - seen)
        if missing or unknown:
            raise ModelError(f"weights do not match the model: missing {missing[:5]}, unexpected {unknown[:5]}")

    def close(self) -> None:
        """Nothing to release: the torch model lives as long as the actor."""

    def save(self, out_dir: Path | str) -> Path:
        """A Hugging Face model directory (weights, config, tokenizer) that ``path:`` can point at.
        Sharded: every worker must call it; the first writes the gathered weights."""
        out = Path(out_dir)
        if self.lora is not None:
            return self._save_adapters(out)
        if self.sharded:
            from dapo_flow.models import fsdp

            state = fsdp.full_state_dict(self.model)  # a collective: on rank 0 only
            if fsdp.rank() == 0:
                save_hf_dir(out, self.model, self.tokenizer, state_dict=dict(state))
            return out
        save_hf_dir(out, self.model, self.tokenizer)
        return out

    def _save_adapters(self, out: Path) -> Path:
        """LoRA: the adapters in peft's format, the tokenizer and a note naming the base (the
        model directory this policy loaded); every worker of a sharded group must call it."""
        from dapo_flow.models import fsdp
        from dapo_flow.models.lora import adapter_state, save_adapters

        state = adapter_state(self.model, _full)  # sharded: a collective
        if not self.sharded or fsdp.rank() == 0:
            save_adapters(out, state, self.lora, base=self.path)
            self.tokenizer.save_pretrained(out)
        return out


def save_hf_dir(out: Path, model, tokenizer, state_dict: dict | None = None) -> None:
    """``save_pretrained`` of the model (its own weights, or ``state_dict``) and tokenizer."""
    with hf_progress_bars_off():
        model.save_pretrained(out, state_dict=state_dict)
    tokenizer.save_pretrained(out)


def weight_tensor(value: Any) -> torch.Tensor:
    """A weight as a torch tensor without copying it: a tensor as it is, a numpy array viewed
    (read-only ones from Ray's object store too: whoever loads it copies it into its own)."""
    if isinstance(value, torch.Tensor):
        return value
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(np.asarray(value))


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (a collective over its mesh); a plain tensor as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def rollout_engine(path: Path | str, *, dtype: str, device: str, seed: int,
                   trainer: HFPolicy | None = None, options=None) -> HFPolicy:
    """The `hf` backend's engine (:data:`dapo_flow.models.engines.BACKENDS`): the trained policy
    itself when the actor trains the model (the hybrid engine), else a frozen copy."""
    if trainer is not None:
        return trainer
    return HFPolicy(path, dtype=dtype, device=device, seed=seed, trainable=False)
