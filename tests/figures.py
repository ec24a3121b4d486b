"""Figures the README and docs/results.md print, checked against a run on this machine.

Runs are deterministic on one CPU type, but another type's kernels round differently and an RL
run carries the difference. So a figure is checked to the printed digit on the CPU type it
names (a document may give one per CPU type), and within ``OTHER_CPU_TOLERANCE`` (about one
seed's spread) of the first CPU type's on a type it does not name.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OTHER_CPU_TOLERANCE = 0.1


@functools.cache
def _cpuinfo_lines() -> tuple[str, ...]:
    """/proc/cpuinfo's lines, read once (none where there is no such file)."""
    try:
        return tuple(Path("/proc/cpuinfo").read_text().splitlines())
    except OSError:
        return ()


def _cpuinfo(field: str) -> str:
    """The first ``field`` line's value in /proc/cpuinfo, or "" where there is none."""
    return next((line.split(":", 1)[1].strip() for line in _cpuinfo_lines() if line.startswith(field)), "")


def cpu_model() -> str:
    """This machine's CPU model name, or "" where there is none."""
    return _cpuinfo("model name")


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", text.lower())) - {"with"}


def cpu_words() -> set[str]:
    """Words naming this machine's CPU type: its model name's, plus its widest vector set,
    "avx 512" where it has AVX-512, else "avx2" where it has AVX2, and "amx" where it has AMX's
    bf16 tiles. A VM's model name can be as coarse as "Intel Xeon Processor", and the kernels
    torch picks (so a run's rounding) differ between an AVX2 and an AVX-512 machine of one
    name, and in bf16 between Xeons with and without AMX."""
    flags = _cpuinfo("flags").split()
    extra = {"avx", "512"} if "avx512f" in flags else {"avx2"} if "avx2" in flags else set()
    extra |= {"amx"} if "amx_bf16" in flags else set()
    return _words(cpu_model().replace("(R)", "").replace("(TM)", "")) | extra


def on_named_cpu(machine: str) -> bool:
    """Whether this machine is the CPU type ``machine`` ("Intel Xeon", "AMD EPYC (AVX-512)")
    names."""
    return _words(machine) <= cpu_words()


def assert_figures(got: tuple[str, ...], printed: dict[str, tuple[str, ...]], what: str) -> None:
    """``got`` (formatted as printed) equals the figures for this CPU type when ``printed`` (CPU
    type -> figures, in document order) has them; else it is within OTHER_CPU_TOLERANCE of the
    first CPU type's."""
    assert printed, f"no printed figures for {what}"
    for machine, figures in printed.items():
        if on_named_cpu(machine):
            assert got == figures, (what, machine, got, figures)
            return
    machine, figures = next(iter(printed.items()))
    far = [(g, p) for g, p in zip(got, figures) if abs(float(g) - float(p)) > OTHER_CPU_TOLERANCE]
    assert len(got) == len(figures) and not far, (what, got, figures, f"measured on {machine}, here {cpu_model()}")


def start_end(summary: dict) -> tuple[str, str]:
    """A run summary's val acc start -> end as printed (3 decimals)."""
    return f"{summary['val_acc_start']:.3f}", f"{summary['val_acc_end']:.3f}"


def assert_learned(summary: dict, printed: dict[str, tuple[str, str]], what: str) -> None:
    """A run's val acc start -> end is the printed one (:func:`assert_figures`), and on any CPU
    type it gains at least half the printed gain (the tolerance alone would pass a flat run)."""
    assert_figures(start_end(summary), printed, what)
    start, end = (float(v) for v in next(iter(printed.values())))
    assert summary["val_acc_end"] - summary["val_acc_start"] >= (end - start) / 2, (what, summary)


RESULTS = ROOT / "docs" / "results.md"


def results_row(graph: str) -> dict[str, tuple[str, str]]:
    """docs/results.md's "other graphs" row for ``graph`` (e.g. "ppo"): CPU type -> (start, end),
    from cells such as "AMD EPYC (AVX2): 0.228 -> 0.325; Intel Xeon: 0.228 -> 0.294"."""
    text = RESULTS.read_text(encoding="utf-8")
    row = re.search(rf"^\| `graphs/{re.escape(graph)}\.yaml` \|(.*)\|$", text, re.MULTILINE)
    assert row, f"docs/results.md lost graphs/{graph}.yaml's row"
    return {m: (a, b) for m, a, b in re.findall(r"(AMD EPYC \((?:AVX-512|AVX2)\)|Intel Xeon): (\d+\.\d+) -> (\d+\.\d+)", row.group(1))}
