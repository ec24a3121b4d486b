"""The numba kernels behind outcome_advantages on CPU agree with the plain torch/numpy path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from dapo_flow import algos

from dapo_flow.algos import advantages as advantages_module
from dapo_flow.algos import kernels
from dapo_flow.algos import AlgoError, factorize, outcome_advantages, sequence_advantages


@pytest.fixture(autouse=True)
def kernels_for_small_inputs(monkeypatch):
    """The kernels skip inputs under MIN_ELEMENTS; these tests use small ones on purpose."""
    monkeypatch.setattr(kernels, "MIN_ELEMENTS", 1)


@pytest.fixture
def torch_path(monkeypatch):
    """outcome_advantages with both kernels declining, i.e. the torch/numpy reference path."""
    monkeypatch.setattr(advantages_module, "grpo_token_advantages", lambda *a, **k: None)
    monkeypatch.setattr(advantages_module, "masked_broadcast", lambda *a, **k: None)

    def run(*args, **kwargs):
        return outcome_advantages(*args, **kwargs)

    return run


def _batch(seed: int, rows: int = 64, width: int = 20, groups: int = 11, contiguous: bool = False):
    """Scores at the last valid token plus some at masked positions, constant groups (0.7f,
    the value whose float32 mean is inexact), singletons, holes in the mask; group members
    scattered, or adjacent (`contiguous`, verl's layout)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, width + 1, rows)
    mask = torch.from_numpy(np.arange(width)[None, :] < lengths[:, None])
    mask[torch.from_numpy(rng.uniform(size=(rows, width)) < 0.1)] = False
    ids = rng.integers(0, groups, rows)
    ids[:3] = [100, 101, 102]  # singletons
    scores = rng.choice([-1.0, 0.0, 0.5, 1.0, 2.3], rows).astype(np.float32)
    scores[ids == 4] = 0.7
    rewards = torch.zeros(rows, width)
    rewards[torch.arange(rows), torch.from_numpy(lengths - 1)] = torch.from_numpy(scores)
    rewards[:, -1] += torch.from_numpy((rng.uniform(size=rows) < 0.2).astype(np.float32))  # masked reward counts
    if contiguous:
        order = torch.from_numpy(np.argsort(ids, kind="stable"))
        rewards, mask, ids = rewards[order].contiguous(), mask[order].contiguous(), ids[order.numpy()]
    return rewards, mask, ids


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mask_kind", ["bool", "float"])
@pytest.mark.parametrize("layout", ["scattered", "contiguous"])
@pytest.mark.parametrize("zeroed", [False, True])
def test_grpo_kernel_matches_torch_path(torch_path, seed, norm, dtype, mask_kind, layout, zeroed):
    rewards, mask, ids = _batch(seed, contiguous=layout == "contiguous")
    g = factorize(ids)
    assert bool(kernels._kernels().run_starts(g.codes, g.n_groups).size) == (layout == "contiguous")
    rewards = rewards.to(dtype)
    m = mask if mask_kind == "bool" else mask.to(dtype)
    # zeroed: `out` is known to be all zeros (a fresh mapping) and zeros are not stored again
    out = torch.zeros_like(rewards) if zeroed else torch.full_like(rewards, float("nan"))
    assert kernels.grpo_token_advantages(rewards, m, g.codes, g.n_groups, norm, algos.GRPO_EPS, out,
                                         zeroed) is True
    ref = torch_path(rewards, m, ids, "grpo", norm_by_std=norm)
    assert_close(out, ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(out == 0, ref == 0)  # exact zeros in the same places (constant groups, mask)
    assert_close(outcome_advantages(rewards, m, ids, "grpo", norm_by_std=norm), out, rtol=0, atol=0)


@pytest.mark.parametrize("estimator", ["rloo", "opo", "reinforce_pp_baseline", "grpo_passk"])
def test_masked_broadcast_kernel_matches_torch_path(torch_path, estimator):
    rewards, mask, ids = _batch(3)
    ids = np.repeat(np.arange(16), 4)  # grpo_passk needs >= 2 per group
    assert_close(outcome_advantages(rewards, mask, ids, estimator), torch_path(rewards, mask, ids, estimator))
    fm = mask.float() * 0.5  # a float mask weights the advantage (verl: adv * mask)
    assert_close(outcome_advantages(rewards, fm, ids, estimator), torch_path(rewards, fm, ids, estimator))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_masked_broadcast_into_zeroed_output_keeps_signed_zeros(dtype):
    """With a known-zero output only selected tokens of rows not equal to +0.0 are stored; a
    -0.0 advantage is still written (bit-identical to torch.where)."""
    values = torch.tensor([1.5, 0.0, -0.0, -2.0] * 4, dtype=dtype)
    mask = torch.rand(16, 9, generator=torch.Generator().manual_seed(0)) < 0.6
    ref = torch.where(mask, values[:, None], torch.zeros((), dtype=dtype))
    out = torch.zeros(16, 9, dtype=dtype)
    assert kernels.masked_broadcast(values, mask, out, zeroed=True) is out
    assert torch.equal(out, ref) and torch.equal(out.signbit(), ref.signbit())


def test_new_output_is_a_zeroed_huge_page_mapping_when_large(monkeypatch):
    like = torch.ones(64, 1024)
    small, zeroed = kernels.new_output(like)
    assert not zeroed and small.shape == like.shape  # below the threshold: torch's allocator
    monkeypatch.setattr(kernels, "FRESH_MAP_MIN_BYTES", 4096)

    def mappings() -> int:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)

    before = mappings()
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        out, zeroed = kernels.new_output(like.to(dtype))
        assert zeroed and out.dtype == dtype and out.shape == like.shape and out.is_contiguous()
        assert not out.any()  # a fresh anonymous mapping reads as zeros
        out.fill_(2.0)
        view = out[3:5]
        del out  # the view keeps the mapping alive ...
        assert float(view.sum()) == 2.0 * 2 * 1024
        del view  # ... and the last reference unmaps it
    assert mappings() <= before


@pytest.mark.parametrize("contiguous", [False, True])
@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_outcome_advantages_into_a_fresh_mapping_matches_torch_path(monkeypatch, contiguous, estimator):
    rewards, mask, ids = _batch(4, contiguous=contiguous)
    with monkeypatch.context() as mp:
        mp.setattr(kernels, "FRESH_MAP_MIN_BYTES", 1)  # every output comes from new_output
        got = outcome_advantages(rewards, mask, ids, estimator)
        calls = []
        mp.setattr(advantages_module, "new_output", lambda like: calls.append(like) or (torch.empty_like(like), False))
        outcome_advantages(rewards, mask, ids, estimator)
        assert calls  # the default call allocates through new_output
    with monkeypatch.context() as mp:  # the torch/numpy path into torch's own tensor
        mp.setattr(advantages_module, "grpo_token_advantages", lambda *a, **k: None)
        mp.setattr(advantages_module, "masked_broadcast", lambda *a, **k: None)
        ref = outcome_advantages(rewards, mask, ids, estimator)
    assert torch.equal(got, ref) and torch.equal(got.signbit(), ref.signbit())


def test_kernels_decline_what_they_cannot_take():
    rewards, mask, ids = _batch(0)
    out = torch.empty_like(rewards)
    g = factorize(ids)
    assert kernels.masked_broadcast(torch.ones(64), mask.long(), out) is None  # int mask
    assert kernels.masked_broadcast(torch.ones(64), mask.t().contiguous().t(), out) is None  # strided
    assert kernels.grpo_token_advantages(rewards.bfloat16(), mask, g.codes, g.n_groups, True, 1e-6,
                                         out.bfloat16()) is None
    # ... and outcome_advantages then takes the torch path with the same result
    ref = outcome_advantages(rewards, mask, ids, "grpo")
    assert_close(outcome_advantages(rewards, mask.t().contiguous().t(), ids, "grpo"), ref, rtol=0, atol=0)
    assert_close(outcome_advantages(rewards, mask.long(), ids, "grpo"), ref, rtol=0, atol=0)


@pytest.mark.parametrize("contiguous", [False, True])
def test_non_finite_score_is_an_error_on_the_kernel_path(contiguous):
    rewards, mask, ids = _batch(1, contiguous=contiguous)
    rewards[5, 0] = float("inf")
    with pytest.raises(AlgoError, match="NaN or inf"):
        outcome_advantages(rewards, mask, ids, "grpo")
    rewards[5, 0] = float("nan")
    with pytest.raises(AlgoError, match="NaN or inf"):
        outcome_advantages(rewards, mask, ids, "grpo", norm_by_std=False)


def test_training_sized_batches_stay_on_the_torch_path(monkeypatch):
    monkeypatch.setattr(kernels, "MIN_ELEMENTS", 1 << 18)
    rewards, mask, ids = _batch(0)  # 64 x 20: what an RL step has, far below the threshold
    g = factorize(ids)
    out = torch.empty_like(rewards)
    assert kernels.grpo_token_advantages(rewards, mask, g.codes, g.n_groups, True, 1e-6, out) is None
    assert kernels.masked_broadcast(torch.ones(64), mask, out) is None


def test_kernels_use_the_torch_thread_budget(monkeypatch):
    numba = pytest.importorskip("numba")
    # an in-process vLLM engine (tests/models) replaces torch.set_num_threads with a no-op
    monkeypatch.setattr(torch, "set_num_threads", torch._C.set_num_threads)
    rewards, mask, ids = _batch(2)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # what the runtime gives an actor with one CPU
        for _ in range(2):
            outcome_advantages(rewards, mask, ids, "grpo")
            outcome_advantages(rewards, mask, ids, "rloo")
            assert numba.get_num_threads() == 1
            assert torch.get_num_threads() == 1  # numba's OpenMP launch must not raise torch's
    finally:
        torch.set_num_threads(before)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), rows=st.integers(1, 30), width=st.integers(1, 6))
def test_prop_kernel_equals_sequence_math_broadcast(data, rows, width):
    vals = st.sampled_from([-1.0, 0.0, 0.5, 0.7, 1.0, 2.3])
    rewards = torch.tensor(data.draw(st.lists(st.lists(vals, min_size=width, max_size=width),
                                              min_size=rows, max_size=rows)), dtype=torch.float32)
    mask = torch.tensor(data.draw(st.lists(st.lists(st.booleans(), min_size=width, max_size=width),
                                           min_size=rows, max_size=rows)))
    ids = data.draw(st.lists(st.sampled_from(["a", "b", "c"]), min_size=rows, max_size=rows))
    if data.draw(st.booleans()):
        ids = sorted(ids)  # contiguous groups: the one-sweep kernel
    tok = outcome_advantages(rewards, mask, ids, "grpo")
    seq = sequence_advantages(rewards.sum(-1).numpy(), ids, "grpo")
    assert_close(tok, torch.where(mask, torch.from_numpy(seq)[:, None], 0.0), rtol=1e-6, atol=1e-6)
