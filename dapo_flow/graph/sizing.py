"""Sizing a placement to the devices the run gets: `workers: auto`, and the GPUs of the actors
without `placement.models` resources. ``placement.place`` calls both; they are pure functions of
the plan, the :class:`Cluster` and the actor stages, and each decision carries the reason
`explain` prints.

- ``workers: auto`` is a worker per GPU the training group can have: the cluster's free GPUs less
  what the other actors take (their `placement.models` asks, and a GPU for each other actor that
  wants one), split between the groups set to auto; at least 1. Without a GPU for the model (a
  CPU cluster, `device: cpu`, a `placement.models` entry with no GPU) it is :data:`CPU_WORKERS`.
- An actor without `placement.models` resources gets a whole GPU where there are enough. Where
  there are not, each worker of a training group of two or more still gets a whole GPU of its
  own (NCCL refuses two ranks of one process group on one device), and the other actors (single
  workers, rollout replicas) share the GPUs left, k to a GPU and 1/k of one each. Where a
  group's workers outnumber the free GPUs, or nothing is left for the others, placement fails
  saying what to change: a model that can use a GPU is never put on CPU because GPUs ran short.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Mapping

from dapo_flow.errors import Problem
from dapo_flow.graph.plan import Cluster, Plan, is_model_stage

AUTO = "auto"

#: The size of a `workers: auto` group that gets no GPU: what the shipped graphs train with on
#: CPU, a 1-thread worker per core of the 2-core machines their figures are measured on. A fixed
#: number rather than the core count, so a CPU run computes the same on any machine (another world
#: size reduces the gradients in another order, and a run's steps carry the rounding).
CPU_WORKERS = 2


@dataclass(frozen=True)
class Sized:
    """The size a `workers: auto` group got, and why."""

    workers: int
    why: str

    @property
    def note(self) -> str:
        """What explain prints, e.g. ``workers: auto -> 1 (1 GPU free)``."""
        return f"workers: auto -> {self.workers} ({self.why})"


@dataclass(frozen=True)
class Shares:
    """The GPUs per worker of each actor stage without `placement.models` resources, a note for
    each that shares one, and the problems where they cannot be given."""

    gpus: dict[str, float]
    notes: dict[str, str] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)


def _gpus(n: float) -> str:
    return f"{n:g} GPU" + ("" if n == 1 else "s")


def wants_gpu(plan: Plan, model: str, cluster: Cluster) -> bool:
    """Whether ``model``'s actors run on GPUs on ``cluster``: it has some, and neither the model
    (`device: cpu`) nor its `placement.models` entry (no num_gpus) keeps it on CPU."""
    if cluster.gpus <= 0 or plan.spec.models[model].device == "cpu":
        return False
    explicit = plan.spec.placement.models.get(model)
    return explicit is None or explicit.num_gpus > 0


def resolve_auto(plan: Plan, cluster: Cluster, model_of: Mapping[str, str],
                 workers: Mapping[str, int | str]) -> dict[str, Sized]:
    """Model -> the size of its `workers: auto` group, for every model set to auto.
    ``model_of``: actor stage -> its model; ``workers``: actor stage -> its size (`auto` for the
    training groups being sized)."""
    models, explicit = plan.spec.models, plan.spec.placement.models
    out = {m: Sized(1, "no actor of its own trains it") for m, spec in models.items() if spec.train.auto}
    auto = [a for a in model_of if workers[a] == AUTO]
    fixed = [a for a in model_of if workers[a] != AUTO]
    asked = sum(explicit[model_of[a]].num_gpus * workers[a] for a in fixed if model_of[a] in explicit)
    others = sum(workers[a] for a in fixed if model_of[a] not in explicit and wants_gpu(plan, model_of[a], cluster))
    on_gpu = [a for a in auto if wants_gpu(plan, model_of[a], cluster)]
    for a in auto:
        m = model_of[a]
        if a not in on_gpu:
            out[m] = Sized(CPU_WORKERS, f"{_no_gpu(plan, m, cluster)}: {CPU_WORKERS} CPU workers, a fixed size so "
                                        "that a run computes the same on any number of cores; a number sets another")
            continue
        each = explicit[m].num_gpus if m in explicit else 1.0
        if each < 1:
            out[m] = Sized(1, f"placement.models.{m}.num_gpus {each:g} is a share of a GPU, and two workers "
                              "of one group never share a device")
            continue
        fits = math.floor((cluster.gpus - asked - others) / len(on_gpu) / each + 1e-9)
        why = [f"{_gpus(cluster.gpus)} free"]
        if asked + others:
            why.append(f"{_gpus(asked + others)} kept for the other actors")
        if len(on_gpu) > 1:
            why.append(f"split between the {len(on_gpu)} groups set to auto")
        if each != 1:
            why.append(f"{_gpus(each)} per worker (placement.models.{m}.num_gpus)")
        if fits < 1:
            why.append("none to spare: one worker")
        out[m] = Sized(max(1, fits), ", ".join(why))
    return out


def _no_gpu(plan: Plan, model: str, cluster: Cluster) -> str:
    """Why ``model`` gets no GPU (it does not :func:`wants_gpu`)."""
    if cluster.gpus <= 0:
        return "no GPU"
    if plan.spec.models[model].device == "cpu":
        return "device: cpu"
    return f"placement.models.{model} asks for no GPU"


def with_sizes(plan: Plan, sizes: Mapping[str, Sized]) -> Plan:
    """``plan`` whose spec has every `workers: auto` replaced by its size (a new plan: the later
    steps, the memory estimate and the runtime read sized groups)."""
    if not sizes:
        return plan
    models = {m: spec.model_copy(update={"train": spec.train.model_copy(update={"workers": sizes[m].workers})})
              if m in sizes else spec for m, spec in plan.spec.models.items()}
    return replace(plan, spec=plan.spec.model_copy(update={"models": models}))


def default_gpus(plan: Plan, cluster: Cluster, model_of: Mapping[str, str], workers: Mapping[str, int]) -> Shares:
    """The GPUs per worker of each actor stage without `placement.models` resources (sized
    groups: ``workers`` holds no `auto`)."""
    explicit = plan.spec.placement.models
    default = [a for a, m in model_of.items() if m not in explicit]
    free = cluster.gpus - sum(explicit[m].num_gpus * workers[a] for a, m in model_of.items() if m in explicit)
    out = {a: 0.0 for a in default}
    wanting = [a for a in default if wants_gpu(plan, model_of[a], cluster)]
    if not wanting or free < 0:  # none wants a GPU; or the explicit asks are over (a problem of their own)
        return Shares(out)
    groups = [a for a in wanting if is_model_stage(a) and workers[a] > 1]  # ranks of a process group
    sharers = [a for a in wanting if a not in groups]
    ranks, actors = sum(workers[a] for a in groups), sum(workers[a] for a in sharers)
    if free >= ranks + actors:
        return Shares({**out, **{a: 1.0 for a in wanting}})
    if free < ranks:
        return Shares(out, problems=[_too_few_for_group(plan, cluster, model_of[a], workers[a], free, ranks)
                                     for a in groups])
    left = free - ranks
    whole = math.floor(left + 1e-9)
    if left <= 1e-9:
        named = ", ".join(f"'{model_of[a]}'" for a in groups)
        return Shares(out, problems=[_nothing_left(plan, model_of[a], a, named, free)
                                     for a in dict.fromkeys(sharers)])
    # k actors to a GPU, 1/k of one each (a share must fit one device); with less than a whole
    # GPU left (explicit shares took the rest), an equal part of what is left
    share = 1.0 / math.ceil(actors / whole) if whole >= 1 else left / actors
    pool = f"the {_gpus(left)} left beside the training groups' own" if groups else _gpus(left)
    note = (f"gpus={share:g}: {actors} actors without placement.models resources share {pool}, "
            f"fewer than one each")
    return Shares({**out, **{a: 1.0 for a in groups}, **{a: share for a in sharers}},
                  notes={a: note for a in sharers})


def _line(plan: Plan, path: tuple) -> int:
    return plan.doc.line_of(path) if plan.doc is not None else 0


def _too_few_for_group(plan: Plan, cluster: Cluster, model: str, size: int, free: float, ranks: int) -> Problem:
    return Problem(
        plan.file, _line(plan, ("models", model, "train", "workers")), "", f"models.{model}.train.workers",
        f"the training group of '{model}' has {size} workers, each needing a GPU of its own (two ranks of "
        f"one process group never share a device), but {_gpus(free)} of the cluster's {cluster.gpus:g} "
        f"are free for the {ranks} group worker(s) without placement.models resources",
        f"set models.{model}.train.workers: auto (a worker per free GPU) or at most {math.floor(free + 1e-9)}, "
        "or run on a bigger cluster")


def _nothing_left(plan: Plan, model: str, stage: str, groups: str, free: float) -> Problem:
    return Problem(
        plan.file, _line(plan, ("models", model)), "", f"models.{model}",
        f"stage '{stage}' wants a GPU or a share of one, but the training group(s) of {groups} take all "
        f"{_gpus(free)} free: nothing is left to share",
        f"lower those groups' train.workers (workers: auto keeps a GPU for the other actors), set "
        f"models.{model}.device: cpu to run it on CPU, or run on a bigger cluster")
