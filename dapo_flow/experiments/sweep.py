"""Sweeps: every variant of a patch file (x seeds) as an MLflow child run of one parent run.

A patch file names a base graph and variants of it, each a list of edits (``dapo_flow.graph.edits``)::

    base: ../grpo.yaml          # the graph the variants edit, relative to this file
    experiment: dapo-ladder     # MLflow experiment of the parent and child runs (default: file stem)
    description: ...            # optional
    seeds: [0, 1]               # optional; `--seeds` overrides; default: the graph's own seed
    settings: []                # edits applied to every variant, before its own
    variants:
      grpo: []                  # the base as it is
      +overlong-filter:         # a mapping extends another variant, then adds its own edits
        extends: grpo
        edits: [{set: {train.mask_truncated: true}}]

An edit entry is one of ``{set: {PATH: VALUE, ...}}``, ``{drop: NODE}`` (or a list of ids),
``{swap: {NODE: OP}}``, ``{insert: {id: NEW, op: OP, after: NODE, model: M, params: {...}}}``,
or CLI flags in one string (``"--set run.steps=3 --drop overlong"``).

``load_patch`` -> ``plan_jobs`` (variants x seeds, seed-major so that every variant has a run
early) -> ``validate_jobs`` (compile all before training any) -> ``run_sweep``. A run that
fails is recorded as a FAILED child run with the error as a tag, and the sweep goes on.
"""

from __future__ import annotations

import os
import re
import shlex
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Iterable

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from rich.console import Console, Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from dapo_flow.graph.problems import Found, did_you_mean, pydantic_problems
from dapo_flow.graph.edits import (
    FLAGS,
    Edit,
    Edited,
    InsertEdit,
    Origin,
    SetEdit,
    apply_edits,
    parse_cli_edit,
    parse_edit_string,
)
from dapo_flow.errors import DapoFlowError, GraphError, Problem
from dapo_flow.graph.loader import GraphDoc, PathKey, load
from dapo_flow.graph.plan import PlacedPlan
from dapo_flow.graph.spec import ID_PATTERN, MAX_EXPERIMENT_LENGTH, MAX_ID_LENGTH
from dapo_flow.tracking import ERROR_TAG, PARENT_TAG, PATCH_TAG, SWEEP_FAILED_TAG

VARIANT_PATTERN = r"^[A-Za-z0-9_+][A-Za-z0-9_+.\-]*$"  # no commas (--only) and no slashes (run names)


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class PatchSpec(_Frozen):
    base: str = Field(min_length=1, description="Graph file the variants edit, relative to this file.")
    experiment: str | None = Field(None, min_length=1, max_length=MAX_EXPERIMENT_LENGTH,
                                   description="MLflow experiment (default: file stem).")
    description: str = ""
    seeds: list[Annotated[int, Field(ge=0)]] | None = Field(None, min_length=1)
    settings: list[Any] = Field(default_factory=list, description="Edits applied to every variant first.")
    variants: dict[str, Any] = Field(min_length=1, description="name -> edits, or {extends:, edits:}.")


class VariantSpec(_Frozen):
    extends: str | None = Field(None, description="Apply this variant's edits first.")
    description: str = ""
    edits: list[Any] = Field(default_factory=list)


class InsertSpec(_Frozen):
    id: str = Field(pattern=ID_PATTERN, max_length=MAX_ID_LENGTH)
    op: str = Field(min_length=1)
    after: str = Field(min_length=1)
    model: str | None = None
    impl: str | None = Field(None, min_length=1)  # op: custom -> "file.py:Class" or "module:Class"
    params: dict[str, Any] = Field(default_factory=dict)


@dataclass(frozen=True)
class Variant:
    name: str
    edits: tuple[Edit, ...]  # settings, then the extended variants' edits, then its own
    extends: str | None = None
    description: str = ""
    own: tuple[Edit, ...] = ()  # its own edits only


@dataclass(frozen=True)
class Patch:
    file: str
    base: Path
    experiment: str
    description: str
    seeds: tuple[int, ...] | None
    settings: tuple[Edit, ...]
    variants: tuple[Variant, ...]


@dataclass(frozen=True)
class Job:
    variant: str
    seed: int | None  # None: the graph's own seed
    edits: tuple[Edit, ...]


@dataclass(frozen=True)
class Ready:
    """A job whose effective graph compiled."""

    job: Job
    edited: Edited
    placed: PlacedPlan

    @property
    def seed(self) -> int:
        return self.placed.plan.spec.seed

    @property
    def run_name(self) -> str:
        return f"{self.job.variant}/seed{self.seed}"

    def params(self, patch: Patch) -> dict[str, str]:
        return {"sweep.variant": self.job.variant, "sweep.seed": str(self.seed),
                "sweep.patch": patch.file, **self.edited.params()}


@dataclass(frozen=True)
class JobResult:
    variant: str
    seed: int
    run_name: str
    ok: bool
    run_id: str | None = None
    summary: dict | None = None
    error: str = ""


@dataclass(frozen=True)
class SweepResult:
    parent_run_id: str
    tracking_uri: str
    results: tuple[JobResult, ...]

    @property
    def failed(self) -> list[JobResult]:
        return [r for r in self.results if not r.ok]


# --- loading ------------------------------------------------------------------------------


def load_patch(path: str | Path) -> Patch:
    """Read and check a patch file; one GraphError lists every problem with file:line."""
    file = str(path)
    p = Path(path)
    if not p.is_file():
        why = "is a directory, not a patch file" if p.is_dir() else "no such file"
        raise GraphError([Problem(file, 0, "", "", why, "give the path of a patch .yaml file, "
                                  "e.g. graphs/ablations/dapo-ladder.yaml")])
    doc = load(p)
    found = Found(doc)
    try:
        spec = PatchSpec.model_validate(doc.raw)
    except ValidationError as err:
        pydantic_problems(found, err, (), PatchSpec)
        found.raise_if_any()
        raise AssertionError("unreachable") from None
    base = Path(os.path.normpath(p.parent / spec.base))
    if not base.is_file():
        found.add(("base",), f"base graph '{spec.base}' not found (looked at {base})",
                  "the path is relative to the patch file")
    settings = _entries(found, doc, spec.settings, ("settings",))
    own: dict[str, tuple[str | None, list[Edit], str]] = {}
    for name, value in spec.variants.items():
        path = ("variants", name)
        if not re.match(VARIANT_PATTERN, name):
            found.add(path, f"bad variant name {name!r}", "use letters, digits and _ + - . (no commas or slashes)")
        if value is None:
            own[name] = (None, [], "")
        elif isinstance(value, list):
            own[name] = (None, _entries(found, doc, value, path), "")
        elif isinstance(value, dict):
            try:
                v = VariantSpec.model_validate(value)
            except ValidationError as err:
                pydantic_problems(found, err, path, VariantSpec)
                continue
            own[name] = (v.extends, _entries(found, doc, v.edits, path + ("edits",)), v.description)
        else:
            found.add(path, f"a variant is a list of edits or a mapping {{extends:, edits:}}, not {value!r}",
                      "write e.g. `grpo: [{drop: overlong}]`")
    variants = []
    for name, (extends, _, description) in own.items():
        chain = _chain(found, own, name)
        if chain is None:
            continue
        edits = [e for link in chain for e in own[link][1]]
        variants.append(Variant(name, tuple(settings) + tuple(edits), extends, description,
                                tuple(own[name][1])))
    found.raise_if_any()
    return Patch(file=file, base=base, experiment=spec.experiment or p.stem, description=spec.description,
                 seeds=tuple(spec.seeds) if spec.seeds else None, settings=tuple(settings),
                 variants=tuple(variants))


def _chain(found: Found, own: dict[str, tuple[str | None, list[Edit], str]], name: str) -> list[str] | None:
    """Variants whose edits ``name`` applies, root first; None (reported) on a bad extends."""
    chain = [name]
    while (parent := own[chain[-1]][0]) is not None:
        if parent not in own:
            if chain[-1] == name:  # reported once, by the variant that names it
                found.add(("variants", name, "extends"), f"extends unknown variant '{parent}'",
                          did_you_mean(parent, own))
            return None
        if parent in chain:
            cycle = chain[chain.index(parent):]
            if name == min(cycle):  # reported once, by one member of the cycle
                found.add(("variants", name, "extends"), "extends cycle: " + " -> ".join([*cycle, parent]),
                          "a variant cannot extend itself, directly or not")
            return None
        chain.append(parent)
    return chain[::-1]


def _entries(found: Found, doc: GraphDoc, entries: Iterable[Any], path: PathKey) -> list[Edit]:
    """Edits of a list of patch entries; problems go to ``found``."""
    out: list[Edit] = []
    for i, entry in enumerate(entries):
        here = path + (i,)
        origin = Origin(doc.file, doc.line_of(here))
        try:
            if isinstance(entry, str):
                out += parse_edit_string(entry, origin)
            elif isinstance(entry, dict) and len(entry) == 1 and next(iter(entry)) in FLAGS:
                kind, body = next(iter(entry.items()))
                out += _ENTRY[kind](found, doc, body, here + (kind,))
            else:
                keys = list(entry) if isinstance(entry, dict) else []
                unknown = next((str(k) for k in keys if k not in FLAGS), None)
                hint = (did_you_mean(unknown, FLAGS) if unknown else
                        "write one edit per list item: [{drop: a}, {set: {...}}]")
                what = (f"an edit has one key ({', '.join(FLAGS)})" if keys
                        else "an edit is {set: {PATH: VALUE}}, {drop: NODE}, {swap: {NODE: OP}}, "
                             "{insert: {id:, op:, after:}} or a string of CLI flags")
                found.add(here, f"{what}, got {entry!r}", hint)
        except GraphError as err:
            found.items += [(GraphError, p) for p in err.problems]
    return out


def _entry_set(found: Found, doc: GraphDoc, body: Any, path: PathKey) -> list[Edit]:
    if not isinstance(body, dict) or not body:
        found.add(path, f"`set` takes a mapping of PATH: VALUE, got {body!r}",
                  "write {set: {train.lr: 5.0e-4, run.steps: 5}}")
        return []
    out: list[Edit] = []
    for key, value in body.items():
        keys = tuple(str(key).split("."))
        if any(not k for k in keys):
            found.add(path + (key,), f"bad path {key!r}: empty key between dots")
            continue
        out.append(SetEdit(keys, value, Origin(doc.file, doc.line_of(path + (key,)))))
    return out


def _entry_drop(found: Found, doc: GraphDoc, body: Any, path: PathKey) -> list[Edit]:
    ids = body if isinstance(body, list) else [body]
    if not ids or not all(isinstance(i, str) for i in ids):
        found.add(path, f"`drop` takes a node id or a list of ids, got {body!r}", "write {drop: overlong}")
        return []
    return [parse_cli_edit("drop", i, Origin(doc.file, doc.line_of(path + ((k,) if isinstance(body, list) else ()))))
            for k, i in enumerate(ids)]


def _entry_swap(found: Found, doc: GraphDoc, body: Any, path: PathKey) -> list[Edit]:
    if not isinstance(body, dict) or not body or not all(isinstance(v, str) for v in body.values()):
        found.add(path, f"`swap` takes a mapping NODE: OP, got {body!r}", "write {swap: {adv: my-advantage}}")
        return []
    return [parse_cli_edit("swap", f"{node}={op}", Origin(doc.file, doc.line_of(path + (node,))))
            for node, op in body.items()]


def _entry_insert(found: Found, doc: GraphDoc, body: Any, path: PathKey) -> list[Edit]:
    try:
        spec = InsertSpec.model_validate(body)
    except ValidationError as err:
        pydantic_problems(found, err, path, InsertSpec)
        return []
    return [InsertEdit(spec.id, spec.op, spec.after, spec.params, spec.model, Origin(doc.file, doc.line_of(path)),
                       impl=spec.impl)]


_ENTRY = {"set": _entry_set, "drop": _entry_drop, "swap": _entry_swap, "insert": _entry_insert}


# --- jobs ---------------------------------------------------------------------------------


def plan_jobs(patch: Patch, *, only: str | Iterable[str] | None = None, seeds: str | Iterable[int] | None = None,
              steps: int | None = None) -> list[Job]:
    """Variants (``only``: names, or a comma-separated string) x seeds, seed-major."""
    names = [v.name for v in patch.variants]
    if isinstance(only, str):
        text, only = only, [o.strip() for o in only.split(",") if o.strip()]
        if not only:
            raise GraphError([Problem(f"<--only {text}>", 0, "", "", "no variant named",
                                      "name some, e.g. --only " + ",".join(names[:2]))])
    chosen = list(patch.variants)
    if only:
        unknown = [o for o in only if o not in names]
        if unknown:
            raise GraphError([Problem(f"<--only {','.join(only)}>", 0, "", "", f"unknown variant '{u}'",
                                      did_you_mean(u, names)) for u in unknown])
        chosen = [v for v in patch.variants if v.name in only]
    seed_list = _seeds(seeds) if seeds is not None else patch.seeds
    extra: list[Edit] = [SetEdit(("tracking", "experiment"), patch.experiment, Origin("<patch experiment>"))]
    if steps is not None:
        extra.append(SetEdit(("run", "steps"), steps, Origin(f"<--steps {steps}>")))
    jobs = []
    for seed in seed_list or (None,):
        seed_edit = (SetEdit(("seed",), seed, Origin(f"<--seeds {seed}>")),) if seed is not None else ()
        jobs += [Job(v.name, seed, v.edits + tuple(extra) + seed_edit) for v in chosen]
    return jobs


def _seeds(seeds: str | Iterable[int]) -> tuple[int, ...]:
    if not isinstance(seeds, str):
        return tuple(seeds)
    try:
        out = tuple(int(s) for s in seeds.split(","))  # an empty entry (0,,1) is an error too
    except ValueError:
        raise GraphError([Problem(f"<--seeds {seeds}>", 0, "", "", f"seeds must be integers, got {seeds!r}",
                                  "write --seeds 0,1,2")]) from None
    twice = sorted({s for s in out if out.count(s) > 1})
    if twice:  # the same run twice: a spread of 0 over identical runs
        raise GraphError([Problem(f"<--seeds {seeds}>", 0, "", "", f"seed {twice[0]} is given twice",
                                  "give each seed once, e.g. --seeds 0,1,2")])
    return out


def validate_jobs(patch: Patch, jobs: Iterable[Job]) -> list[Ready]:
    """Compile every job; one GraphError with every problem, each naming its variants."""
    from dapo_flow.graph.edits import compile_edited

    base = load(patch.base)
    ready: list[Ready] = []
    found: dict[Problem, list[str]] = {}
    for job in jobs:
        try:
            doc = apply_edits(base, job.edits)
            placed = compile_edited(doc, job.edits, base=base)
        except GraphError as err:
            for p in err.problems:
                names = found.setdefault(p, [])
                if job.variant not in names:
                    names.append(job.variant)
            continue
        ready.append(Ready(job, Edited(doc, job.edits, base), placed))
    uris = {r.placed.plan.spec.tracking.uri for r in ready}
    if len(uris) > 1:
        found[Problem(patch.file, 0, "", "", f"variants log to different tracking.uri values {sorted(map(str, uris))}",
                      "a sweep's runs share one MLflow store: set tracking.uri in `settings`")] = []
    if found:
        every = {j.variant for j in jobs}
        raise GraphError([_in_variants(p, names, every) for p, names in found.items()])
    return ready


def _in_variants(p: Problem, names: list[str], every: set[str]) -> Problem:
    if not names:
        return p
    which = "every variant" if set(names) == every and len(every) > 1 else (
        f"variant{'s' if len(names) > 1 else ''} " + ", ".join(names))
    return Problem(p.file, p.line, p.node, p.field, f"{p.message} (in {which})", p.hint)


def dry_run_report(patch: Patch, ready: list[Ready]) -> Group:
    """What a sweep would run: each variant, what it extends and its own edits, one flag a line.
    Lines never wrap (a flag cut mid-token cannot be copied back into a command): print it with
    ``crop=False`` and the terminal folds what is wider than itself."""
    def line(*parts: str | tuple[str, str]) -> Text:
        return Text.assemble(*parts, no_wrap=True, overflow="ignore")

    seeds = ", ".join(map(str, sorted({r.seed for r in ready})))
    lines = [line(("sweep ", "bold"), patch.file),
             line(f"  base {patch.base}, experiment '{patch.experiment}', seeds {seeds}, "
                  f"{len(ready)} run(s)")]
    if patch.settings:
        lines.append(line("  every variant first applies:"))
        lines += [line(f"      {flag}") for e in patch.settings for flag in _flags(e)]
    seen = set()
    for r in ready:
        if r.job.variant in seen:
            continue
        seen.add(r.job.variant)
        variant = next(v for v in patch.variants if v.name == r.job.variant)
        extends = f"extends {variant.extends}, " if variant.extends else ""
        lines.append(line(("  " + variant.name, "bold"), ("  " + extends + f"{len(r.placed.plan.nodes)} nodes", "dim")))
        lines += ([line(f"      {flag}") for e in variant.own for flag in _flags(e)]
                  or [line(("      (no edits of its own)", "dim"))])
    return Group(*lines)


def _flags(edit) -> list[str]:
    """An edit's command-line flags, one "--flag VALUE" each (an insert is several)."""
    tokens = shlex.split(edit.cli())
    return [f"{flag} {shlex.quote(value)}" for flag, value in zip(tokens[::2], tokens[1::2])]


# --- running ------------------------------------------------------------------------------


def run_sweep(patch: Patch, jobs: list[Job] | list[Ready], *, executor: str = "ray", address: str | None = None,
              parallel: int = 1, console: Console | None = None) -> SweepResult:
    """Validate (unless given compiled jobs), then run every job under one parent run."""
    from dapo_flow.tracking import Tracker, default_tracking_uri

    if parallel < 1:
        raise DapoFlowError(f"parallel must be >= 1 (runs at once), got {parallel}")
    console = console or Console()
    compiled = bool(jobs) and all(isinstance(j, Ready) for j in jobs)
    ready = list(jobs) if compiled else validate_jobs(patch, jobs)
    if not ready:
        raise DapoFlowError("nothing to run: no variants selected")
    parallel = min(parallel, len(ready))  # more processes than runs would only split the threads
    uri = ready[0].placed.plan.spec.tracking.uri or default_tracking_uri()
    names = list(dict.fromkeys(r.job.variant for r in ready))
    parent = Tracker(uri, patch.experiment, run_name=f"sweep {Path(patch.file).stem}",
                     tags={PARENT_TAG: "parent", PATCH_TAG: patch.file})
    params = {"sweep.patch": patch.file, "sweep.base": str(patch.base), "sweep.variants": ",".join(names),
              "sweep.seeds": ",".join(dict.fromkeys(str(r.seed) for r in ready)),
              "sweep.executor": executor, "sweep.parallel": str(parallel)}
    n_settings = len(patch.settings)
    for i, name in enumerate(names):
        variant = next(v for v in patch.variants if v.name == name)
        params[f"variant.{i}.name"] = name
        params[f"variant.{i}.edits"] = "; ".join(e.cli() for e in variant.edits[n_settings:]) or "(base)"
    params.update({f"settings.{i}": e.cli() for i, e in enumerate(patch.settings)})
    parent.log_params(params)
    parent.log_artifact(patch.file, "sweep")
    console.print(f"sweep [bold]{escape(patch.experiment)}[/]: {len(names)} variant(s) x "
                  f"{len(ready) // max(len(names), 1)} seed(s) = {len(ready)} run(s), parent run {parent.run_id}")
    isolate = parallel > 1 or (executor == "local" and _engines_need_own_process(ready))
    if isolate and parallel == 1:
        console.print("each run in its own process (logs to files): an in-process vLLM engine "
                      "cannot follow another one in a process")
    try:
        if isolate:
            results = _run_parallel(patch, ready, parent.run_id, uri, executor, address, parallel, console)
        else:
            results = []
            for i, r in enumerate(ready, 1):
                console.rule(f"[{i}/{len(ready)}] {r.run_name}")
                results.append(_run_here(patch, r, parent.run_id, uri, executor, address, console))
    except KeyboardInterrupt:
        parent.finish("KILLED")
        raise
    result = SweepResult(parent.run_id, uri, tuple(results))
    parent.set_tags({SWEEP_FAILED_TAG: str(len(result.failed))})
    parent.finish("FAILED" if result.failed else "FINISHED")
    console.print(results_table(result))
    _compare_at_end(result, console)
    return result


def _engines_need_own_process(ready: list[Ready]) -> bool:
    """True when a run builds a rollout engine that must not follow another in one process
    (models.engines.Backend.one_engine_per_process)."""
    from dapo_flow.models.engines import BACKENDS

    return any(BACKENDS[m.backend].one_engine_per_process
               for r in ready for m in r.placed.plan.spec.models.values())


def _run_here(patch: Patch, r: Ready, parent_id: str, uri: str, executor: str, address: str | None,
              console: Console) -> JobResult:
    from dapo_flow.graph.drawing import plan_artifacts
    from dapo_flow.runtime import execute

    try:
        summary = execute(r.placed, executor=executor, address=address, console=console, run_name=r.run_name,
                          parent_run_id=parent_id, extra_params=r.params(patch),
                          artifacts={**plan_artifacts(r.placed), "graph/effective.yaml": r.edited.yaml()})
    except KeyboardInterrupt:
        raise
    except Exception as exc:
        if isinstance(exc.__context__, KeyboardInterrupt):  # the runtime turns Ctrl-C into RunError
            raise KeyboardInterrupt from exc
        text = str(exc) if isinstance(exc, DapoFlowError) else f"{type(exc).__name__}: {exc}"
        return _failed(patch, r, parent_id, uri, text, traceback.format_exc(), console)
    return JobResult(r.job.variant, r.seed, r.run_name, True, summary["run_id"], summary)


def _failed(patch: Patch, r: Ready, parent_id: str, uri: str, text: str, tb: str, console: Console) -> JobResult:
    """Record a failed run: the runtime's own child run if it got that far, else a new one."""
    from dapo_flow.tracking import Tracker, add_to_run, child_runs, set_run_status

    console.print(f"[bold red]{escape(r.run_name)} failed:[/] {escape(text)}", highlight=False)
    mine = [c for c in child_runs(uri, parent_id) if c["name"] == r.run_name and c["status"] != "FINISHED"]
    if mine:
        run_id = mine[-1]["run_id"]
    else:
        t = Tracker(uri, patch.experiment, run_name=r.run_name, parent_run_id=parent_id)
        t.log_params(r.params(patch))
        t.log_text(r.edited.yaml(), "graph/effective.yaml")
        run_id = t.run_id
    add_to_run(uri, run_id, texts={"error.txt": tb}, tags={ERROR_TAG: text})
    set_run_status(uri, run_id, "FAILED")
    return JobResult(r.job.variant, r.seed, r.run_name, False, run_id, None, text)


def _run_parallel(patch: Patch, ready: list[Ready], parent_id: str, uri: str, executor: str,
                  address: str | None, parallel: int, console: Console) -> list[JobResult]:
    """Each run in its own fresh process (spawned, one run per process: no torch, Ray or
    engine state inherited from an earlier run), logs to a file."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    from dapo_flow.tracking import runs_dir

    logs = runs_dir() / "sweeps" / parent_id
    logs.mkdir(parents=True, exist_ok=True)
    from dapo_flow.threads import cpu_count

    per_process = max(1, cpu_count() // parallel)
    out: dict[int, JobResult] = {}
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=parallel, mp_context=ctx, initializer=_init_worker,
                             initargs=(per_process,), max_tasks_per_child=1) as pool:
        futures = {}
        for i, r in enumerate(ready):
            log = logs / f"{r.job.variant}_seed{r.seed}.log"
            payload = (str(patch.base), r.job.edits, executor, address, r.run_name, parent_id,
                       r.params(patch), r.edited.yaml(), str(log))
            futures[pool.submit(_job_in_process, payload)] = (i, r, log)
            console.print(f"queued {r.run_name} (log: {log})")
        try:
            for fut in as_completed(futures):
                i, r, log = futures[fut]
                try:
                    status, value, tb = fut.result()
                except Exception as exc:  # the worker process died
                    status, value, tb = "failed", f"worker process died: {exc!r}", traceback.format_exc()
                if status == "ok":
                    out[i] = JobResult(r.job.variant, r.seed, r.run_name, True, value["run_id"], value)
                    console.print(f"[green]done[/] {r.run_name}: val acc {value.get('val_acc_end')}")
                else:
                    out[i] = _failed(patch, r, parent_id, uri, value, tb, console)
        except KeyboardInterrupt:
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    return [out[i] for i in sorted(out)]


def _init_worker(count: int) -> None:
    """A sweep process's share of the CPUs, set before torch loads (libgomp reads the
    environment once); ``execute`` then gives the driver and each stage worker theirs."""
    from dapo_flow import threads

    threads.configure(count)


def _job_in_process(payload: tuple) -> tuple[str, Any, str]:
    """Runs in a worker process: compile the job's graph again, execute, report as plain data."""
    base, edits, executor, address, run_name, parent_id, params, yaml_text, log = payload
    try:
        from dapo_flow.graph.drawing import plan_artifacts
        from dapo_flow.graph.edits import edit_file
        from dapo_flow.graph.registry import load_plugins
        from dapo_flow.runtime import execute

        load_plugins()
        placed = edit_file(base, edits).compile()
        with open(log, "w", encoding="utf-8") as f:
            summary = execute(placed, executor=executor, address=address, console=Console(file=f, width=120),
                              run_name=run_name, parent_run_id=parent_id, extra_params=params,
                              artifacts={**plan_artifacts(placed), "graph/effective.yaml": yaml_text})
        return "ok", summary, ""
    except BaseException as exc:  # reported to the parent process as text
        text = str(exc) if isinstance(exc, DapoFlowError) else f"{type(exc).__name__}: {exc}"
        return "failed", text, traceback.format_exc()


def results_table(result: SweepResult) -> Table:
    table = Table(title=f"sweep results (parent run {result.parent_run_id})")
    for col in ("run", "status", "val acc start -> end", "wall (s)", "MLflow run"):
        table.add_column(col)
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    for r in result.results:
        s = r.summary or {}
        table.add_row(escape(r.run_name), "[green]ok[/]" if r.ok else "[red]FAILED[/]",
                      f"{fmt(s.get('val_acc_start'))} -> {fmt(s.get('val_acc_end'))}" if r.ok else escape(r.error[:60]),
                      f"{s['wall_seconds']:.1f}" if r.ok else "-", r.run_id or "-")
    return table


def _compare_at_end(result: SweepResult, console: Console) -> None:
    """The comparison table, and its plot logged to the parent run; never fails the sweep."""
    from dapo_flow.experiments import compare

    try:
        compare.report(result.tracking_uri, result.parent_run_id, out=None, console=console)
    except Exception as exc:  # a missing plot must not hide the sweep's results
        console.print(f"[yellow]could not compare the runs: {exc}[/]")
    console.print(f"compare again / write the plot here: dapo-flow compare {result.parent_run_id} -o compare.png")
