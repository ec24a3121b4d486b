"""What ``place`` refuses before anything starts, each problem at its line in the graph file:
rollout settings the placement leaves no stage for (replicas, sleep), a rollout mode that would
overlap rollout with a stage that trains, partial rollouts on a backend that cannot take them,
`placement.models` resources the cluster cannot give, and a sequence-parallel split the group
or the model's heads do not allow."""

from __future__ import annotations

from typing import Mapping

from dapo_flow.errors import Problem
from dapo_flow.graph.plan import Cluster, Plan, is_model_stage, rollout_stage


def placement_problems(plan: Plan, cluster: Cluster, stage_of: Mapping[str, str], model_of: Mapping[str, str],
                       workers: Mapping[str, int]) -> list[Problem]:
    """Every problem below, in this order. ``stage_of``: node id -> stage; ``model_of``: actor
    stage -> the model it hosts; ``workers``: actor stage -> its workers (sized: no `auto`)."""
    actors = list(model_of)
    return (_replica_problems(plan, actors) + _sleep_problems(plan, actors)
            + _overlap_problems(plan, stage_of) + _partial_problems(plan)
            + _resource_problems(plan, cluster, model_of, workers)
            + _sequence_parallel_problems(plan, model_of, workers))


def _replica_problems(plan: Plan, actors: list[str]) -> list[Problem]:
    """Rollout replicas need a rollout stage of their own (disaggregated placement)."""
    return [_rollout_problem(
        plan, name, "replicas",
        f"{model.rollout.replicas} rollout replicas of '{name}', but no stage rolls out "
        f"'{name}' on its own (placement {plan.spec.placement.mode}: its trainer generates)",
        "set placement: {mode: disaggregated}, or replicas: 1 (colocated, each worker of a "
        "training group generates its share: raise train.workers instead)")
        for name, model in plan.spec.models.items()
        if model.rollout.replicas > 1 and rollout_stage(name) not in actors]


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
        if model.rollout.sleep and rollout_stage(name) in actors]


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



def _resource_problems(plan: Plan, cluster: Cluster, model_of: Mapping[str, str],
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
        if is_model_stage(actor) and 0 < each < 1:  # a training group's workers
            problems.append(Problem(
                plan.file, line(("placement", "models", m, "num_gpus")), "", f"placement.models.{m}.num_gpus",
                f"each of the {workers[actor]} training workers of '{m}' asks for {each:g} of a GPU, so two "
                "of them may land on one device, and two ranks of one process group cannot share a "
                "device (NCCL refuses it)",
                f"ask for num_gpus: 1 (or more) per worker, or set models.{m}.train.workers: 1"))
    return problems



def _sequence_parallel_problems(plan: Plan, model_of: Mapping[str, str], workers: Mapping[str, int]) -> list[Problem]:
    """`train.sequence_parallel: k` splits each sequence over k workers of the group and each
    attention's heads over the same k: k must divide the group as placed (`workers: auto` is
    sized only now) and the model's query and key/value heads (its config.json; a model without
    one is checked when it loads), and only a language model's logprobs are split (a critic's
    values and a reward model's scores run whole sequences)."""
    from dapo_flow.models import model_config  # light: no torch

    problems = []
    for actor, name in model_of.items():
        model = plan.spec.models[name]
        k = model.train.sequence_parallel
        if k == 1 or not is_model_stage(actor):
            continue
        line = plan.doc.line_of(("models", name, "train", "sequence_parallel")) if plan.doc is not None else 0
        where = f"models.{name}.train.sequence_parallel"

        def problem(message: str, fix: str) -> Problem:
            return Problem(plan.file, line, "", where, message, fix)

        if workers[actor] % k:
            problems.append(problem(f"sequence_parallel {k} must divide the training group of '{name}', "
                                    f"which is placed with {workers[actor]} worker(s)",
                                    f"set models.{name}.train.workers to a multiple of {k}, "
                                    "or another sequence_parallel"))
        if model.resolved_head != "lm":
            problems.append(problem(f"sequence_parallel splits a language model's logprobs, but '{name}' has "
                                    f"head: {model.resolved_head}", "remove sequence_parallel from this model"))
        config = model_config(model.path) or {}
        heads = config.get("num_attention_heads")
        kv_heads = config.get("num_key_value_heads") or heads
        if isinstance(heads, int) and (heads % k or kv_heads % k):
            problems.append(problem(f"sequence_parallel {k} splits each attention's heads over {k} workers, but "
                                    f"'{name}' has {heads} query and {kv_heads} key/value heads",
                                    f"a sequence_parallel that divides both (1 turns it off)"))
    return problems
