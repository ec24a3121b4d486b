"""Will every actor fit? One memory budget per worker of each placed actor, before anything starts.

Pure: reads the plan (models' ``train:`` / ``rollout:`` blocks, batch and length settings), the
stage each actor got from ``place`` and the cluster, and prices them with ``graph.memory``. A
model's shape comes from its config.json (a builtin's declared shape), so nothing is loaded.

What one worker holds: a trained model's training budget (parameters, gradients, AdamW state,
the update's activations and logits, FSDP2's gathered copies); another loaded model's weights
and the forward its nodes run on it (a reference's logprobs, a reward model's or a judge's
scores: one layer's temporaries, then the logits); and where the actor generates, the rollout
engine's memory: for ``hf`` the KV cache and sampling buffers alive only while it generates
(plus the whole gathered model when FSDP2 shards it), for ``vllm`` the engine's claim, alive
throughout.

Sizes per micro-batch assume rows as long as the context allows (prompt budget + max_tokens),
so the estimate is the worst step, not the average; docs/memory.md states every assumption.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

from dapo_flow.errors import Problem
from dapo_flow.graph.memory import (DTYPE_BYTES, GPU_OVERHEAD_BYTES, GiB, Budget, ModelShape, Term,
                                    estimate_forward, estimate_rollout, estimate_training,
                                    lora_param_count)
from dapo_flow.graph.plan import Cluster, Plan, Stage

GENERATION = "generation"
CUDA = Term("CUDA context and workspaces", GPU_OVERHEAD_BYTES)


def shape_of(plan: Plan, model: str) -> ModelShape | None:
    """The model's shape from its config (None when there is none to read yet)."""
    from dapo_flow.models import model_config  # light: no torch

    spec = plan.spec.models[model]
    config = model_config(spec.path)
    try:
        shape = ModelShape.from_config(config) if config else None
    except (KeyError, TypeError, ValueError):
        return None
    return dataclasses.replace(shape, head=spec.resolved_head) if shape is not None else None


def context_of(plan: Plan, model: str, shape: ModelShape) -> tuple[int, int]:
    """(positions of the longest row, response tokens of it) for ``model``: the rollout's
    ``max_model_len`` when set, else the prompt budget plus the largest ``max_tokens``, else the
    model's maximum context. A model that generates nothing (a critic, a reward model) reads the
    rows the others generate: their largest context."""
    generators = _generators(plan, model)
    own = any(n.model == model for n in generators)
    derived = plan.engine_context().get(model) if own else max(plan.engine_context().values(), default=None)
    responses = [tokens for n in generators if isinstance(tokens := n.sampling().max_tokens, int)]
    context = (plan.spec.models[model].rollout.max_model_len or derived or shape.max_position_embeddings)
    return context, min(max(responses, default=context), context)


def _generators(plan: Plan, model: str) -> list:
    """The generate nodes whose rows ``model`` sees: its own, or for a model that generates
    nothing (a critic, a reward model) every one (it reads the rows the policies generate)."""
    own = [n for n in plan.with_role("generate") if n.model == model]
    return own or list(plan.with_role("generate"))


def stage_budget(plan: Plan, stage: Stage, cluster: Cluster) -> Budget | None:
    """What one worker of ``stage`` holds at its peak; None for the driver or when a model's
    shape is unknown."""
    if stage.kind != "actor":
        return None
    on_gpu = stage.num_gpus > 0
    nodes = [plan.node(n) for n in stage.nodes]
    terms: list[Term] = []
    for model in stage.models:
        shape = shape_of(plan, model)
        if shape is None:
            return None
        trains = [n for n in nodes if n.role == "train" and n.model == model]
        if model in plan.engine_scored:  # its engine alone scores it: the engine's memory, no torch copy
            own = _rollout(plan, stage, model, shape, cluster, on_gpu, trained=False)
        elif trains:
            own = _training(plan, stage, model, shape, trains[0], on_gpu)
        else:
            own = [_weights(plan, stage, model, shape), *_frozen_forward(plan, stage, model, shape, nodes)]
        if any(n.role == "generate" and n.model == model for n in nodes):
            own += _rollout(plan, stage, model, shape, cluster, on_gpu, trained=bool(trains))
        named = len(stage.models) > 1  # say whose term it is when the actor loads several models
        terms += [Term(f"{model}: {t.name}", t.bytes, t.where, t.phases, t.fix) if named else t
                  for t in own if t != CUDA]
    terms += [CUDA] if on_gpu else []  # one context per process
    workers = f", per worker of {stage.workers}" if stage.workers > 1 else ""
    return Budget(f"{stage.name}{workers}", tuple(terms))


def capacity(stage: Stage, cluster: Cluster) -> int | None:
    """Device bytes one worker of ``stage`` has: its GPU share; None on CPU (RAM is shared by
    every process of a node, so it is not checked per actor) or when the GPU's size is unknown."""
    if stage.num_gpus <= 0 or cluster.gpu_mem_gib is None:
        return None
    return int(min(stage.num_gpus, 1.0) * cluster.gpu_mem_gib * GiB)


def budgets(plan: Plan, stages: tuple[Stage, ...], cluster: Cluster) -> dict[str, Budget]:
    """Stage name -> its per-worker budget, for every actor stage with a known shape."""
    out = {s.name: stage_budget(plan, s, cluster) for s in stages}
    return {name: b for name, b in out.items() if b is not None}


def memory_problems(plan: Plan, stages: tuple[Stage, ...], cluster: Cluster,
                    per_stage: Mapping[str, Budget]) -> list[Problem]:
    """A Problem per actor whose peak exceeds its GPU share: the need, the biggest term, its fix."""
    problems = []
    for stage in stages:
        budget, cap = per_stage.get(stage.name), capacity(stage, cluster)
        if budget is None or cap is None or budget.fits(cap) is None:
            continue
        big = budget.biggest()
        model = stage.models[0]
        trained = model in plan.trained_models
        path = ("models", model, "train") if trained else ("models", model)
        line = plan.doc.line_of(path) if plan.doc is not None else 0
        phase = budget.peak_phase()
        problems.append(Problem(
            plan.file, line, "", ".".join(path),
            f"a worker of stage '{stage.name}' needs about {budget.total / GiB:.1f} GiB of GPU memory at "
            f"its peak{f' ({phase})' if phase else ''}, but has {cap / GiB:.1f} GiB "
            f"({min(stage.num_gpus, 1.0):g} of a {cluster.gpu_mem_gib:g} GiB GPU); the biggest term "
            f"is {big.name} ({big.bytes / GiB:.1f} GiB)",
            (big.fix or "a smaller model or batch") + f" (models.{model}){_unbudgeted(plan, model)}; "
            "`dapo-flow explain` prints the whole budget"))
    return problems


def sized_by_whole_context(plan: Plan, model: str) -> bool:
    """Whether ``model``'s rows are priced at its whole context: no prompt budget bounds them
    (and no rollout.max_model_len), so the estimate takes every row as long as the model allows."""
    derived = plan.engine_context()
    own = any(n.model == model for n in plan.with_role("generate"))
    return (plan.spec.models[model].rollout.max_model_len is None
            and (model not in derived if own else not derived))


def _unbudgeted(plan: Plan, model: str) -> str:
    """A refusal's second fix where rows are priced at the model's whole context."""
    if not sized_by_whole_context(plan, model):
        return ""
    return ("; every row is priced at the model's whole context, as no prompt budget is set: "
            "data.max_prompt_length prices rows at the budget plus max_tokens")


def _training(plan: Plan, stage: Stage, model: str, shape: ModelShape, update, on_gpu: bool) -> list[Term]:
    """The update's budget: micro-batches of the token budget, or of ``micro_batch_size`` rows
    (at most one worker's share of a mini-batch), every row as long as the context."""
    spec, sizing = plan.spec.models[model], update.train_sizing()
    train = spec.train
    context, response = context_of(plan, model, shape)
    if train.max_tokens_per_micro_batch:
        rows = max(1, train.max_tokens_per_micro_batch // context)
    else:
        per_worker = _step_rows_per_worker(plan, stage, model, sizing.mini_batches)
        rows = max(1, min(sizing.micro_batch_size or per_worker, per_worker))
    budget = estimate_training(
        shape, micro_batch_tokens=rows * context, response_tokens_per_micro_batch=rows * response,
        workers=stage.workers, strategy=train.resolved_strategy, dtype=spec.dtype,
        mixed_precision=train.mixed_precision, grad_checkpointing=train.grad_checkpointing,
        cpu_offload=train.cpu_offload, rows_per_micro_batch=rows, packed=train.pack,
        entropy_in_loss=sizing.entropy_in_loss, on_gpu=on_gpu,
        logprob_chunk_tokens=train.logprob_chunk_tokens, sequence_parallel=train.sequence_parallel,
        lora_params=lora_param_count(shape, train.lora.rank, train.lora.target_modules) if train.lora else 0)
    return list(budget.terms)


def _weights(plan: Plan, stage: Stage, model: str, shape: ModelShape) -> Term:
    """A model loaded but not trained here (a reference, a scorer): its weights, sharded like the
    stage's trained model."""
    shard = stage.workers if stage.sharded else 1
    of = f" (1/{shard} shard)" if shard > 1 else ""
    return Term(f"weights{of}", shape.num_params() * DTYPE_BYTES[plan.spec.models[model].dtype] // shard,
                fix="more train.workers (FSDP2 shards it), or dtype: bfloat16")


def _frozen_forward(plan: Plan, stage: Stage, model: str, shape: ModelShape, nodes: list) -> list[Term]:
    """A model loaded but not trained here runs forwards for the nodes that read it (a
    reference's logprobs, a reward model's or a judge's scores): the largest micro-batch of
    them (each node's ``micro_batch_size`` rows, at most one worker's rows of a step), every row
    as long as the context."""
    readers = [n for n in nodes if n.model == model and n.role not in ("generate", "train")]
    if not readers:
        return []
    spec = plan.spec.models[model]
    context, response = context_of(plan, model, shape)
    per_worker = _step_rows_per_worker(plan, stage, model)
    rows = max(min(_micro_batch_rows(r), per_worker) for r in readers)
    compute = 2 if spec.train.mixed_precision == "bf16" else DTYPE_BYTES[spec.dtype]
    return estimate_forward(shape, micro_batch_tokens=rows * context, response_tokens_per_micro_batch=rows * response,
                            rows_per_micro_batch=rows, compute_bytes=compute,
                            logprob_chunk_tokens=spec.train.logprob_chunk_tokens)


def _step_rows_per_worker(plan: Plan, stage: Stage, model: str, parts: int = 1) -> int:
    """Rows one worker of ``stage`` sees of a step's rows for ``model`` (prompts x the largest
    group size of the generators it reads), cut into ``parts`` (an update's mini-batches). A
    sequence-parallel group's k workers of a replica see the same rows (each a slice of them)."""
    n = max((g.sampling().n for g in _generators(plan, model)), default=1)
    split = max(plan.spec.models[m].train.sequence_parallel for m in stage.models)
    replicas = max(1, stage.workers // split)
    return math.ceil(plan.spec.run.prompts_per_step * n / parts / replicas)


def _micro_batch_rows(node) -> int:
    """Rows per forward of a node, as its op declares them, else HFPolicy's default of 64."""
    rows = node.forward_rows()
    return rows if rows is not None else 64


def _rollout(plan: Plan, stage: Stage, model: str, shape: ModelShape, cluster: Cluster, on_gpu: bool,
             trained: bool) -> list[Term]:
    """The rollout engine's memory on one worker (a group splits each generation batch)."""
    spec, run = plan.spec.models[model], plan.spec.run
    context, _ = context_of(plan, model, shape)
    gen_batch = run.gen_prompts_per_batch
    prompts = run.prompts_per_step if gen_batch in (None, "auto") else gen_batch
    n = max((g.sampling().n for g in plan.with_role("generate") if g.model == model), default=1)
    rows = math.ceil(prompts * n / stage.workers)
    gpu_mem = cluster.gpu_mem_gib * min(stage.num_gpus, 1.0) if cluster.gpu_mem_gib else None
    if spec.backend == "vllm" and on_gpu and gpu_mem is None:
        return []  # its claim is a share of a GPU whose size is unknown: explain says so
    if spec.backend not in ("hf", "vllm"):
        return []  # a registered engine: nothing known about it
    engine = estimate_rollout(shape, max_model_len=context, batch_rows=rows, dtype=spec.dtype,
                              backend=spec.backend, gpu_memory_utilization=spec.rollout.gpu_memory_utilization,
                              gpu_mem_gib=gpu_mem, kv_cache_gib=spec.rollout.kv_cache_gib, on_gpu=on_gpu,
                              mixed_precision=spec.train.mixed_precision if trained and spec.backend == "hf"
                              and not stage.sharded else None)
    if spec.backend == "vllm":
        if on_gpu and trained and spec.rollout.sleep is not False:
            # sleep mode (auto on GPU beside the trainer): the engine's share is freed while the
            # stage trains (its weights wait in host memory), so it counts only in generation
            return [Term(t.name, t.bytes, t.where, (GENERATION,), t.fix) for t in engine.terms]
        return list(engine.terms)
    # hf generates with the loaded (trained) model: its weights are counted already; the cache
    # lives only while it generates
    out = [Term(t.name, t.bytes, t.where, (GENERATION,), t.fix)
           for t in engine.terms if t.name != "weights" and t != CUDA]
    if stage.sharded:
        compute = 2 if spec.train.mixed_precision == "bf16" and trained else DTYPE_BYTES[spec.dtype]
        out.append(Term("whole model gathered to generate", shape.num_params() * compute,
                        phases=(GENERATION,), fix="backend: vllm (a separate engine), or a smaller model"))
    return out
