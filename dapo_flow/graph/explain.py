"""``dapo-flow explain``: a placed plan as text, without starting Ray. It prints what the runtime
runs, read from the :class:`PlacedPlan` (its stages, calls and syncs), never derived again here:
the models and how each trains and rolls out, the stages, each actor's memory estimate, then one
step phase by phase."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
from pydantic import BaseModel

from dapo_flow.core import columns as C
from dapo_flow.core.contract import contract_of, produces, requires, uses_model
from dapo_flow.graph import fit
from dapo_flow.graph.plan import DRIVER, IN_ACTOR, PlacedPlan, Plan, PlanNode
from dapo_flow.graph.problems import type_name
from dapo_flow.graph.prompt_room import declared


def _columns(schema: pa.Schema | dict[str, pa.DataType]) -> str:
    items = list(schema.items()) if isinstance(schema, dict) else [(f.name, f.type) for f in schema]
    return ", ".join(f"{name}:{type_name(t)}" for name, t in items) or "-"


def _lora_settings(model) -> str:
    """`train.lora` as explain prints it: the adapters' rank, scale and where, and their size."""
    lora = model.train.lora
    if lora is None:
        return ""
    from dapo_flow.graph.memory import ModelShape, lora_param_count
    from dapo_flow.models import model_config

    targets = lora.target_modules if isinstance(lora.target_modules, str) else ", ".join(lora.target_modules)
    size = ""
    config = model_config(model.path)
    if config is not None:
        shape = ModelShape.from_config(config)
        trained = lora_param_count(shape, lora.rank, lora.target_modules)
        count = f"{trained / 1e6:.3g}M" if trained >= 1e6 else f"{trained / 1e3:.3g}k"
        size = f": {count} trained parameters, {trained / shape.num_params():.2%} of the model's"
    return f", LoRA rank {lora.rank} alpha {lora.alpha:g} on {targets}{size}"


def _expert_settings(model) -> str:
    """A mixture-of-experts model's experts and its parameters, total and active per token
    (what memory holds vs what a token's compute runs through); "" for a dense model."""
    from dapo_flow.graph.memory import ModelShape
    from dapo_flow.models import model_config

    try:
        shape = ModelShape.from_config(model_config(model.path) or {})
    except (KeyError, TypeError, ValueError):  # no config to read yet, or not a decoder's: memory says why
        return ""
    if not shape.num_experts:
        return ""
    return (f", {shape.num_experts} experts top-{shape.num_experts_per_tok} in {len(shape.sparse_layers)} of "
            f"{shape.num_hidden_layers} layers: {_count(shape.num_params())} parameters, "
            f"{_count(shape.active_params())} active per token; experts not split across workers")


def _count(n: int) -> str:
    return f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M" if n >= 1e6 else f"{n / 1e3:.3g}k"


def explain(placed: PlacedPlan) -> str:
    """The placed plan as text: models, stages, memory, then one step phase by phase."""
    out = [*_explain_models(placed), "", "stages:", *_explain_stages(placed), *_explain_memory(placed),
           *_explain_step(placed), *_explain_validation(placed)]
    return "\n".join(out) + "\n"


def _explain_models(placed: PlacedPlan) -> list[str]:
    """The graph and cluster in a line each, then each model: its weights and how it trains and rolls out."""
    p, spec, cluster = placed.plan, placed.plan.spec, placed.cluster
    return [
        f"graph {spec.name} ({Path(p.file).name}): {len(p.nodes)} nodes, "
        f"placement {spec.placement.mode}",
        f"cluster: {cluster.cpus:g} CPUs, {cluster.gpus:g} GPUs, {cluster.nodes} node(s)",
        "",
        "models:",
        *(f"  {name:<14} {m.path} ({m.dtype}, {m.backend}, device {m.device}"
          + (f", update micro-batches of <= {m.train.max_tokens_per_micro_batch} tokens"
             if m.train.max_tokens_per_micro_batch else "")
          + (", gradient checkpointing" if m.train.grad_checkpointing else "")
          + (", packed micro-batches" if m.train.pack else "")
          + (f", logprobs in chunks of {m.train.logprob_chunk_tokens} tokens" if m.train.logprob_chunk_tokens else "")
          + _group_settings(p, name) + _lora_settings(m) + _expert_settings(m)
          + (f", scored by its {m.backend} engine alone (prompt logprobs, no torch copy)"
             if name in p.engine_scored else "") + ")"
          + _rollout_settings(p, name)
          for name, m in spec.models.items()),
    ]


def _explain_stages(placed: PlacedPlan) -> list[str]:
    """Each stage: its resources, what it loads and runs, and how its workers share the rows."""
    out = []
    for s in placed.stages:
        what = f"loads {', '.join(s.models)}; " if s.models else ""
        out.append(f"  {s.name:<16} {s.kind:<6} cpus={s.num_cpus:g} gpus={s.num_gpus:g}  "
                   f"{what}runs {', '.join(s.nodes) or '-'}")
        out += [f"  {'':<16} {note}" for note in s.notes]
        if s.kind == DRIVER and s.nodes:
            out.append(f"  {'':<16} the model-free operators: in the driver process with --executor local; "
                       "on Ray in one CPU actor of their own, so tables stay in the object store")
        if s.is_group:
            out.append(f"  {'':<16} group of {s.workers} worker(s) on one {s.placement_strategy} placement "
                       f"group ({s.strategy}; resources above are per worker): each worker takes its share "
                       "of a call's rows (whole prompt groups) from the object store; the update cuts "
                       "the mini-batches one worker would, each worker training its rows of each")
            nodes = [placed.plan.node(nid) for nid in s.nodes]
            shared = [n.id for n in nodes if not uses_model(n.op_cls, n.params)]
            if shared:
                out.append(f"  {'':<16} {', '.join(shared)}: model-free, their rows need only their prompt group's "
                           "(SCOPE row/group): each worker runs them on its share, no round trip through the "
                           "driver's stage")
            split = max((placed.plan.spec.models[m].train.sequence_parallel for m in s.models), default=1)
            if split > 1:
                out.append(f"  {'':<16} sequence parallel {split}: {s.workers // split} replica(s) of {split} "
                           f"workers, each taking the same update rows and running 1/{split} of every "
                           "sequence (Ulysses all-to-all around attention)")
        elif s.workers > 1:
            out.append(f"  {'':<16} {s.workers} replicas (resources above are per replica): each takes "
                       "its share of a call's prompts; per-prompt seeds, so the samples do not depend "
                       "on the number")
    return out


def _explain_step(placed: PlacedPlan) -> list[str]:
    """One step: where its prompts come from, then phase by phase the calls in the order the
    runtime makes them (``placed.calls``), each node and the weight syncs after it."""
    p, spec = placed.plan, placed.plan.spec
    run, train = spec.run, spec.data.train
    gen_batch = run.gen_prompts_per_batch or run.prompts_per_step
    per_batch = ("generation batches sized from the keep rate so far (auto)" if gen_batch == "auto"
                 else f"{gen_batch} per generation batch")
    out = ["", f"step ({run.steps} steps, {run.prompts_per_step} prompt groups each):",
           f"  prompts: {train.label} [{train.split}], {per_batch}{_budget_note(spec.data, train)}",
           f"    emits {_columns(C.prompt_schema())}"]
    if placed.generates_in_parts:
        out.append("    each generation batch in parts (the first sized from the keep rate so far), the rest "
                   "left once enough groups are kept (gen_stop_early)")
    headers = {
        "rollout": f"  rollout (repeated until {run.prompts_per_step} groups are kept; at most "
                   f"{{cap}} generation batches, then {{on_cap}}):",
        "train": "  train:",
        "step": "  all nodes once (no group-filter, so no dynamic sampling):",
    }
    for phase, _ in p.phases:
        header = headers[phase]
        if phase == "rollout":
            header = header.format(cap=p.dynamic_sampling.cap, on_cap=p.dynamic_sampling.on_cap)
        out.append(header)
        if phase == "rollout":
            out += _rollout_mode_notes(run)
        for call in placed.calls[phase]:
            if len(call.nodes) > 1:
                out.append(f"    one call @ {call.stage}: {' -> '.join(call.nodes)}")
            for nid in call.nodes:
                if nid == p.group_filter:
                    out.append("    == group barrier: wait for whole prompt groups ==")
                node = p.node(nid)
                model = p.spec.models.get(node.model) if node.model is not None else None
                out += _explain_node(node, call.stage, model.train if model is not None else None)
                out += _explain_syncs(placed, nid)
    return out


def _rollout_mode_notes(run) -> list[str]:
    """How the rollout phase overlaps training under `run.rollout_mode` (nothing when sync)."""
    if run.rollout_mode == "one_step_off":
        return ["    one_step_off: runs for the next step while this step trains, with the weights "
                "from before this step's update (after step 1, batches are one version stale); "
                "the weight sync waits for it"]
    if run.rollout_mode != "async":
        return []
    out = [f"    async: runs on in a thread of its own, up to {run.max_staleness} step(s) ahead of "
           "training; each update's weights reach the rollout actors at once (batches at most "
           f"{run.max_staleness} version(s) stale)"]
    if run.partial_rollouts:
        out.append("    partial rollouts: a weight sync goes into the generation in flight between two "
                   "tokens; each token's rollout_version names the weights that sampled it")
    return out


def _explain_validation(placed: PlacedPlan) -> list[str]:
    """When validation runs and with what (nothing without a validation source or a generate and
    a reward node)."""
    p, spec = placed.plan, placed.plan.spec
    run = spec.run
    gen, grade = p.first("generate"), p.first("reward")
    if gen is None or grade is None or spec.data.val is None:
        return []
    every = f", every {run.val_every} steps" if run.val_every else ""
    return ["", f"validation (before the first step{every} and after the last): {gen.id} @ {placed.node_stage[gen.id]} "
            f"with n={run.val_n} temperature={run.val_temperature}, graded by {grade.id} @ "
            f"{placed.node_stage[grade.id]}, on {spec.data.val.label} [{spec.data.val.split}]"]


def _explain_memory(placed: PlacedPlan) -> list[str]:
    """Each actor's estimated memory per worker (graph.fit), against its GPU share when known."""
    p, cluster = placed.plan, placed.cluster
    out = ["", "memory per worker (estimate, worst-case rows; docs/memory.md):"]
    if any(s.kind == "actor" and s.num_gpus > 0 for s in placed.stages):
        # the terms are measured on CPU (tests/test_memory.py) and one H200 setting (docs/memory.md)
        out.append("  GPU terms checked on one GPU setting only (one worker, bf16 autocast, no grad "
                   "checkpointing: 1.005x the update's measured peak); FSDP2, offload, checkpointing and "
                   "the allocator's slack are assumptions there (docs/memory.md)")
    out += _row_length_hints(p)
    for s in placed.stages:
        if s.kind != "actor":
            continue
        budget = placed.budgets.get(s.name)
        if budget is None:
            unread = [p.spec.models[m].path for m in s.models if fit.shape_of(p, m) is None]
            out.append(f"  {s.name}: unknown (no config.json to read at {', '.join(unread)})")
            continue
        cap = fit.capacity(s, cluster)
        if cap is not None:
            verdict = f"fits its {cap / 2**30:.1f} GiB GPU share"  # place() refused anything else
        elif s.num_gpus > 0:
            verdict = "GPU size unknown: pass --gpu-mem-gib to check it"
        else:
            verdict = "in RAM (not checked: a node's processes share it)"
        text = budget.format().splitlines()
        out += [f"  {text[0]}; {verdict}", *(f"  {line}" for line in text[1:])]
    return out


def _budget_note(data, src) -> str:
    """The source's declared prompt budget and what happens to a longer prompt ("" without one)."""
    tokens = declared(data, src)
    if tokens is None:
        return ""
    longer = ("dropped" if data.filter_overlong_prompts else
              {"error": "a bad row", "left": "cut to its last tokens", "right": "cut to its first tokens"}[data.truncation])
    return f", at most {tokens} tokens each (a longer prompt: {longer})"


def _row_length_hints(plan: Plan) -> list[str]:
    """Where rows are sized by a model's whole context because no prompt budget bounds them."""
    out = []
    for model in dict.fromkeys(n.model for n in plan.with_role("generate") if n.model):
        shape = fit.shape_of(plan, model)
        if shape is None or not fit.sized_by_whole_context(plan, model):
            continue
        out.append(f"  rows of '{model}' sized by its whole context ({shape.max_position_embeddings} positions): "
                   "no prompt budget is set (data.max_prompt_length sizes them by the budget plus max_tokens)")
    return out


def _group_settings(plan: Plan, model: str) -> str:
    """How a trained model's group trains it (its size and strategy: nothing for one plain
    worker), and in what precision when mixed."""
    spec = plan.spec.models[model]
    train = spec.train
    if model not in plan.trained_models:
        return ""
    group = f", trained by {train.workers} worker(s) with {train.resolved_strategy}" if train.grouped else ""
    extras = [x for x in (_precision(spec), "CPU offload" if train.cpu_offload else "") if x]
    return group + "".join(f", {x}" for x in extras)


def _precision(spec) -> str:
    """What runs under ``train.mixed_precision`` (empty without it)."""
    if spec.train.mixed_precision != "bf16":
        return ""
    others = f"; copies not trained in {spec.dtype}" if spec.dtype != "float32" else ""
    if spec.train.sharded:
        return (f"bf16 mixed precision (FSDP2: fp32 master weights, gradients and AdamW state "
                f"sharded; parameters gathered in bf16, gradients reduced in float32{others})")
    return f"bf16 mixed precision (torch.autocast over fp32 master weights; gradients and AdamW state float32{others})"


def _rollout_settings(plan: Plan, model: str) -> str:
    """The rollout engine's settings, for a backend that takes them and a model that generates."""
    spec = plan.spec.models[model]
    taken = plan.backends[model].rollout_options
    if not taken or not any(n.model == model for n in plan.with_role("generate")):
        return ""
    values = spec.rollout.model_dump()
    derived = plan.engine_context().get(model)
    if values["max_model_len"] is None and derived is not None:
        values["max_model_len"] = f"{derived} (prompt budget + max_tokens)"
    shown = ", ".join(f"{k} {'auto' if values[k] is None else values[k]}" for k in taken)
    return f"\n                 rollout engine: {shown}"


def _explain_syncs(placed: PlacedPlan, after: str) -> list[str]:
    """The weight syncs after train node ``after``; or why there is none."""
    syncs = [s for s in placed.syncs if s.after == after]
    lines = []
    for s in syncs:
        if s.kind == IN_ACTOR:
            lines.append(f"    sync weights: {after} -> rollout engine of '{s.model}' in {s.source} (same actor)")
        else:
            rollout = placed.plan.spec.models[s.model].rollout
            how = (f"broadcast in {rollout.sync_bucket_mb:g} MB buckets on Ray, in-process when local"
                   if rollout.weight_sync == "broadcast" else "through the object store as float32")
            lines.append(f"    sync weights: {after} @ {s.source} -> {s.target} (transfer between actors: {how})")
    model = placed.plan.node(after).model
    if not syncs and any(a == after for a, _ in placed.plan.syncs):
        lines.append(f"    no weight sync: '{model}' generates with the policy {after} trains "
                     f"(same model in {placed.node_stage[after]})")
        if placed.prefetches_generation:
            lines.append("    on Ray the next step's first generation call is queued behind it (unless a "
                         "validation, checkpoint or metrics write comes between)")
    return lines


def _param_text(value) -> str:
    """A param as explain shows it; a nested one (e.g. score's `reward: {model: rm}`) as the
    YAML flow mapping the user wrote, with only the keys set."""
    if isinstance(value, BaseModel):
        inner = ", ".join(f"{k}: {_param_text(getattr(value, k))}" for k in type(value).model_fields
                          if k in value.model_fields_set)
        return "{" + inner + "}"
    return str(value)


def _explain_node(node: PlanNode, stage: str, train: BaseModel | None = None) -> list[str]:
    """The node's lines; ``train``: its model's train section (a setting there may add a column:
    generate's ``routed_experts`` under routing replay)."""
    given = " ".join(f"{k}={_param_text(getattr(node.params, k))}" for k in type(node.params).model_fields
                     if k in node.params.model_fields_set)
    kind = node.op if node.op == node.cardinality else f"{node.op}, {node.cardinality}"
    lines = [f"    {node.id} [{kind}] @ {stage}  (line {node.line})"]
    if given:
        lines.append(f"      params   {given}")
    lines.append(f"      needs    {_columns(requires(node.op_cls, node.params))}")
    made = produces(node.op_cls, node.params, train)
    lines.append(f"      {'emits' if node.cardinality == 'sink' else 'adds':<8} {_columns(made)}")
    notes = contract_of(node.op_cls).explain_notes
    lines += [f"      {note}" for note in (notes(node.params) if notes else [])]
    return lines

