"""Shared fixtures, the session's thread budget, and the built-in models it builds ahead."""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import pytest

import model_builds
import xdist_groups
from dapo_flow import threads


def session_threads() -> int:
    """Threads per test process: the cores shared among the session's workers (pytest-xdist
    runs one process per core; each computing on every core would oversubscribe them)."""
    return max(1, threads.cpu_count() // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


ROOT = Path(__file__).resolve().parents[1]

#: the environment the session started with (its thread budget set): the shared Ray cluster's
_PRISTINE_ENV: dict[str, str] = {}


def pytest_configure(config) -> None:
    """One thread budget for the whole session, nesting off, numba on its own pool: before any
    test imports torch's users, numba or vLLM (nested OpenMP, once a vLLM engine and the numba
    kernels have run in one process, makes a 20 s test take 27 minutes: dapo_flow/threads.py)."""
    threads.configure(session_threads())
    _PRISTINE_ENV.update(os.environ)


class _SharedRay:
    """The test process's shared Ray cluster: started for the first test marked ``shared_ray``,
    reused by the next ones (a run's executor or Ray eval joins a running cluster, and kills its
    actors and removes its placement groups when it ends, but leaves the cluster up), shut down
    before any unmarked test (which sees no cluster, as it would alone), after a marked test that
    left something behind, and at session end. A local cluster costs ~3.5-4.5 CPU s and ~3-4 s
    to start and stop (gcs_server, raylet, its agents, idle workers): the 17 marked tests in one
    process started 19 clusters and now 1 (2 since Ray eval leaves Ray Data's service actors),
    ~60 CPU s and ~50 s less of a 10-minute run."""

    ours = False  # this process started the cluster that is up
    starts = reused = dirty = 0
    CLEAN_WAIT_S = 10.0  # a killed actor's death and a removed group's resources land async

    @classmethod
    def ensure(cls) -> None:
        import ray

        if ray.is_initialized():  # ours (or one a test left up: today's run would join it too)
            cls.reused += cls.ours
            return
        from dapo_flow.runtime.executors import connect_ray

        # started as a fresh test would start it, before its monkeypatch and chdir: from the
        # session's environment and the repository root; what connect_ray sets stays set
        saved, cwd = dict(os.environ), os.getcwd()
        os.environ.clear()
        os.environ.update(_PRISTINE_ENV)
        os.chdir(ROOT)
        try:
            connect_ray(None)
        finally:
            added = {k: v for k, v in os.environ.items() if _PRISTINE_ENV.get(k) != v}
            os.environ.clear()
            os.environ.update({**saved, **added})
            os.chdir(cwd)
        cls.ours = True
        cls.starts += 1

    @classmethod
    def leftovers(cls) -> tuple[list[str], list[str]]:
        """What a finished test left on the cluster: (what a run leaves for a moment: live
        actors, placement groups not removed, CPUs or GPUs held, all gone within a second of a
        clean end; Ray's own detached service actors, which stay: Ray Data's stats, autoscaling
        and actor-location actors idle at ~0.7 CPU s a minute each, more than a fresh cluster
        costs over a session's remaining Ray tests)."""
        import ray
        from ray._private import state

        alive = [a for a in state.actors().values() if a.get("State") != "DEAD"]
        passing = [f"actor {a.get('ActorClassName')}" for a in alive if not a.get("IsDetached")]
        passing += [f"placement group {g['placement_group_id']} {g['state']}"
                    for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
        total, free = ray.cluster_resources(), ray.available_resources()
        passing += [f"{free.get(r, 0.0)} of {total[r]} {r} free" for r in ("CPU", "GPU")
                    if r in total and free.get(r, 0.0) < total[r]]
        return passing, [f"detached actor {a.get('ActorClassName')}" for a in alive if a.get("IsDetached")]

    @classmethod
    def after_test(cls) -> None:
        """A marked test is over: keep the cluster if it is clean, else shut it down (the next
        test gets a fresh one; the test does not fail for it)."""
        import ray

        if not cls.ours:
            return
        if not ray.is_initialized():  # the test shut it down itself
            cls.ours = False
            return
        deadline = time.monotonic() + cls.CLEAN_WAIT_S
        try:
            while True:
                passing, staying = cls.leftovers()
                if staying or not passing or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        except Exception as err:  # a cluster that cannot say: not one to reuse
            passing, staying = [], [f"a cluster whose state cannot be read ({err!r})"]
        if passing or staying:
            cls.dirty += 1
            print(f"shared Ray cluster shut down: the test left {passing + staying}", file=sys.stderr)
            cls.stop()

    @classmethod
    def stop(cls) -> None:
        if cls.ours:
            import ray

            ray.shutdown()
            cls.ours = False


@pytest.fixture(scope="module")
def ray_cluster():
    """A Ray cluster of 4 CPUs for a module's tests (they place actors on it themselves). Set up
    before any test's autouse fixtures, so the process's shared cluster, which an earlier test in
    this process may have left up, is shut down here first (``ray.init`` would refuse to start
    a second)."""
    import ray

    _SharedRay.stop()
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="ERROR",
             configure_logging=True)
    yield
    ray.shutdown()


@pytest.fixture(autouse=True)
def _a_shared_ray(request):
    """Runs before the test's other function fixtures (autouse ones set up first, a conftest's in
    name order), so before its monkeypatch and chdir: a test marked ``shared_ray`` gets the
    process's shared Ray cluster (:class:`_SharedRay`); any other test finds none running."""
    if request.node.get_closest_marker("shared_ray") is None:
        _SharedRay.stop()
        yield
        return
    _SharedRay.ensure()
    yield
    _SharedRay.after_test()


@pytest.fixture(autouse=True)
def _thread_budget():
    """Every test starts from the session's budget: a test (or an in-process vLLM engine, or
    numba's OpenMP layer) that changed torch's count or turned nesting on does not leak it."""
    threads.configure(session_threads())
    yield


@pytest.fixture()
def policies(monkeypatch) -> list:
    """Every HFPolicy built from now on in this process (the local executor builds them here);
    ``policies.clear()`` starts the record afresh."""
    from dapo_flow.models.hf import HFPolicy

    built, init = [], HFPolicy.__init__

    def record(self, *args, **kwargs):
        init(self, *args, **kwargs)
        built.append(self)

    monkeypatch.setattr(HFPolicy, "__init__", record)
    return built


@pytest.fixture(scope="session")
def tiny_adder_path() -> Path:
    """The builtin tiny-adder model dir, built once (~15 s) into the persistent cache.

    The cache is ``$DAPO_FLOW_HOME`` (default ~/.cache/dapo-flow); the build is deterministic
    and the directory versioned by recipe, so later sessions reuse it.
    """
    from dapo_flow.models import resolve_model

    return resolve_model("builtin:tiny-adder", progress=False)


@pytest.fixture(scope="session")
def short_tiny_chat_dir(tmp_path_factory) -> Path:
    """A tiny-chat built by ``model_builds.short_tiny_chat``'s recipe (seconds)."""
    from dapo_flow.recipes import tiny_chat

    return tiny_chat.build_tiny_chat(tmp_path_factory.mktemp("tiny-chat"), progress=False,
                                     recipe=model_builds.short_tiny_chat())


_LANES: list = []


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which would pick its test-by-test scheduler
def pytest_xdist_make_scheduler(config, log):
    """Tests sharing a module fixture go to one process (``xdist_groups``), under the default
    ``--dist load`` (the one ``-n 2`` implies); any other ``--dist`` is xdist's own."""
    if config.getvalue("dist") == "load":
        return xdist_groups.ModuleFixtureScheduling(config, log)
    return None


def _leave_out_figures(config, items) -> None:
    """Leave out the ``figures`` tier (full-length runs reproducing what docs/results.md prints)
    unless ``-m`` names it or a test of it is named by its node id (``file::test``)."""
    if "figures" in (config.option.markexpr or "") or any("::" in a for a in config.args):
        return
    kept, left_out = [], []
    for item in items:
        (left_out if item.get_closest_marker("figures") else kept).append(item)
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = kept


@pytest.hookimpl(trylast=True)  # after -m / -k have deselected: only what will run counts
def pytest_collection_modifyitems(session, config, items) -> None:
    """Leave out the figures tier unless asked for; start the builds of the built-in models the
    selected tests read and the cache lacks (in background lanes: ``model_builds``), and order
    the tests: the slow ones first (they start while the builds run and leave no long test for
    the end), those that read a model of a long build after the others, by when it is built;
    then the fast ones, the same way. The order
    depends on the markers alone, not on the cache, so every pytest-xdist worker collects the
    same one."""
    _leave_out_figures(config, items)

    def needs(item) -> set[str]:
        if item.get_closest_marker("skip") is not None:  # e.g. a GPU test on a machine without one
            return set()
        names = {n for mark in item.iter_markers("models") for n in mark.args}
        return names | ({"tiny-adder"} if "tiny_adder_path" in item.fixturenames else set())

    wanted = [needs(item) for item in items]
    every = set().union(*wanted) if wanted else set()
    all_lanes = model_builds.plan_lanes(sorted(every))

    def key(item, models: set[str]):
        long_builds = {n for n in models if model_builds.BUILD_MINUTES.get(n, 1.0) >= 1.0}
        # last, the tests that may share the process's Ray cluster next to each other in their
        # group, so they reuse it (xdist hands tests out in this order, two ahead)
        return (item.get_closest_marker("slow") is None, model_builds.ready_at(long_builds, all_lanes),
                item.get_closest_marker("shared_ray") is None)

    order = {id(item): key(item, w) for item, w in zip(items, wanted)}
    items.sort(key=lambda item: order[id(item)])
    xdist_groups.record(items)

    lanes = model_builds.plan_lanes(model_builds.missing(every))
    if not lanes or config.option.collectonly:
        return
    if os.environ.get("PYTEST_XDIST_WORKER", "gw0") == "gw0":  # one process starts them
        _LANES.extend(model_builds.start_lanes(lanes, Path(tempfile.gettempdir()) / "dapo-flow-test-builds"))
    model_builds.step_back()


def pytest_terminal_summary(terminalreporter) -> None:
    """How often this process's shared Ray cluster started and was reused (with pytest-xdist the
    workers keep their own counts: nothing prints)."""
    if _SharedRay.starts:
        terminalreporter.write_line(f"shared Ray cluster: {_SharedRay.starts} start(s), {_SharedRay.reused} reuse(s), "
                                    f"{_SharedRay.dirty} shut down for what a test left")


def pytest_sessionfinish(session, exitstatus) -> None:
    """A session cut short stops its builds (a build's lock dies with it; its temp dir goes);
    the shared Ray cluster goes; the xdist workers' record of module groups goes."""
    _SharedRay.stop()
    xdist_groups.discard()
    for proc in _LANES:
        if proc.poll() is None:
            proc.terminate()
            proc.wait()
