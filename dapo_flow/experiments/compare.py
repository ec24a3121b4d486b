"""Compare a sweep's variants: val acc, reward, samples and wall time, mean ± std over seeds.

The pure part turns run records into rows and curves: ``RunRecord.from_run`` (a dict from
``tracking.child_runs``) -> ``aggregate`` -> ``Row``s; ``curves`` -> mean curve per variant.
The IO part, ``report(uri, parent_run_id)``, prints the table, draws the PNG and logs both
(compare.png, compare.md) to the parent run; ``compare(target)`` finds the parent run from a
run id or an experiment name (its latest sweep).

"Reward" is ``score/mean``: the verifier's mean score over every rollout generated in the
step, before overlong shaping and before dynamic sampling drops groups, so variants with and
without those nodes compare on the same scale.
"""

from __future__ import annotations

import math
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from rich import box
from rich.cells import cell_len
from rich.console import Console, ConsoleOptions
from rich.markup import escape
from rich.measure import Measurement
from rich.table import Table

from dapo_flow.errors import DapoFlowError
from dapo_flow.tracking import ERROR_TAG, PARENT_TAG

VAL = "val/acc"
REWARD = "score/mean"
REWARD_FALLBACK = "batch/score_mean"
STEP_TIME = "time/step"
SAMPLES = "sampling/samples_generated_total"
PASS_PREFIX = "val/pass_at_"  # val/pass_at_{k}, logged when run.val_n > 1
HISTORY_KEYS = (VAL, REWARD, REWARD_FALLBACK, STEP_TIME, SAMPLES)

Curve = tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class Stat:
    """Mean and sample std (n - 1) of the values that exist; std is None for one value."""

    mean: float | None
    std: float | None
    n: int

    @classmethod
    def of(cls, values: Iterable[float | None]) -> "Stat":
        xs = [float(v) for v in values if v is not None and not math.isnan(v)]
        if not xs:
            return cls(None, None, 0)
        return cls(statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else None, len(xs))

    def fmt(self, spec: str = ".3f") -> str:
        if self.mean is None:
            return "-"
        text = format(self.mean, spec)
        return text if self.std is None else f"{text} ± {format(self.std, spec.replace('+', ''))}"


@dataclass(frozen=True)
class RunRecord:
    """What compare needs of one child run."""

    run_id: str
    variant: str
    seed: str
    status: str
    history: Mapping[str, Curve] = field(default_factory=dict)
    wall_seconds: float | None = None
    samples: float | None = None
    error: str = ""
    final_pass: tuple[int, float] | None = None  # (k, last val/pass_at_k) for the largest k logged

    @classmethod
    def from_run(cls, run: Mapping) -> "RunRecord":
        params, tags, metrics = run.get("params", {}), run.get("tags", {}), run.get("metrics", {})
        name = run.get("name") or run["run_id"]
        history = {k: tuple(sorted((int(s), float(v)) for s, v in pts))
                   for k, pts in (run.get("history") or {}).items()}
        steps = history.get(STEP_TIME)
        if steps:
            wall = sum(v for _, v in steps)
        elif run.get("start_time") is not None and run.get("end_time") is not None:
            wall = (run["end_time"] - run["start_time"]) / 1000
        else:
            wall = None
        samples = history[SAMPLES][-1][1] if history.get(SAMPLES) else metrics.get(SAMPLES)
        ks = [int(k.removeprefix(PASS_PREFIX)) for k in metrics
              if k.startswith(PASS_PREFIX) and k.removeprefix(PASS_PREFIX).isdigit()]
        final_pass = (max(ks), float(metrics[f"{PASS_PREFIX}{max(ks)}"])) if ks else None
        return cls(run_id=run["run_id"], variant=params.get("sweep.variant") or name.split("/")[0],
                   seed=params.get("sweep.seed") or params.get("seed") or "?", status=run.get("status", "?"),
                   history=history, wall_seconds=wall, samples=samples, error=tags.get(ERROR_TAG, ""),
                   final_pass=final_pass)

    @property
    def ok(self) -> bool:
        return self.status == "FINISHED"

    def curve(self, key: str) -> Curve:
        if key == REWARD and not self.history.get(REWARD):
            return self.history.get(REWARD_FALLBACK, ())
        return self.history.get(key, ())


@dataclass(frozen=True)
class Row:
    variant: str
    runs: int  # finished runs (the statistics are over these)
    failed: int
    final_val: Stat
    best_val: Stat
    final_reward: Stat
    samples: Stat
    wall: Stat
    final_pass: Stat = Stat(None, None, 0)  # unbiased pass@k at the end, k = pass_k
    pass_k: int | None = None
    delta: "Delta | None" = None  # final val acc against the baseline variant
    is_baseline: bool = False


@dataclass(frozen=True)
class Delta:
    """Difference of mean final val acc, this variant minus the baseline, with a 95% Welch
    confidence interval (unequal variances; None when either side has fewer than 2 seeds)."""

    diff: float
    low: float | None
    high: float | None

    @classmethod
    def of(cls, xs: Sequence[float], base: Sequence[float]) -> "Delta | None":
        if not xs or not base:
            return None
        diff = statistics.fmean(xs) - statistics.fmean(base)
        if len(xs) < 2 or len(base) < 2:
            return cls(diff, None, None)
        va, vb = statistics.variance(xs) / len(xs), statistics.variance(base) / len(base)
        if va + vb == 0:
            return cls(diff, diff, diff)
        from scipy.stats import t

        dof = (va + vb) ** 2 / (va ** 2 / (len(xs) - 1) + vb ** 2 / (len(base) - 1))
        half = float(t.ppf(0.975, dof)) * math.sqrt(va + vb)
        return cls(diff, diff - half, diff + half)

    def fmt(self) -> str:
        text = f"{self.diff:+.3f}"
        return text if self.low is None else f"{text} [{self.low:+.3f}, {self.high:+.3f}]"


COLUMNS = ("variant", "seeds", "final val acc", "best val acc", "final reward", "samples",
           "wall (s)")


def columns(rows: Sequence[Row]) -> tuple[str, ...]:
    """COLUMNS, plus "final pass@k" after the val acc columns when the runs logged pass@k, plus
    the difference to the baseline when there is one; only the val columns when no run trained
    (an eval sweep: one validation per run)."""
    ks = {r.pass_k for r in rows if r.pass_k is not None}
    extra = ()
    if ks:
        extra = (f"final pass@{ks.pop()}" if len(ks) == 1 else "final pass@k",)
    base = next((r.variant for r in rows if r.is_baseline), None)
    if base is not None:
        extra += (f"{DELTA_PREFIX}{base} [95% CI]",)
    trained = any(r.final_reward.n or r.samples.n for r in rows)
    return COLUMNS[:4] + extra + COLUMNS[4:] if trained else COLUMNS[:3] + extra


DELTA_PREFIX = "Δ val acc vs "  # + the baseline variant's name


def _order(records: Sequence[RunRecord], order: Iterable[str]) -> list[str]:
    names = list(dict.fromkeys(order))
    return [n for n in names if any(r.variant == n for r in records)] + sorted(
        {r.variant for r in records} - set(names), key=[r.variant for r in records].index)


def _final_vals(records: Sequence[RunRecord], variant: str) -> list[float]:
    return [r.curve(VAL)[-1][1] for r in records if r.variant == variant and r.ok and r.curve(VAL)]


def aggregate(records: Sequence[RunRecord], order: Iterable[str] = (),
              baseline: str | None = None) -> list[Row]:
    """One row per variant (in ``order``, then first appearance); failed runs only counted.
    ``baseline``: a variant every row's final val acc is compared with (:class:`Delta`)."""
    rows = []
    base = _final_vals(records, baseline) if baseline else []
    for name in _order(records, order):
        mine = [r for r in records if r.variant == name]
        ok = [r for r in mine if r.ok]
        last = lambda curve: curve[-1][1] if curve else None  # noqa: E731
        rows.append(Row(
            variant=name, runs=len(ok), failed=len(mine) - len(ok),
            final_val=Stat.of(last(r.curve(VAL)) for r in ok),
            best_val=Stat.of(max((v for _, v in r.curve(VAL)), default=None) for r in ok),
            final_reward=Stat.of(last(r.curve(REWARD)) for r in ok),
            samples=Stat.of(r.samples for r in ok),
            wall=Stat.of(r.wall_seconds for r in ok),
            final_pass=Stat.of(r.final_pass[1] for r in ok if r.final_pass),
            pass_k=max((r.final_pass[0] for r in ok if r.final_pass), default=None),
            delta=Delta.of(_final_vals(records, name), base) if baseline and name != baseline else None,
            is_baseline=name == baseline,
        ))
    return rows


def curves(records: Sequence[RunRecord], key: str,
           order: Iterable[str] = ()) -> dict[str, list[tuple[int, float, float]]]:
    """variant -> [(step, mean, std)] over its finished runs (std 0 where one run has the step)."""
    out = {}
    for name in _order(records, order):
        by_step: dict[int, list[float]] = {}
        for r in records:
            if r.variant == name and r.ok:
                for step, value in r.curve(key):
                    by_step.setdefault(step, []).append(value)
        if by_step:
            out[name] = [(s, statistics.fmean(v), statistics.stdev(v) if len(v) > 1 else 0.0)
                         for s, v in sorted(by_step.items())]
    return out


def sample_curves(records: Sequence[RunRecord],
                  order: Iterable[str] = ()) -> dict[str, list[tuple[float, float, float]]]:
    """variant -> [(samples generated so far, val mean, val std)] at its validation steps, the
    sample count averaged over seeds: how much generation each variant spends for its accuracy."""
    spent = curves(records, SAMPLES, order)
    out = {}
    for name, pts in curves(records, VAL, order).items():
        by_step = {0: 0.0, **{step: mean for step, mean, _ in spent.get(name, ())}}
        out[name] = [(by_step[step], mean, std) for step, mean, std in pts if step in by_step]
    return out


def _cells(row: Row, cols: tuple[str, ...]) -> list[str]:
    """The row's cells for ``cols`` (from :func:`columns`)."""
    mixed = "final pass@k" in cols  # variants logged different k: each cell says its own
    cells = {
        "variant": row.variant,
        "seeds": str(row.runs) + (f" (+{row.failed} failed)" if row.failed else ""),
        "final val acc": row.final_val.fmt(), "best val acc": row.best_val.fmt(),
        "final reward": row.final_reward.fmt("+.3f"), "samples": row.samples.fmt(".0f"),
        "wall (s)": row.wall.fmt(".1f"),
    }
    for col in cols:
        if col.startswith("final pass@"):
            cells[col] = row.final_pass.fmt() + (f" (@{row.pass_k})" if mixed and row.pass_k else "")
        elif col.startswith(DELTA_PREFIX):
            cells[col] = (row.delta.fmt() if row.delta is not None
                          else "(baseline)" if row.is_baseline else "-")
    return [cells[col] for col in cols]


def table(rows: Sequence[Row], title: str = "") -> "FittedTable":
    """The terminal table. At 80 columns it narrows by breaking headers between words and cells
    between a mean and its std (``0.370`` over ``±0.020``), never inside a number."""
    cols = columns(rows)
    headers = ["Δ val acc [95% CI]" if c.startswith(DELTA_PREFIX) else c for c in cols]  # the
    # baseline is the row marked (baseline); its name in the header would widen the column
    body = [[c.replace("± ", "±") for c in _cells(row, cols)] for row in rows]
    return FittedTable(headers, body, title, caption="mean ±std over seeds; reward = mean verifier "
                       "score of all rollouts in the last step (before shaping and filtering)")


@dataclass(frozen=True)
class FittedTable:
    """A rich table whose columns, when the terminal is too narrow for one line per row, keep
    at least their longest word: rich alone shrinks the widest columns level with each other and
    then cuts every column alike, so "0.370 ± 0.020" read "0.3…". The first column never wraps."""

    headers: Sequence[str]
    body: Sequence[Sequence[str]]
    title: str = ""
    caption: str = ""

    def _table(self, widths: Sequence[int] | None = None) -> Table:
        """At natural width; with ``widths``, fixed columns one space apart and no outer edge."""
        t = Table(title=self.title or None, caption=self.caption, box=box.SIMPLE_HEAD,
                  pad_edge=False, collapse_padding=True, show_edge=widths is None,
                  padding=(0, 1) if widths is None else 0)
        for i, header in enumerate(self.headers):
            t.add_column(header, justify="left" if i == 0 else "right", no_wrap=i == 0,
                         width=None if widths is None else widths[i])
        for row in self.body:
            t.add_row(*(escape(c) for c in row))
        return t

    def __rich_console__(self, console: Console, options: ConsoleOptions):
        unbounded = options.update_width(1_000_000)  # a measurement is capped at the width
        natural = self._table()
        if Measurement.get(console, unbounded, natural).maximum <= options.max_width:
            yield natural
            return
        texts = list(zip(self.headers, *self.body))  # per column: header, then its cells
        longest = [max(cell_len(t) for t in col) for col in texts]
        least = [longest[0], *(max(cell_len(w) for t in col for w in t.split()) for col in texts[1:])]
        frame = Measurement.get(console, unbounded, self._table(longest)).maximum - sum(longest)
        spare = options.max_width - frame - sum(least)
        if spare < 0:  # not even one word per line fits: rich's own cutting is all there is
            yield natural
            return
        want = [hi - lo for hi, lo in zip(longest, least)]  # what each column lacks for one line
        give = [spare * w // max(sum(want), 1) for w in want]
        yield self._table([lo + g for lo, g in zip(least, give)])


def markdown(rows: Sequence[Row], title: str = "") -> str:
    lines = [f"# {title}", ""] if title else []
    cols = columns(rows)
    lines += ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(_cells(r, cols)) + " |" for r in rows]
    lines += ["", "mean ± std over seeds; reward = mean verifier score (`score/mean`) of all rollouts "
              "in the last step, before overlong shaping and dynamic-sampling filtering."]
    return "\n".join(lines) + "\n"


def _rolling(values: list[float], window: int) -> list[float]:
    """Trailing mean over ``window`` points (the first points average what they have)."""
    import numpy as np

    if window <= 1 or not values:
        return list(values)
    csum = np.cumsum(np.concatenate([[0.0], values]))
    idx = np.arange(1, len(values) + 1)
    lo = np.maximum(idx - window, 0)
    return list((csum[idx] - csum[lo]) / (idx - lo))


def _band(ax, xs: list[float], mean: list[float], std: list[float], name: str) -> None:  # noqa: ANN001
    (line,) = ax.plot(xs, mean, marker="o" if len(xs) < 15 else None, ms=3, label=name)
    if any(std):
        ax.fill_between(xs, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                        color=line.get_color(), alpha=0.15)


def plot(records: Sequence[RunRecord], out: str | Path, order: Iterable[str] = (), title: str = "") -> Path:
    """val/acc and reward vs step, and val/acc vs samples generated, one line per variant (mean
    over seeds, ± std shaded)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    order = list(order)
    fig, axes = plt.subplots(1, 3, figsize=(18, 4.8))
    panels = ((axes[0], VAL, "val acc", 1), (axes[1], REWARD, "reward (rollout score, 10-step mean)", 10))
    for ax, key, label, window in panels:
        for name, pts in curves(records, key, order).items():
            steps = [p[0] for p in pts]
            mean = _rolling([p[1] for p in pts], window)  # per-step reward is too noisy to read
            std = _rolling([p[2] for p in pts], window)
            _band(ax, steps, mean, std, name)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    for name, pts in sample_curves(records, order).items():  # same colours: same variant order
        _band(axes[2], [p[0] for p in pts], [p[1] for p in pts], [p[2] for p in pts], name)
    axes[2].set_xlabel("samples generated")
    axes[2].set_ylabel("val acc")
    axes[2].grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    if not handles:
        handles, labels = axes[1].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="center right", fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 0.9, 1))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


# --- IO: MLflow ---------------------------------------------------------------------------


def report(uri: str, parent_run_id: str, out: str | Path | None = "compare.png",
           console: Console | None = None, baseline: str | None = None) -> list[Row]:
    """Print the comparison of a parent run's children, write the plot to ``out`` (if given)
    and log compare.png and compare.md to the parent run. ``baseline``: the variant the others'
    final val acc is compared with (default: the sweep's first variant)."""
    import shutil

    from dapo_flow.tracking import add_to_run, child_runs, find_run

    console = console or Console()
    parent = find_run(uri, parent_run_id)
    if parent is None:
        raise DapoFlowError(f"no run '{parent_run_id}' in {uri}")
    records = [RunRecord.from_run(r) for r in child_runs(uri, parent_run_id, HISTORY_KEYS)]
    if not records:
        raise DapoFlowError(f"run {parent_run_id} ('{parent['name']}') has no child runs: pass the "
                            "parent run id that `dapo-flow sweep` prints, or the sweep's experiment name")
    order = [v for v in parent["params"].get("sweep.variants", "").split(",") if v]
    title = f"{parent['name']} ({parent_run_id[:8]})"
    names = _order(records, order)
    if baseline is not None and baseline not in names:
        from dapo_flow.graph.problems import did_you_mean

        raise DapoFlowError(f"--baseline '{baseline}' is not a variant of this sweep\n    fix: "
                            + did_you_mean(baseline, names))
    if baseline is None and len(names) > 1:
        baseline = names[0]
    rows = aggregate(records, order, baseline)
    console.print(table(rows, title))
    for r in records:
        if not r.ok:
            console.print(f"{r.variant}/seed{r.seed} {r.status}: {r.error or '(no error recorded)'}",
                          style="red", markup=False, highlight=False)
    with tempfile.TemporaryDirectory() as tmp:
        png = plot(records, Path(tmp) / "compare.png", order, title)
        add_to_run(uri, parent_run_id, files={str(png): None}, texts={"compare.md": markdown(rows, title)})
        if out is not None:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(png, out)
            console.print(f"wrote {out}; logged compare.png and compare.md to run {parent_run_id}")
    return rows


NEEDS = ("compare shows a sweep: pass the experiment name of a `dapo-flow sweep` (or `eval --sweep`; its "
         "latest sweep) or the parent run id it printed")


def resolve(target: str, uri: str) -> str:
    """The parent run id for ``target``: a parent run id, a child run id (its parent), or an
    experiment name (its latest sweep)."""
    from dapo_flow.graph.problems import did_you_mean
    from dapo_flow.tracking import experiment_names, experiments_with, find_run, latest_run

    run = find_run(uri, target)
    if run is not None:
        parent = run["tags"].get("mlflow.parentRunId")
        return parent if parent and run["tags"].get(PARENT_TAG) != "parent" else target
    is_parent = f"tags.`{PARENT_TAG}` = 'parent'"
    parent = latest_run(uri, target, is_parent)
    if parent is not None:
        return parent["run_id"]
    sweeps = experiments_with(uri, is_parent)  # only names compare can show: never a dead end
    fix = (did_you_mean(target, sweeps) if sweeps
           else "no sweeps in this store yet: run `dapo-flow sweep PATCH` first")
    what = ("an experiment without a sweep" if target in experiment_names(uri)
            else "neither a run id nor an experiment")
    raise DapoFlowError(f"'{target}' is {what} in {uri}\n    {NEEDS}\n    fix: {fix}")


def compare(target: str, out: str | Path | None = "compare.png", console: Console | None = None,
            uri: str | None = None, baseline: str | None = None) -> list[Row]:
    from dapo_flow.tracking import default_tracking_uri

    if out is not None and (Path(out).suffix.lower() != ".png" or Path(out).is_dir()):
        raise DapoFlowError(f"-o {out}: the plot is a PNG image: name a .png file (not a folder)")
    uri = uri or default_tracking_uri()
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).is_file():
        raise DapoFlowError(f"no MLflow store at {uri.removeprefix('sqlite:///')}: run `dapo-flow sweep` in "
                            "this directory first, or set MLFLOW_TRACKING_URI")
    return report(uri, resolve(target, uri), out, console, baseline)
