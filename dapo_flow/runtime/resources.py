"""Model resources an actor hosts: the trainable policy, its rollout engine, its tokenizer.

In a colocated actor (hybrid engine) the hf backend generates with the very policy it
trains, so weight sync is free; the vllm backend gets the new weights in place after
every update. A rollout-only actor (disaggregated placement) holds just a generator.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from dapo_flow.errors import RunError
from dapo_flow.graph.spec import ModelSpec
from dapo_flow.models.engines import BACKENDS, Backend, RolloutEngine, TrainablePolicy


@dataclass
class ModelResource:
    name: str
    spec: ModelSpec
    path: Path
    policy: TrainablePolicy | None  # logprob / update run on it (None in a rollout-only actor)
    generator: RolloutEngine | None  # None where nothing generates with the model
    tokenizer: Any

    def sync_generator(self) -> float:
        """Push the policy's weights into this actor's own rollout engine; seconds taken."""
        if self.policy is None or self.generator is None or self.generator is self.policy:
            return 0.0
        start = time.perf_counter()
        # streamed: no copy of the model
        self.generator.load_weights(self.policy.iter_weights(), version=self.policy.weights_version)
        return time.perf_counter() - start

    def set_weights_version(self, version: int) -> None:
        """The weights every copy here holds are ``version`` (loaded from a checkpoint of it)."""
        for copy in distinct_copies(self.policy, self.generator):
            copy.set_weights_version(version)

    @property
    def weights_version(self) -> int:
        """The policy version of the weights this actor samples with (else, of its torch copy)."""
        return (self.generator if self.generator is not None else self.policy).weights_version

    def rest_generator(self) -> None:
        """Between generate calls, an engine that shares this actor with the trained policy
        frees its device memory, where it can (``sleep``: colocated vLLM)."""
        if self.policy is not None and self.generator is not None and self.generator is not self.policy:
            sleep = getattr(self.generator, "sleep", None)  # optional in RolloutEngine
            if sleep is not None:
                sleep()

    def load_weights(self, weights: Mapping[str, Any] | Iterable[tuple[str, Any]],
                     version: int | None = None) -> float:
        """Weights from another actor (disaggregated sync: a mapping through the object store,
        or pairs streamed off a weight bus), of policy ``version``; seconds taken."""
        start = time.perf_counter()
        target = self.policy if self.policy is not None else self.generator
        target.load_weights(weights, version=version)
        return time.perf_counter() - start

    def close(self) -> None:
        """Release the rollout engine when it is not the torch policy itself."""
        if self.generator is not None and self.generator is not self.policy:
            self.generator.close()


def model_device(spec: ModelSpec) -> str:
    """The device a model's copies in this process run on: its `device`, and for `auto` CUDA
    where this process sees a GPU (a Ray actor sees the GPUs placement gave it), else the CPU."""
    if spec.device != "auto":
        return spec.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def trained_dtype(spec: ModelSpec) -> str:
    """The dtype of the copy of a model that an update trains: float32 (the master weights)
    under ``train.mixed_precision``, else the model's ``dtype``. Every copy that is not trained
    (a rollout engine, a reference, a rollout actor's torch copy) loads ``dtype``. Under
    ``train.lora`` the base is frozen and stays in ``dtype`` (peft keeps the adapters of a half-
    precision base in float32: they are the master weights)."""
    return "float32" if spec.train.mixed_precision and spec.train.lora is None else spec.dtype


def load_resource(
    name: str, spec: ModelSpec, *, path: Path | None, trainable: bool, generates: bool,
    scores: bool, seed: int, max_model_len: int | None = None, strategy: str = "none",
    backend: Backend | None = None, engine_scored: bool = False,
) -> ModelResource:
    """Load what this actor needs of model ``name``.

    ``path`` overrides the spec's path (a checkpoint on resume). ``scores`` means the actor
    runs logprob/update nodes for the model, so it needs the torch policy; ``generates`` that it
    rolls out with it, through the engine of ``backend`` (the one the graph was compiled with;
    default: the spec's in :data:`BACKENDS`), set up with the model's `rollout:` settings
    (``max_model_len``: the default the plan derived). ``engine_scored``: a frozen model its
    `logprob` nodes score through that engine (graph.plan.Plan.engine_scored): the engine alone,
    no torch copy.
    ``strategy``: how the model's training group holds it on this worker: `fsdp2` (a shard),
    `ddp` (a full replica, gradients averaged across the group), `none` (no group). The copy an
    update trains here (``trainable``) loads :func:`trained_dtype`, float32 master weights under
    ``train.mixed_precision``; any other copy (the engine, a scorer, a rollout actor's) ``dtype``.

    A sharded checkpoint holds no HF weights: the model is built from the spec's path and the
    worker loads the shards into it (StageWorker), or a weight sync brings them (a rollout actor).
    Nor does a LoRA one (adapters and the base's name): the trained copy loads the spec's base
    and the checkpoint's adapters, any other copy the base and then a weight sync (merged).
    """
    from dapo_flow.models import resolve_model
    from dapo_flow.models.lora import is_adapter_dir
    from dapo_flow.runtime.checkpoint_models import SHARDED, checkpoint_format, holds_full_weights

    adapters = None
    if path is not None and not holds_full_weights(Path(path)):  # built from the spec's path, then filled
        # LoRA adapters: loaded into the trained copy, merged into any other; an FSDP2 group's
        # trained copy reads its shards instead (the adapters beside them serve the others)
        if is_adapter_dir(Path(path)) and not (trainable and checkpoint_format(Path(path)) == SHARDED):
            adapters = Path(path)
        path = None
    model_path = Path(path) if path is not None else resolve_model(spec.path)
    device = model_device(spec)
    backend = backend or BACKENDS[spec.backend]
    policy = None
    generates = generates or engine_scored
    if (scores and not engine_scored) or trainable or (generates and backend.generates_with_trainer):
        policy = _torch_policy(spec, model_path, device=device, seed=seed, trainable=trainable, strategy=strategy,
                               adapters=adapters)
    generator = None
    if generates:
        options = spec.rollout
        if options.max_model_len is None and max_model_len is not None:
            options = options.model_copy(update={"max_model_len": max_model_len})
        generator = backend.factory()(model_path, dtype=spec.dtype, device=device, seed=seed, trainer=policy,
                                      options=options)
    if adapters is not None and not trainable:  # a frozen copy (eval, a rollout actor): merged
        merged = merged_checkpoint_weights(model_path, spec, adapters)
        for copy in distinct_copies(policy, generator):
            copy.load_weights(merged.items())
    tokenizer = policy.tokenizer if policy is not None else generator.tokenizer
    return ModelResource(name, spec, model_path, policy, generator, tokenizer)


def _torch_policy(spec: ModelSpec, model_path: Path, *, device: str, seed: int, trainable: bool, strategy: str,
                  adapters: Path | None):
    """The torch copy of the model an actor trains, scores or generates with: as the training
    group holds it (``strategy``), LoRA adapters on a trained copy."""
    from dapo_flow.models.hf import HFPolicy

    # mixed precision: FSDP2's policy casts a shard's parameters; anywhere else (one worker, a
    # DDP replica, a rollout actor's copy) the policy's forwards run under torch.autocast, so
    # every copy of the model computes in the precision the trainer does. The trained copy
    # holds float32 master weights (its gradients and AdamW state follow) whatever `dtype`,
    # which is every other copy's (verl's actor: fp32 parameters, bf16 compute)
    policy = HFPolicy(model_path, dtype=trained_dtype(spec) if trainable else spec.dtype, device=device,
                      seed=seed, trainable=trainable,
                      grad_checkpointing=trainable and spec.train.grad_checkpointing,
                      logprob_chunk_tokens=spec.train.logprob_chunk_tokens,
                      mixed_precision=None if strategy == "fsdp2" else spec.train.mixed_precision,
                      head=spec.resolved_head, lora=spec.train.lora if trainable else None,
                      adapters=adapters if trainable else None, pack=spec.train.pack,
                      share_prompts=trainable and spec.train.share_prompts)
    if strategy == "fsdp2":
        policy.shard(mixed_precision=spec.train.mixed_precision, cpu_offload=spec.train.cpu_offload)
        if trainable and spec.train.sequence_parallel > 1:
            policy.split_sequences(spec.train.sequence_parallel)
    elif strategy == "ddp":
        policy.replicate()
    return policy


def distinct_copies(policy: Any, generator: Any) -> list:
    """The copies of a model an actor holds, each once: the trained policy and the rollout
    engine, which are one object where the engine is the policy (the hf backend)."""
    return list({id(c): c for c in (policy, generator) if c is not None}.values())


def merged_checkpoint_weights(base: Path, spec: ModelSpec, adapters: Path) -> dict:
    """A LoRA checkpoint's adapters merged into ``base``, as float32 host arrays under the
    base names (what a weight sync sends), for a copy of the model that is not trained."""
    from dapo_flow.models.hf import HFPolicy

    if spec.train.lora is None:
        raise RunError(f"{adapters} holds LoRA adapters, but model '{spec.path}' has no train.lora: "
                       "set the train.lora it was trained with (its adapter_config.json says)")
    adapted = HFPolicy(base, dtype="float32", lora=spec.train.lora, adapters=adapters)
    return adapted.named_weights()
