"""Build the built-in models a test session needs before its tests need them.

A built-in model (``builtin:tiny-chat`` ...) is built on first use and cached. A build runs on
one thread (that is what makes its bytes reproducible), so a test that builds one in the middle
of the session holds a whole test worker for minutes while the other core does little; the
shipped tiny-chat and reward model train ~4.5 minutes each. Instead the session starts every
missing build it will need at once, in two background processes ("lanes", one per core), at
normal priority; the test processes step back (``TESTS_NICENESS``) while builds run, so the
builds, the session's critical path, run at nearly full speed. ``tests/conftest.py`` orders the tests so that those
reading a model of a long build come after the others of their tier, and no worker sits
waiting on a build lock while there is other work.

Tests say which built-in models they read with ``@pytest.mark.models("tiny-chat", ...)``;
``tiny_adder_path`` users need no marker. Nothing here changes what a build produces: the
lanes call the same ``build_builtin`` (file lock, temp dir, atomic rename) a test would.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

#: Single-core minutes of each build (a 2-core AMD EPYC VM with AVX2, otherwise idle): they
#: place the builds on the lanes and order the tests that wait on them. Not listed: 1.
BUILD_MINUTES = {"tiny-adder-rm": 4.5, "tiny-chat": 4.5, "tiny-adder-judge": 1.8, "tiny-agent": 1.6,
                 "tiny-adder": 1.5, "tiny-adder-critic": 0.2, "tiny-adder-teacher": 0.7, "tiny-gym": 2.2,
                 "tiny-moe": 1.2}
#: Builds that read another built-in model: it must be built first (the build waits on its lock).
NEEDS = {"tiny-adder-rm": "tiny-adder", "tiny-adder-judge": "tiny-adder", "tiny-adder-critic": "tiny-adder",
         "tiny-adder-teacher": "tiny-adder"}
LANES = 2
#: How far test processes step back while builds run (CFS weight 110 against a build's 1024).
TESTS_NICENESS = 10


def missing(names: set[str]) -> list[str]:
    """Of ``names`` (and what they need), those not in the cache yet (:func:`plan_lanes` orders them)."""
    from dapo_flow.models import builtin_dir

    wanted = set(names) | {NEEDS[n] for n in names if n in NEEDS}
    return sorted(n for n in wanted if not builtin_dir(n).is_dir())


def plan_lanes(names: list[str]) -> list[list[str]]:
    """Split builds over ``LANES`` lanes, list-scheduled: the models others read first, then the
    longest first, each onto the lane where it can start soonest (not before what it reads is
    built: it would wait on that build's lock), so the last build ends as early as it can."""
    lanes: list[list[str]] = [[] for _ in range(LANES)]
    free = [0.0] * LANES
    built_at: dict[str, float] = {}
    for name in sorted(names, key=lambda n: (n not in NEEDS.values(), -BUILD_MINUTES.get(n, 1.0), n)):
        ready = built_at.get(NEEDS.get(name, ""), 0.0)  # what it reads, if this session builds it
        i = min(range(LANES), key=lambda k: (max(free[k], ready), k))
        free[i] = max(free[i], ready) + BUILD_MINUTES.get(name, 1.0)
        built_at[name] = free[i]
        lanes[i].append(name)
    return [lane for lane in lanes if lane]


def ready_at(names: set[str], lanes: list[list[str]]) -> float:
    """When (minutes from the start, one core per lane) every model in ``names`` is built."""
    done = 0.0
    for lane in lanes:
        t = 0.0
        for name in lane:
            t += BUILD_MINUTES.get(name, 1.0)
            if name in names:
                done = max(done, t)
    return done


def start_lanes(lanes: list[list[str]], log_dir: Path) -> list[subprocess.Popen]:
    """One background process per lane, building its models in order; output to ``log_dir``."""
    log_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    for i, lane in enumerate(lanes):
        code = ("import sys\nfrom dapo_flow.models import build_builtin\n"
                "for name in sys.argv[1:]:\n    build_builtin(name, progress=False)\n")
        log = open(log_dir / f"lane-{i}.log", "w")
        log.write(f"building {', '.join(lane)}\n")
        log.flush()
        procs.append(subprocess.Popen([sys.executable, "-c", code, *lane], stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True, env=os.environ.copy()))
    return procs


def step_back() -> None:
    """Lower this test process's priority (and so its children's) while builds run."""
    current = os.nice(0)
    if current < TESTS_NICENESS:
        try:
            os.nice(TESTS_NICENESS - current)
        except OSError:
            pass


def short_tiny_chat():
    """tiny-chat's recipe cut to a few steps: the shipped model's directory, tokenizer and shapes,
    for tests that do not need what its ~5-minute warm start teaches."""
    import dataclasses

    from dapo_flow.recipes import tiny_chat

    return dataclasses.replace(tiny_chat.RECIPE, steps=4, batch_size=8, eval_prompts=4, eval_samples_per_prompt=2)
