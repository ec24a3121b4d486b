"""`dapo-flow eval`: a trained checkpoint (or the base model) on validation prompts.

The same generate + score path the training loop validates with (so the numbers are the ones
its curves show), with its own sample count, temperature and data: avg@n accuracy, unbiased
pass@k for k = 2, 4, ..., n, score and response length. Printed, and logged as an MLflow run
(tag ``dapo_flow.eval``) next to the training runs of the graph's experiment.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from dapo_flow import threads
from dapo_flow.errors import DataError, RunError
from dapo_flow.runtime import checkpoint
from dapo_flow.runtime.loop import Runner
from dapo_flow.runtime.export import step_folder
from dapo_flow.runtime.resume import checkpoint_root
from dapo_flow.experiments.eval_data import EvalPrompts, ResponseWriter
from dapo_flow.runtime.session import start_executor
from dapo_flow.runtime.setup import driver_threads, stage_setups
from dapo_flow.runtime.worker import quiet_libraries
from dapo_flow.tracking import EVAL_TAG, PARENT_TAG, PATCH_TAG, Tracker



class NoCheckpoint(RunError):
    """The graph has no checkpoint to evaluate (an eval sweep skips such runs)."""


def resolve_checkpoint(spec, which: str, warn: Callable[[str], None] | None = None
                       ) -> tuple[Path | None, dict[str, str], int | None]:
    """``which``: "latest" (the graph's newest intact checkpoint, across its runs; a damaged
    newer one is reported through ``warn`` and skipped), "base" (the models as the graph names
    them) or a path (a ``step_*`` folder, or a run's or graph's folder of them: the newest).
    Returns the step folder, model name -> trained weights, and the step."""
    if which == "base":
        return None, {}, None
    if which == "latest":
        root = checkpoint_root(spec)
        step_dir = _newest_intact(checkpoint.all_checkpoints(root), warn or (lambda text: None))
        if step_dir is None:
            raise NoCheckpoint(f"no checkpoint of graph '{spec.name}' under {root}: train it first "
                           "(`dapo-flow run GRAPH`, with the same --set edits), or pass "
                           "--checkpoint base / --checkpoint PATH")
    else:
        step_dir = step_folder(Path(which).expanduser(), "--checkpoint")
    driver = checkpoint.load_driver(step_dir)
    unknown = sorted(set(driver.trained_models) - set(spec.models))
    if unknown:
        raise RunError(f"--checkpoint {step_dir}: trained model(s) {unknown} are not models of graph "
                       f"'{spec.name}' ({sorted(spec.models)}): evaluate it with the graph it was trained with")
    models = {m: str(step_dir / "models" / m) for m in driver.trained_models}
    return step_dir, models, driver.step


def _newest_intact(found: list[Path], warn: Callable[[str], None]) -> Path | None:
    """The newest of ``found`` that verifies; damaged ones are reported (and left where they
    are: eval only reads)."""
    path, damaged = checkpoint.newest_intact(found)
    for bad, problem in damaged:
        warn(f"checkpoint {bad} is damaged ({problem}); evaluating the one before it")
    return path


EVAL_BATCH_PROMPTS = 256  # prompts per generation batch: big enough to fill an engine, small enough to stream


def evaluate(placed, *, which: str = "latest", n: int | None = None, temperature: float | None = None,
             source: str | None = None, split: str | None = None, size: int | None = None,
             seed: int | None = None, executor: str = "local", address: str | None = None,
             batch_size: int = EVAL_BATCH_PROMPTS, save: str | None = None,
             console: Console | None = None, run_name: str | None = None, parent_run_id: str | None = None,
             extra_params: dict[str, str] | None = None) -> dict:
    """Evaluate and log; returns {"metrics", "run_id", "tracking_uri", "checkpoint", "step", ...}.
    ``seed`` seeds the sampling (default the graph's; it is not part of the checkpoint lookup).
    Prompts stream through generation and grading ``batch_size`` at a time (a parquet source is
    read batch by batch, never whole); ``save``: a .parquet file that gets every graded sample."""
    quiet_libraries()
    threads.configure(driver_threads(placed))  # as `execute` does for a training run
    spec = placed.plan.spec
    console = console or Console()
    missing = [r for r in ("generate", "reward") if placed.plan.first(r) is None]
    if missing:
        raise RunError(f"graph '{spec.name}' has no {' and no '.join(f'{r}-role' for r in missing)} node "
                       "(e.g. `generate`, `score`): eval samples with the graph's generator and grades "
                       "with its reward node")
    writer = ResponseWriter(save) if save else None
    step_dir, models, step = resolve_checkpoint(
        spec, which, lambda text: console.print(f"[yellow]warning:[/] {text}", highlight=False))
    data, role = _eval_prompts(spec, source=source, split=split, size=size, writer=writer, save=save)
    n = n or spec.run.val_n
    temperature = spec.run.val_temperature if temperature is None else temperature
    label = "base model" if step_dir is None else f"{step_dir} (step {step})"
    console.print(f"evaluating {label} on {data.label} [{data.split}], {n} sample(s) per prompt at "
                  f"temperature {temperature}", highlight=False, markup=False)

    setups = stage_setups(placed, models)
    seed = spec.seed if seed is None else seed
    grade = _grade_on_ray_data if executor == "ray" else _grade_with_runner
    try:
        metrics, samples, counts, seconds = grade(placed, setups, data, n=n, temperature=temperature, seed=seed,
                                                  batch_size=batch_size, address=address, console=console,
                                                  writer=writer, executor=executor, role=role)
        if writer is not None:
            writer.close()
    finally:
        if writer is not None:
            writer.abort()  # a no-op once closed: an interrupted eval leaves no half file
    metrics.update({"eval/prompts": float(counts[0]), "eval/skipped_rows": float(counts[1])})

    tracker = _log_eval(spec, step_dir, step, metrics, samples, {
        "eval.n": str(n), "eval.temperature": str(temperature), "eval.source": data.label, "eval.split": data.split,
        "eval.size": str(data.size), "seed": str(seed), **(extra_params or {})}, run_name, parent_run_id)
    _print(console, "base model" if step is None else f"step {step}", metrics, seconds, tracker)
    if writer is not None:
        console.print(f"wrote {writer.path}: {writer.rows} graded sample(s)", highlight=False, markup=False)
    return {"metrics": metrics, "run_id": tracker.run_id, "tracking_uri": tracker.uri,
            "checkpoint": str(step_dir) if step_dir else None, "step": step, "n": n, "seconds": seconds,
            "saved": str(writer.path) if writer is not None else None}


def _eval_prompts(spec, *, source: str | None, split: str | None, size: int | None, writer,
                  save: str | None):
    """The prompts an eval reads: the graph's val data (else its train data), with the source,
    split and size given instead; and the role whose default seed a generated source takes."""
    data = spec.data.val or spec.data.train
    if spec.data.val is None and source is None and split is None:
        raise RunError(f"graph '{spec.name}' has no data.val: pass --source / --split for the prompts")
    role = "val" if spec.data.val is not None else "train"  # a generated source's default seed
    data = data.model_copy(update={k: v for k, v in (("source", source), ("split", split), ("size", size))
                                   if v is not None} | ({"sources": None} if source is not None else {}))
    if writer is not None and data.source is not None and (
            Path(data.source).expanduser().resolve() == writer.path.resolve()):
        raise RunError(f"--save {save}: that is the file the prompts are read from: name another file")
    return data, role


def _log_eval(spec, step_dir, step: int | None, metrics: dict, samples: list, params: dict[str, str],
              run_name: str | None, parent_run_id: str | None) -> Tracker:
    """The eval's MLflow run, finished: which checkpoint, ``params``, the metrics at the
    checkpoint's step (0: the base model) and the logged samples."""
    tracker = Tracker(spec.tracking.uri, spec.tracking.experiment,
                      run_name=run_name or f"eval {spec.name} " + ("base" if step is None else f"step {step}"),
                      tags={EVAL_TAG: "1", "graph": spec.name}, parent_run_id=parent_run_id)
    tracker.log_params({"eval.checkpoint": str(step_dir) if step_dir else "base", "eval.step": str(step),
                        **params})
    tracker.log_metrics(step or 0, metrics)
    if samples:
        tracker.log_table(samples, "samples/eval.json")
    tracker.finish()
    return tracker


def _grade_with_runner(placed, setups, data, *, n, temperature, seed, batch_size, address, console, writer,
                       executor, role="val"):
    """The local eval: the run's stage workers, the training loop's validation over prompt
    batches. Returns (metrics, logged samples, (prompts, skipped rows), seconds)."""
    spec = placed.plan.spec
    ex = start_executor(placed, setups, executor, address, console, seed)
    try:
        prompts = EvalPrompts(placed.plan, data, ex, batch_size, role)
        runner = Runner(placed, ex, None)
        start = time.perf_counter()
        with _progress(console, prompts.total_hint, n) as advance:
            def on_batch(graded, tally) -> None:
                advance(graded.num_rows // n, tally.result().get("val/acc"))
                if writer is not None:
                    writer.write(graded)

            metrics, samples = runner.validate_stream(iter(prompts), spec.tracking.log_samples, n=n,
                                                      temperature=temperature, on_batch=on_batch)
        return metrics, samples, (prompts.count, prompts.skipped), time.perf_counter() - start
    finally:
        ex.shutdown()


def _grade_on_ray_data(placed, setups, data, *, n, temperature, seed, batch_size, address, console, writer,
                       executor, role="val"):
    """The Ray eval: a Ray Data pipeline (experiments.eval_pipeline) whose graded batches the
    driver tallies as they come. Returns what :func:`_grade_with_runner` does."""
    import ray

    from dapo_flow.data.stream import stream_files
    from dapo_flow.experiments.eval_data import streams
    from dapo_flow.experiments.eval_pipeline import graded_batches, row_groups
    from dapo_flow.runtime.executors import connect_ray
    from dapo_flow.runtime.run_data import generator_tokenizer, load_source, tokenize_batch
    from dapo_flow.runtime.validation import ValidationTally

    plan = placed.plan
    owns = connect_ray(address)
    try:
        if streams(data.source):
            groups = row_groups(stream_files(data.source), data.size)
            tokenize = tokenize_batch(plan, data)
            prompts, total, skipped = (groups, tokenize, data.split), sum(g.rows for g in groups), None
        else:
            prompts, skipped = load_source(plan, data, generator_tokenizer(plan), role=role)
            total = prompts.num_rows
        tally = ValidationTally(n, plan.spec.tracking.log_samples)
        start = time.perf_counter()
        with _progress(console, total, n) as advance:
            for graded in graded_batches(placed, setups, prompts, n=n, temperature=temperature, seed=seed,
                                         batch_size=batch_size):
                tally.add(graded)
                advance(graded.num_rows // n, tally.result().get("val/acc"))
                if writer is not None:
                    writer.write(graded)
        if tally.prompts == 0:
            raise DataError(f"{data.label}: no usable prompt row (skipped {total} bad row(s)): nothing to evaluate")
        metrics = tally.result()
        seconds = time.perf_counter() - start
        metrics["time/validate"] = seconds
        return metrics, tally.samples, (tally.prompts, total - tally.prompts if skipped is None else skipped), seconds
    finally:
        if owns:
            ray.shutdown()


@contextlib.contextmanager
def _progress(console: Console, total: int | None, n: int) -> Iterator[Callable[[int, float | None], None]]:
    """A progress bar over the prompts graded (``total``: the source's rows, when known)."""
    columns = [TextColumn("eval"), BarColumn(), MofNCompleteColumn(), TextColumn("prompts x" + str(n)),
               TimeRemainingColumn(), TextColumn("{task.fields[acc]}")]
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("eval", total=total, acc="")

        def advance(prompts: int, acc: float | None) -> None:
            bar.update(task, advance=prompts, acc="" if acc is None else f"acc {acc:.3f}")

        yield advance


def _print(console: Console, label: str, metrics: dict, seconds: float, tracker: Tracker) -> None:
    table = Table(title=f"dapo-flow eval: {label}", show_header=False)
    passes = sorted((k for k in metrics if k.startswith("val/pass_at_")), key=lambda k: int(k.rsplit("_", 1)[1]))
    for key in ["val/acc", *passes, "val/score", "val/response_len_mean"]:
        if key in metrics:
            table.add_row(key.replace("val/acc", "val/acc (avg@n)"), f"{metrics[key]:.4f}")
    for key in ("eval/prompts", "eval/skipped_rows"):
        table.add_row(key, f"{metrics[key]:.0f}")
    table.add_row("seconds", f"{seconds:.2f}")
    table.add_row("MLflow run", tracker.run_id)
    console.print(table)


def evaluate_sweep(patch, ready: list, *, out: str | None = None, console: Console | None = None,
                   **options) -> str:
    """Evaluate every variant x seed of a sweep (``ready``: its compiled jobs) at its newest
    checkpoint, each as an MLflow child run of one eval parent run, then print the comparison
    (mean ± std over seeds, pass@k, Δ vs the first variant); returns the parent run id. A job
    without a checkpoint is reported and skipped. ``options``: those of :func:`evaluate`."""
    from dapo_flow.experiments.compare import report
    from dapo_flow.tracking import default_tracking_uri

    console = console or Console()
    if not ready:
        raise RunError("nothing to evaluate: no variants selected")
    uri = ready[0].placed.plan.spec.tracking.uri or default_tracking_uri()
    names = list(dict.fromkeys(r.job.variant for r in ready))
    parent = Tracker(uri, patch.experiment, run_name=f"eval {Path(patch.file).stem}",
                     tags={PARENT_TAG: "parent", EVAL_TAG: "1", PATCH_TAG: patch.file})
    parent.log_params({"sweep.patch": patch.file, "sweep.variants": ",".join(names),
                       **{f"eval.{k}": str(v) for k, v in options.items() if v is not None}})
    missing = []
    for i, r in enumerate(ready, 1):
        console.rule(f"[{i}/{len(ready)}] eval {r.run_name}")
        try:
            evaluate(r.placed, console=console, run_name=f"eval {r.run_name}", parent_run_id=parent.run_id,
                     extra_params={"sweep.variant": r.job.variant, "sweep.seed": str(r.seed)}, **options)
        except NoCheckpoint:
            missing.append(r.run_name)
            console.print(f"{r.run_name}: no checkpoint, skipped (train it with `dapo-flow sweep`)",
                          style="yellow", markup=False, highlight=False)
        except RunError:
            parent.finish("FAILED")
            raise
    if len(missing) == len(ready):
        parent.finish("FAILED")
        raise RunError(f"no checkpoint for any of the {len(ready)} run(s) of {patch.file}: run "
                       "`dapo-flow sweep` first (with the same --seeds)")
    parent.finish()
    report(uri, parent.run_id, out, console)
    return parent.run_id
