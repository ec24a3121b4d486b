"""Ulysses sequence parallelism (dapo_flow.models.sequence_parallel): the sequence dimension's
padding and slices, the segment mask, and, with two real processes over gloo, a tiny Llama's
logprobs, entropy and gradients split over the two equal the unsplit forward's."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dapo_flow.core.ports import free_port
from dapo_flow.models.hf import positions
from dapo_flow.models.packing import pack_rows
from dapo_flow.models import sequence_parallel as sp

TOL = 1e-5


def test_padding_and_slices_cover_the_sequence_once():
    x = torch.arange(2 * 7).reshape(2, 7)
    assert sp.padded_length(7, 2) == 8 and sp.padded_length(8, 4) == 8 and sp.padded_length(1, 3) == 3
    parts = [sp.split_sequence(x, 3, r, value=-1) for r in range(3)]
    assert [tuple(p.shape) for p in parts] == [(2, 3)] * 3
    joined = torch.cat(parts, dim=1)
    assert torch.equal(joined[:, :7], x) and (joined[:, 7:] == -1).all()


def test_the_segment_mask_keeps_attention_inside_each_row():
    """Two rows packed in one bin (positions restart) and a tail: each query sees its own row's
    earlier tokens only; a padding query sees only itself."""
    pos = torch.tensor([[0, 1, 2, 0, 1, 0]])
    keep = torch.tensor([[True, True, True, True, True, False]])
    mask = sp.segment_causal_mask(pos, keep)[0, 0]
    want = torch.zeros(6, 6, dtype=torch.bool)
    for q, k in [(0, 0), (1, 0), (1, 1), (2, 0), (2, 1), (2, 2), (3, 3), (4, 3), (4, 4), (5, 5)]:
        want[q, k] = True
    assert torch.equal(mask, want)


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)  # the same weights in every process
    config = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config).float()


def _cases() -> list[dict]:
    """A packed micro-batch (bins of rows, odd length: split with padding) and a padded one
    (left-padded prompts, right-padded responses), each with a loss weight per position."""
    g = torch.Generator().manual_seed(1)
    prompts = [[3, 5, 7], [2, 9], [11, 4, 6, 8], [1]]
    responses = [[12, 13, 14, 15], [16, 17], [18], [19, 20, 21, 22, 23, 24]]
    packed = pack_rows(prompts, responses)
    ids = packed.input_ids
    keep = torch.ones_like(ids, dtype=torch.bool)
    padded_ids = torch.tensor([[0, 0, 3, 5, 7, 12, 13, 0, 0], [11, 4, 6, 8, 18, 19, 20, 21, 22]])
    padded_keep = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 0, 0], [1] * 9], dtype=torch.bool)
    out = []
    for ids, pos, keep, mask in [(packed.input_ids, packed.position_ids, keep, None),
                                 (padded_ids, positions(padded_keep.long()), padded_keep, padded_keep.long())]:
        targets = torch.roll(ids, -1, dims=1)
        weight = torch.rand(ids.shape, generator=g) * keep
        weight[:, -1] = 0  # the last position predicts nothing
        out.append({"ids": ids, "pos": pos, "keep": keep, "mask": mask, "targets": targets, "weight": weight})
    return out


def _loss(logp: torch.Tensor, ent: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A token-level loss of both outputs. Shape: (B, L) x3 -> ()."""
    return -(logp * weight).sum() - 0.1 * (ent * weight).sum()


def _unsplit(model, case: dict) -> tuple[torch.Tensor, torch.Tensor, dict]:
    from dapo_flow.algos.logprobs import entropy_from_logits, logprobs_from_logits

    model.zero_grad()
    logits = model(input_ids=case["ids"], position_ids=case["pos"], attention_mask=case["mask"],
                   use_cache=False).logits.float()
    logp, ent = logprobs_from_logits(logits, case["targets"]), entropy_from_logits(logits)
    _loss(logp, ent, case["weight"]).backward()
    return logp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _split(model, case: dict, group, chunk_tokens: int | None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    from dapo_flow.models.hf import split_logprobs_of

    model.zero_grad()
    predict = case["weight"] > 0
    logp, ent = split_logprobs_of(model, case["ids"], case["pos"], case["keep"], predict, case["targets"], group,
                                  with_entropy=True, chunk_tokens=chunk_tokens)
    _loss(logp, ent, case["weight"]).backward()
    grads = {}
    for n, p in model.named_parameters():
        dist.all_reduce(p.grad, group=group)  # each worker's backward covers its own tokens
        grads[n] = p.grad.clone()
    return logp.detach(), ent.detach(), grads


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        model = _model()
        diffs = []
        # the output head at once, in chunks, and with activation checkpointing (the backward
        # recomputes each layer's forward, after the forward's call returned)
        for case, chunk, recompute in zip(_cases() * 3, (None, None, 5, 5, None, None), (False,) * 4 + (True,) * 2):
            if recompute:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
                model.train()  # HF recomputes only in train mode (the model has no dropout)
            ref = _unsplit(model, case)
            sp.install(model, dist.group.WORLD)
            try:
                again = _unsplit(model, case)  # a forward of whole rows runs the model's own attention
                got = _split(model, case, dist.group.WORLD, chunk)
                split_attention = model.config._attn_implementation
            finally:
                sp.uninstall(model)
            real = case["weight"] > 0
            grad = max(float((ref[2][n] - got[2][n]).abs().max()) for n in ref[2])
            scale = max(float(g.abs().max()) for g in ref[2].values())
            diffs.append({"logp": float((ref[0] - got[0])[real].abs().max()),
                          "entropy": float((ref[1] - got[1])[real].abs().max()), "grad": grad,
                          "grad_scale": scale, "attention": (split_attention, model.config._attn_implementation),
                          "whole_rows": float((ref[0] - again[0]).abs().max())})
        torch.save(diffs, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two spawned processes that import transformers: ~55 s on 2 busy cores
def test_two_workers_split_a_sequence_into_the_unsplit_logprobs_entropy_and_gradients(tmp_path):
    """Packed bins and padded rows, k = 2 (a sequence of odd length is padded to split), the
    output head at once and in chunks, with and without activation checkpointing: every
    predicting position's logprob and entropy, and every parameter's gradient of a token-level
    loss (summed over the two workers), equal the unsplit forward's to 1e-5 (measured: 7.2e-7)."""
    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=2)
    for rank in range(2):
        for case in torch.load(tmp_path / f"rank{rank}.pt"):
            assert case["logp"] <= TOL and case["entropy"] <= TOL, case
            assert case["grad"] <= TOL and case["grad_scale"] > 1e-3, case  # gradients that are there
            assert case["attention"] == ("ulysses_sdpa", "sdpa")  # installed, then the model's own again
            assert case["whole_rows"] == 0.0


def test_heads_that_do_not_split_evenly_are_refused():
    from types import SimpleNamespace

    config = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2)
    sp.check_heads(config, 2)
    try:
        sp.check_heads(config, 4)  # 4 query heads but 2 key/value heads
    except ValueError as e:
        assert "2 key/value heads" in str(e)
    else:
        raise AssertionError("4 workers accepted for 2 key/value heads")
