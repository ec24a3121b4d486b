"""Compile a graph file: load -> validate -> plan -> place, pure functions between frozen
objects (see ``dapo_flow.graph.plan``); ``explain`` prints the result without starting Ray.

``validate`` (``dapo_flow.graph.checks``) collects every problem it can find before raising once;
``plan`` applies the rewrites, ``place`` assigns stages to actors and the driver.
"""

from __future__ import annotations

from pathlib import Path
from types import MappingProxyType
from typing import Mapping

import pyarrow as pa
from pydantic import BaseModel

from dapo_flow.core import columns as C
from dapo_flow.graph import fit, sizing
from dapo_flow.graph.checks import validate
from dapo_flow.core.contract import contract_of, node_model, produces, requires, role, uses_model
from dapo_flow.errors import GraphError, Problem
from dapo_flow.graph.loader import load
from dapo_flow.graph.plan import (DRIVER, IN_ACTOR, TRANSFER, Call, Cluster, PlacedPlan, Plan, PlanNode, Stage,
                                  Sync, ValidGraph)
from dapo_flow.graph.registry import Registries
from dapo_flow.graph.problems import type_name
from dapo_flow.graph.rewrites import REWRITES


__all__ = ["Cluster", "Registries", "compile_graph", "explain", "load", "place", "plan", "validate"]


def compile_graph(path: str | Path, cluster: Cluster | None = None,
                  registries: Registries | None = None) -> PlacedPlan:
    """The whole chain; ``cluster`` defaults to this machine, ``registries`` (what op and
    backend names mean) to the built-ins and loaded plugins."""
    return place(plan(validate(load(path), registries)), cluster or Cluster.local())


# --- plan and place -------------------------------------------------------------------


def plan(valid: ValidGraph) -> Plan:
    """Topologically ordered nodes, then every rewrite in ``rewrites.REWRITES``."""
    index = {n.id: i for i, n in enumerate(valid.spec.nodes)}
    nodes = []
    for nid in valid.order:
        s = valid.spec.nodes[index[nid]]
        cls = valid.op_cls[nid]
        nodes.append(PlanNode(
            id=nid, op=s.op, op_cls=cls, params=valid.params[nid],
            model=node_model(cls, s.model, valid.params[nid]),
            inputs=tuple(s.inputs), in_schema=valid.in_schema[nid],
            out_schema=valid.out_schema[nid], cardinality=contract_of(cls).cardinality,
            line=valid.doc.line_of(("nodes", index[nid])), role=role(cls),
        ))
    result = Plan(spec=valid.spec, file=valid.file, nodes=tuple(nodes),
                  train=tuple(valid.order), doc=valid.doc, backends=dict(valid.backends))
    for rewrite in REWRITES:
        result = rewrite(result)
    return result


def _stage_name(node: PlanNode, mode: str) -> str:
    if not uses_model(node.op_cls, node.params):
        return DRIVER
    if mode == "disaggregated" and node.role == "generate":
        return f"rollout:{node.model}"
    return f"model:{node.model}"


def _group_of(plan: Plan, stage: str):
    """The `train:` block of the model a model stage hosts (its group settings); None for the
    driver and for rollout stages (rollout replicas are not training groups)."""
    if not stage.startswith("model:"):
        return None
    return plan.spec.models[stage.split(":", 1)[1]].train


def _workers_of(plan: Plan, stage: str) -> int:
    """Actors a stage runs on: a training group's workers, a rollout stage's replicas, else 1."""
    group = _group_of(plan, stage)
    if group is not None:
        return group.workers
    if stage.startswith("rollout:"):
        return plan.spec.models[stage.split(":", 1)[1]].rollout.replicas
    return 1


def _replica_problems(plan: Plan, actors: list[str]) -> list[Problem]:
    """Rollout replicas need a rollout stage of their own (disaggregated placement)."""
    return [_rollout_problem(
        plan, name, "replicas",
        f"{model.rollout.replicas} rollout replicas of '{name}', but no stage rolls out "
        f"'{name}' on its own (placement {plan.spec.placement.mode}: its trainer generates)",
        "set placement: {mode: disaggregated}, or replicas: 1 (colocated, each worker of a "
        "training group generates its share: raise train.workers instead)")
        for name, model in plan.spec.models.items()
        if model.rollout.replicas > 1 and f"rollout:{name}" not in actors]


def _sleep_problems(plan: Plan, actors: list[str]) -> list[Problem]:
    """`rollout.sleep: true` frees an engine's memory for the trainer beside it: a model whose
    engine runs in a rollout stage of its own has none there."""
    return [_rollout_problem(
        plan, name, "sleep",
        f"sleep frees the rollout engine's memory for a trainer on the same device, but "
        f"'{name}' rolls out in a stage of its own (placement {plan.spec.placement.mode})",
        "remove rollout.sleep (null: on wherever the engine shares a device with its trainer), "
        "or set placement: {mode: colocated}")
        for name, model in plan.spec.models.items()
        if model.rollout.sleep and f"rollout:{name}" in actors]


def _overlap_problems(plan: Plan, stage_of: Mapping[str, str]) -> list[Problem]:
    """`run.rollout_mode` one_step_off and async run the rollout phase beside the training
    phase: they need a rollout phase (a group-filter ends it), and none of its nodes may run in
    a stage that trains, whose weights change under it mid-step (colocated placement generates
    there)."""
    mode = plan.spec.run.rollout_mode
    if mode == "sync":
        return []
    line = plan.doc.line_of(("run", "rollout_mode")) if plan.doc is not None else 0

    def problem(message: str, fix: str) -> Problem:
        return Problem(plan.file, line, "", "run.rollout_mode", message, fix)

    if plan.group_filter is None:
        return [problem(f"{mode} overlaps the rollout phase (the nodes up to a group-filter) with "
                        "training, and this graph has no group-filter: every node runs in one phase",
                        "add a group-filter node after the reward (dynamic sampling), or set rollout_mode: sync")]
    training = {stage_of[n.id] for n in plan.with_role("train")}
    clash = [n for n in plan.rollout if stage_of[n] in training]
    if not clash:
        return []
    return [problem(f"{mode} runs the rollout phase while the model trains, but node '{clash[0]}' "
                    f"of the rollout phase runs in stage {stage_of[clash[0]]}, which trains (placement "
                    f"{plan.spec.placement.mode}): it would see the weights change mid-step",
                    "set placement: {mode: disaggregated} (rollout in actors of their own), or rollout_mode: sync")]


def _partial_problems(plan: Plan) -> list[Problem]:
    """`run.partial_rollouts` loads weights into an engine mid-generation: every generating
    model's backend must be able to (:attr:`Backend.partial_rollouts`)."""
    if not plan.spec.run.partial_rollouts:
        return []
    line = plan.doc.line_of(("run", "partial_rollouts")) if plan.doc is not None else 0
    return [Problem(plan.file, line, node.id, "run.partial_rollouts",
                    f"partial rollouts load new weights into the rollout engine between two tokens of a "
                    f"generation in flight, which backend {plan.spec.models[node.model].backend!r} of model "
                    f"'{node.model}' cannot do",
                    f"set models.{node.model}.backend to one that can (hf, vllm), or remove "
                    "run.partial_rollouts (the weight sync then waits for the generation batch in flight)")
            for node in plan.with_role("generate")
            if node.model and not plan.backends[node.model].partial_rollouts]


def _rollout_problem(plan: Plan, model: str, key: str, message: str, fix: str) -> Problem:
    """A problem with ``models.MODEL.rollout.KEY``, at its line."""
    line = plan.doc.line_of(("models", model, "rollout", key)) if plan.doc is not None else 0
    return Problem(plan.file, line, "", f"models.{model}.rollout.{key}", message, fix)


def _pull_into_actors(plan: Plan, stage_of: dict[str, str]) -> dict[str, str]:
    """A cheap CPU map runs in an actor instead of the driver's stage where that saves a round
    trip and a table copy a step, and the actor then runs the chain in one call:
    - its inputs and consumers all live in that actor (``advantage`` between ``logprob`` and
      ``update``);
    - its consumers all live in that actor, which is one worker, and each input in the driver's
      stage or that actor: the rows travel to the actor either way (``logprob`` with
      `source: rollout` -> ``advantage`` -> ``update`` for a one-worker trainer).
    Never into a stage of several workers (a training group, rollout replicas): each worker sees
    a share of the rows, and a CPU map may need them all (an advantage normalised over the
    batch)."""
    consumers = plan.consumers()
    out = dict(stage_of)

    def movable(n) -> bool:
        return out[n.id] == DRIVER and n.cardinality == "map" and bool(n.inputs) and bool(consumers[n.id])

    def actor_ungrouped(stage: str) -> bool:  # an actor no training group divides the rows of
        group = _group_of(plan, stage)
        return stage != DRIVER and not (group is not None and group.grouped)

    for n in plan.nodes:  # topological order, so chains of CPU maps move one by one
        if not movable(n):
            continue
        around = {out.get(i, DRIVER) for i in (*n.inputs, *consumers[n.id])}
        stage = next(iter(around))
        if len(around) == 1 and actor_ungrouped(stage):
            out[n.id] = stage
    for n in reversed(plan.nodes):  # consumers first, so a chain follows its last node in
        if not movable(n):
            continue
        after = {out[c] for c in consumers[n.id]}
        stage = next(iter(after))
        if (len(after) == 1 and actor_ungrouped(stage) and _workers_of(plan, stage) == 1
                and {out.get(i, DRIVER) for i in n.inputs} <= {DRIVER, stage}):
            out[n.id] = stage
    return out


def place(plan: Plan, cluster: Cluster) -> PlacedPlan:
    """CPU ops in the driver; one actor per model (two when disaggregated), with
    `placement.models` resources or a default that fits the cluster; `workers: auto` sized to
    the cluster first (dapo_flow.graph.sizing), so the placed plan's spec holds the sizes."""
    stage_of = {n.id: _stage_name(n, plan.spec.placement.mode) for n in plan.nodes}
    hosts = {name: name.split(":", 1)[1] for name in dict.fromkeys(stage_of.values()) if name != DRIVER}
    sizes = sizing.resolve_auto(plan, cluster, hosts, {name: _workers_of(plan, name) for name in hosts})
    plan = sizing.with_sizes(plan, sizes)
    stage_of = _pull_into_actors(plan, stage_of)
    members: dict[str, list[str]] = {DRIVER: []}
    for node in plan.nodes:
        members.setdefault(stage_of[node.id], []).append(node.id)
    actors = [name for name in members if name != DRIVER]
    model_of = {name: name.split(":", 1)[1] for name in actors}
    workers = {name: _workers_of(plan, name) for name in actors}
    explicit = plan.spec.placement.models
    shares = sizing.default_gpus(plan, cluster, model_of, workers)
    problems = (_replica_problems(plan, actors) + _sleep_problems(plan, actors)
                + _overlap_problems(plan, stage_of) + _partial_problems(plan)
                + _placement_problems(plan, cluster, model_of, workers) + shares.problems)
    if problems:
        raise GraphError(problems)
    cpu_each = min(1.0, cluster.cpus / (sum(workers.values()) + 1))  # leave the driver a share
    stages = []
    for name in actors:
        m = model_of[name]
        cpus, gpus = (explicit[m].num_cpus, explicit[m].num_gpus) if m in explicit else (cpu_each, shares.gpus[name])
        group = _group_of(plan, name)
        notes = ((sizes[m].note,) if group is not None and m in sizes else ()) + (
            (shares.notes[name],) if name in shares.notes else ())
        stages.append(Stage(name=name, kind="actor", nodes=tuple(members[name]), models=(m,),
                            num_cpus=cpus, num_gpus=gpus, workers=workers[name],
                            strategy=group.resolved_strategy if group else "none",
                            placement_strategy=group.placement_strategy if group else "PACK", notes=notes))
    driver_cpus = max(cluster.cpus - sum(s.num_cpus * s.workers for s in stages), 0.0)
    driver = Stage(DRIVER, DRIVER, tuple(members[DRIVER]), (), driver_cpus, 0.0)
    per_stage = fit.budgets(plan, tuple(stages), cluster)
    problems = fit.memory_problems(plan, tuple(stages), cluster, per_stage)
    if problems:
        raise GraphError(problems)
    node_stage = {nid: name for name, ids in members.items() for nid in ids}
    return PlacedPlan(plan=plan, cluster=cluster, stages=(driver, *stages),
                      node_stage=MappingProxyType(node_stage),
                      calls=MappingProxyType(_calls(plan, node_stage)),
                      syncs=_syncs(plan, node_stage), budgets=MappingProxyType(per_stage))


def _placement_problems(plan: Plan, cluster: Cluster, model_of: Mapping[str, str],
                        workers: Mapping[str, int]) -> list[Problem]:
    """What cannot be placed on ``cluster`` with `placement.models` resources, found before
    anything starts: asks beyond the cluster's, a training group's worker larger than one node or
    on a share of a GPU (the GPUs of the other actors: ``sizing.default_gpus``)."""
    explicit = plan.spec.placement.models
    line = (lambda path: plan.doc.line_of(path) if plan.doc is not None else 0)  # noqa: E731
    problems = []
    for resource, have in (("num_gpus", cluster.gpus), ("num_cpus", cluster.cpus)):
        asked = sum(getattr(explicit[m], resource) * workers[a] for a, m in model_of.items() if m in explicit)
        if asked <= have:
            continue
        for m in dict.fromkeys(m for m in model_of.values() if m in explicit):
            n_workers = sum(workers[a] for a, x in model_of.items() if x == m)
            problems.append(Problem(plan.file, line(("placement", "models", m, resource)), "",
                                    f"placement.models.{m}.{resource}",
                                    f"{n_workers} actor(s) ask for {getattr(explicit[m], resource):g} "
                                    f"{resource[4:-1].upper()}(s) each, {asked:g} in all, but the "
                                    f"cluster has {have:g}", f"lower {resource}, lower "
                                    f"models.{m}.train.workers, or run on a bigger cluster "
                                    "(ray start --address=...)"))
    per_node_gpus, per_node_cpus = cluster.gpus / cluster.nodes, cluster.cpus / cluster.nodes
    for actor, m in model_of.items():
        if m not in explicit or workers[actor] == 1:
            continue
        for resource, per_node in (("num_gpus", per_node_gpus), ("num_cpus", per_node_cpus)):
            each = getattr(explicit[m], resource)
            if each > per_node:
                problems.append(Problem(
                    plan.file, line(("placement", "models", m, resource)), "",
                    f"placement.models.{m}.{resource}",
                    f"each of the {workers[actor]} training workers of '{m}' asks for {each:g} "
                    f"{resource[4:-1].upper()}(s), but a node of the cluster has {per_node:g} "
                    f"({cluster.nodes} node(s)); a worker lives on one node",
                    f"ask for at most {per_node:g} per worker and raise models.{m}.train.workers"))
        each = explicit[m].num_gpus
        if _group_of(plan, actor) is not None and 0 < each < 1:
            problems.append(Problem(
                plan.file, line(("placement", "models", m, "num_gpus")), "", f"placement.models.{m}.num_gpus",
                f"each of the {workers[actor]} training workers of '{m}' asks for {each:g} of a GPU, so two "
                "of them may land on one device, and two ranks of one process group cannot share a "
                "device (NCCL refuses it)",
                f"ask for num_gpus: 1 (or more) per worker, or set models.{m}.train.workers: 1"))
    return problems


def _calls(plan: Plan, stage_of: Mapping[str, str]) -> dict[str, tuple[Call, ...]]:
    """Per phase, its nodes cut into calls: consecutive nodes of one stage, each the only
    consumer of the one before, run in one round trip (one table out and back, however long
    the chain); e.g. logprob -> advantage -> update in the model actor, score -> shaping ->
    group filter in the driver."""
    consumers = plan.consumers()
    out: dict[str, tuple[Call, ...]] = {}
    for phase, ids in plan.phases:
        chains: list[list[str]] = []
        for nid in ids:
            prev = chains[-1][-1] if chains else None
            if (prev is not None and stage_of[nid] == stage_of[prev]
                    and plan.node(nid).inputs == (prev,) and consumers[prev] == [nid]):
                chains[-1].append(nid)
            else:
                chains.append([nid])
        out[phase] = tuple(Call(stage_of[c[0]], tuple(c)) for c in chains)
    return out


def _syncs(plan: Plan, stage_of: Mapping[str, str]) -> tuple[Sync, ...]:
    """Each train node's weight syncs, one per stage that generates with its model: none where
    that stage rolls out with the very policy it trains (colocated, a backend whose rollout
    engine is the trained model: hf), in-actor into the stage's own engine (colocated vLLM),
    a transfer between actors otherwise (disaggregated)."""
    out = []
    for after, model in plan.syncs:
        source = stage_of[after]
        targets = sorted({stage_of[n.id] for n in plan.with_role("generate") if n.model == model})
        for target in targets:
            if target != source:
                out.append(Sync(after, model, source, target, TRANSFER))
            elif not plan.backends[model].generates_with_trainer:
                out.append(Sync(after, model, source, target, IN_ACTOR))
    return tuple(out)


# --- explain --------------------------------------------------------------------------


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


def explain(placed: PlacedPlan) -> str:
    """The placed plan as text: models, stages, then one step phase by phase."""
    p, spec, cluster = placed.plan, placed.plan.spec, placed.cluster
    run = spec.run
    out = [
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
          + _group_settings(p, name) + _lora_settings(m) + ")"
          + _rollout_settings(p, name)
          for name, m in spec.models.items()),
        "",
        "stages:",
    ]
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
        elif s.workers > 1:
            out.append(f"  {'':<16} {s.workers} replicas (resources above are per replica): each takes "
                       "its share of a call's prompts; per-prompt seeds, so the samples do not depend "
                       "on the number")
    out += _explain_memory(placed)
    train = spec.data.train
    gen_batch = run.gen_prompts_per_batch or run.prompts_per_step
    per_batch = ("generation batches sized from the keep rate so far (auto)" if gen_batch == "auto"
                 else f"{gen_batch} per generation batch")
    out += ["", f"step ({run.steps} steps, {run.prompts_per_step} prompt groups each):",
            f"  prompts: {train.label} [{train.split}], {per_batch}{_budget_note(spec.data, train)}",
            f"    emits {_columns(C.prompt_schema())}"]
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
        if phase == "rollout" and run.rollout_mode == "one_step_off":
            out.append("    one_step_off: runs for the next step while this step trains, with the weights "
                       "from before this step's update (after step 1, batches are one version stale); "
                       "the weight sync waits for it")
        elif phase == "rollout" and run.rollout_mode == "async":
            out.append(f"    async: runs on in a thread of its own, up to {run.max_staleness} step(s) ahead of "
                       "training; each update's weights reach the rollout actors at once (batches at most "
                       f"{run.max_staleness} version(s) stale)")
            if run.partial_rollouts:
                out.append("    partial rollouts: a weight sync goes into the generation in flight between two "
                           "tokens; each token's rollout_version names the weights that sampled it")
        for call in placed.calls[phase]:
            if len(call.nodes) > 1:
                out.append(f"    one call @ {call.stage}: {' -> '.join(call.nodes)}")
            for nid in call.nodes:
                if nid == p.group_filter:
                    out.append("    == group barrier: wait for whole prompt groups ==")
                out += _explain_node(p.node(nid), call.stage)
                out += _explain_syncs(placed, nid)
    gen, grade = p.first("generate"), p.first("reward")
    if gen is not None and grade is not None and (spec.data.val is not None):
        every = f", every {run.val_every} steps" if run.val_every else ""
        out += ["", f"validation (before the first step{every} and after the last): {gen.id} @ {placed.node_stage[gen.id]} "
                f"with n={run.val_n} temperature={run.val_temperature}, graded by {grade.id} @ "
                f"{placed.node_stage[grade.id]}, on {spec.data.val.label} [{spec.data.val.split}]"]
    return "\n".join(out) + "\n"


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
    from dapo_flow.graph.prompt_budget import declared

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
    return lines


def _param_text(value) -> str:
    """A param as explain shows it; a nested one (e.g. score's `reward: {model: rm}`) as the
    YAML flow mapping the user wrote, with only the keys set."""
    if isinstance(value, BaseModel):
        inner = ", ".join(f"{k}: {_param_text(getattr(value, k))}" for k in type(value).model_fields
                          if k in value.model_fields_set)
        return "{" + inner + "}"
    return str(value)


def _explain_node(node: PlanNode, stage: str) -> list[str]:
    given = " ".join(f"{k}={_param_text(getattr(node.params, k))}" for k in type(node.params).model_fields
                     if k in node.params.model_fields_set)
    kind = node.op if node.op == node.cardinality else f"{node.op}, {node.cardinality}"
    lines = [f"    {node.id} [{kind}] @ {stage}  (line {node.line})"]
    if given:
        lines.append(f"      params   {given}")
    lines.append(f"      needs    {_columns(requires(node.op_cls, node.params))}")
    made = produces(node.op_cls, node.params)
    lines.append(f"      {'emits' if node.cardinality == 'sink' else 'adds':<8} {_columns(made)}")
    notes = contract_of(node.op_cls).explain_notes
    lines += [f"      {note}" for note in (notes(node.params) if notes else [])]
    return lines

