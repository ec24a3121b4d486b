"""Weights swapped into an engine (hf, vLLM) in the middle of a generate call, at a chosen call of
its model or engine, and the check that each token then carries its version's logprob
(tests/models and tests/gpu)."""

from __future__ import annotations

import threading
import time

import pytest
import torch


def swap_after_forward(policy, call: int, weights: dict, version: int) -> dict:
    """Make ``policy.load_weights(weights, version)`` happen, from another thread, right after
    the model's ``call``-th forward returns (before the next decode step starts: the load is
    waiting at the gate by then). Returns a record of the calls' count and the load thread."""
    return swap_after_call(policy.model, "forward", policy, call, weights, version)


def swap_after_call(owner, method: str, engine, call: int, weights: dict, version: int) -> dict:
    """:func:`swap_after_forward` for any engine: the load into ``engine`` starts right after
    ``owner.method``'s ``call``-th call returns (a vLLM engine's ``llm_engine.step``)."""
    record = {"calls": 0, "thread": None}
    inner = getattr(owner, method)

    def counted(*args, **kwargs):
        out = inner(*args, **kwargs)
        record["calls"] += 1
        if record["calls"] == call:
            loader = threading.Thread(target=engine.load_weights, args=(weights,), kwargs={"version": version})
            loader.start()
            record["thread"] = loader
            deadline = time.monotonic() + 10
            while engine.gate.waiting_loads == 0 and time.monotonic() < deadline:
                time.sleep(0.001)
            assert engine.gate.waiting_loads == 1, "the load did not reach the gate"
        return out

    setattr(owner, method, counted)
    record["restore"] = lambda: setattr(owner, method, inner)
    return record


def assert_each_token_is_its_versions(out, prompts, cfg, by_version: dict, *, first_new: int,
                                      atol: float = 1e-4) -> int:
    """Each token of ``out`` (Rollouts of ``prompts``) has the version of the weights that sampled
    it (those before ``first_new`` the first version of ``by_version``, the rest the second) and
    its logprob is that version's teacher-forced one (``by_version``: version -> an HFPolicy with
    those weights). Returns how many samples span both versions."""
    (old_v, old), (new_v, new) = by_version.items()
    rows = [prompts[i] for i in out.prompt_index]
    old_lp, _, _ = old.response_logprobs(rows, out.response_ids, temperature=cfg.temperature)
    new_lp, _, _ = new.response_logprobs(rows, out.response_ids, temperature=cfg.temperature)
    spans = 0
    for s, (ids, lps, versions) in enumerate(zip(out.response_ids, out.logprobs, out.versions)):
        assert versions == [old_v if t < first_new else new_v for t in range(len(ids))], (s, versions)
        spans += len(set(versions)) > 1
        for t, v in enumerate(versions):
            want = (new_lp if v == new_v else old_lp)[s, t].item()
            assert lps[t] == pytest.approx(want, abs=atol), (s, t, v)
    # and the two versions differ where they meet: the check tells them apart
    assert not torch.allclose(old_lp[:, first_new:], new_lp[:, first_new:], atol=10 * atol)
    return spans
