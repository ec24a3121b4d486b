"""Model resources an actor hosts: the trainable policy, its rollout engine, its tokenizer.

In a colocated actor (hybrid engine) the hf backend generates with the very policy it
trains, so weight sync is free; the vllm backend gets the new weights in place after
every update. A rollout-only actor (disaggregated placement) holds just a generator.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dapo_flow.graph.spec import ModelSpec


@dataclass
class ModelResource:
    name: str
    spec: ModelSpec
    path: Path
    policy: Any  # HFPolicy used for logprob / update (None in a rollout-only actor)
    generator: Any  # HFPolicy or VLLMGenerator with .generate(prompt_ids, cfg)
    tokenizer: Any

    def sync_generator(self) -> float:
        """Push the policy's weights into a separate rollout engine; seconds taken."""
        if self.generator is self.policy or self.policy is None:
            return 0.0
        start = time.perf_counter()
        self.generator.sync_weights(self.policy.named_weights())
        return time.perf_counter() - start

    def load_weights(self, weights: dict) -> float:
        """Weights from another actor (disaggregated sync); seconds taken."""
        start = time.perf_counter()
        target = self.policy if self.policy is not None else self.generator
        if hasattr(target, "sync_weights"):
            target.sync_weights(weights)
        else:
            target.load_named_weights(weights)
        return time.perf_counter() - start


def _device(spec: ModelSpec) -> str:
    if spec.device != "auto":
        return spec.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def load_resource(
    name: str, spec: ModelSpec, *, path: Path | None, trainable: bool, generates: bool,
    scores: bool, seed: int,
) -> ModelResource:
    """Load what this actor needs of model ``name``.

    ``path`` overrides the spec's path (a checkpoint on resume). ``scores`` means the actor
    runs logprob/update nodes for the model, so it needs the torch policy.
    """
    from dapo_flow.models import resolve_model
    from dapo_flow.models.hf import HFPolicy

    model_path = Path(path) if path is not None else resolve_model(spec.path)
    device = _device(spec)
    policy = None
    if scores or trainable or (generates and spec.backend == "hf"):
        policy = HFPolicy(model_path, dtype=spec.dtype, device=device, seed=seed, trainable=trainable)
    generator = policy
    if generates and spec.backend == "vllm":
        from dapo_flow.models.vllm_engine import VLLMGenerator

        generator = VLLMGenerator(model_path, dtype=spec.dtype, seed=seed)
    tokenizer = policy.tokenizer if policy is not None else generator.tokenizer
    return ModelResource(name, spec, model_path, policy, generator, tokenizer)
