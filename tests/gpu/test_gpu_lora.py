"""`train.lora` on CUDA: a bf16 model's base stays bf16 and frozen on the GPU while its adapters
(float32, peft's choice for a half-precision base) and their AdamW state train there; a run
checkpoints the adapters and resumes on the GPU as if it had not stopped."""

from __future__ import annotations

import math

import pytest
import torch

from gpu_runs import devices_of, history, run_graph, small_graph

pytestmark = pytest.mark.gpu

LORA = [("set", "models.policy.train.lora={rank: 8, alpha: 16}"), ("set", "models.policy.dtype=bfloat16"),
        ("set", "models.policy.train.mixed_precision=bf16"), ("set", "train.lr=1e-3")]


def test_a_lora_run_trains_its_adapters_on_the_gpu_and_resumes(workdir, quiet, device, policies):
    graph = small_graph(workdir, steps=3, ckpt=2)
    whole, _ = run_graph(graph, LORA, console=quiet)
    trained = [p for p in policies if p.lora is not None]
    assert trained and devices_of(trained) == {device.type}
    for name, param in trained[0].model.named_parameters():
        adapter = ".lora_" in name
        assert param.requires_grad == adapter, name
        assert param.dtype == (torch.float32 if adapter else torch.bfloat16), name
    logged = history(whole)
    for key in ("actor/pg_loss", "actor/grad_norm", "batch/reward_mean"):
        assert all(math.isfinite(v) for _, v in logged[key]), key

    # the same run stopped after step 2's checkpoint and resumed: step 3 logs what it logged
    again = small_graph(workdir, name="again", steps=3, ckpt=2)
    first, _ = run_graph(again, LORA, steps=2, console=quiet)
    policies.clear()
    resumed, _ = run_graph(again, LORA, resume=first["run_id"], console=quiet)
    assert resumed["run_id"] == first["run_id"] and resumed["steps"] == 3
    assert devices_of([p for p in policies if p.lora is not None]) == {device.type}  # resumed there
    got = history(resumed)
    for key in ("actor/pg_loss", "batch/reward_mean"):
        assert [s for s, _ in got[key]] == [1, 2, 3], key
        assert got[key][-1][1] == pytest.approx(logged[key][-1][1], rel=1e-5, abs=1e-6), key
