"""Whole runs with a training group (models.X.train.workers > 1) on Ray: the main job's sharded
checkpoint exports to a Hugging Face directory that evaluates exactly like the checkpoint (and,
in the figures tier, the main job learns on an FSDP2 group); a killed worker is a clear error
and the run resumes at another world size; a group spans the two nodes of a (simulated)
cluster."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from dapo_flow.graph.edits import edit_file, parse_cli_edits
from dapo_flow.graph.plan import Cluster
from dapo_flow.runtime import checkpoint, execute
from dapo_flow.runtime.checkpoint_models import DCP_DIR, SHARDED_INFO
from dapo_flow.experiments.evaluate import evaluate
from dapo_flow.tracking import read_run, search_runs

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DAPO_FLOW = str(Path(sys.executable).with_name("dapo-flow"))
WAIT_S = 240


def _placed(path, *sets: str, cluster: Cluster = Cluster(cpus=2)):
    return edit_file(path, parse_cli_edits([("set", s) for s in sets])).compile(cluster)


def _env() -> dict[str, str]:
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "RAY_ADDRESS")}
    return {**env, "RAY_AUTH_MODE": "disabled", "COLUMNS": "200"}


def _fsdp2_main_job(workdir, *sets: str) -> tuple[dict, Path, str]:
    """graphs/dapo.yaml on Ray with its policy on an FSDP2 group of 2 (and ``sets``): the run's
    summary, its final checkpoint and its log."""
    log = Console(file=open(workdir / "log.txt", "w"), width=200)
    placed = _placed(ROOT / "graphs/dapo.yaml", "models.policy.train.workers=2", "models.policy.train.strategy=fsdp2",
                     *sets)
    summary = execute(placed, executor="ray", console=log)
    [final] = workdir.glob(f"dapo-flow-runs/checkpoints/*/*/step_{summary['steps']:06d}")
    return summary, final, (workdir / "log.txt").read_text()


@pytest.mark.shared_ray
@pytest.mark.timeout(3 * WAIT_S)
def test_a_sharded_checkpoint_exports_to_a_directory_that_evaluates_as_it_does(workdir):
    """The main job on an FSDP2 group for 4 steps: each worker writes its own shards, `export`
    gathers them into a Hugging Face directory, and that directory evaluates exactly like the
    checkpoint."""
    summary, final, text = _fsdp2_main_job(workdir, "run.steps=4", "run.checkpoint_every=4", "data.val.size=32")
    assert summary["steps"] == 4
    assert "training group of stage 'model:policy': 2 worker(s) on 1 node(s)" in text
    sharded = final / "models" / "policy"
    assert (sharded / DCP_DIR / ".metadata").is_file() and (sharded / SHARDED_INFO).is_file()
    assert len(list((sharded / DCP_DIR).glob("*.distcp"))) == 2  # each worker wrote its own shards

    from dapo_flow import cli

    out = workdir / "exported"
    assert cli.main(["export", str(final.parent), "-o", str(out)]) == 0  # a run folder: its newest
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    assert cli.main(["export", str(final), "-o", str(out)]) == 2  # never over what is there

    # the exported directory is the checkpoint's model: the same eval, to the last digit
    log = Console(file=open(workdir / "eval-log.txt", "w"), width=200)
    one = _placed(ROOT / "graphs/dapo.yaml", "models.policy.train.workers=1")
    from_ckpt = evaluate(one, which=str(final), n=2, size=64, console=log)["metrics"]
    from_export = evaluate(_placed(ROOT / "graphs/dapo.yaml", f"models.policy.path={out}"),
                           which="base", n=2, size=64, console=log)["metrics"]
    assert from_ckpt["val/acc"] == from_export["val/acc"]
    assert from_ckpt["val/response_len_mean"] == from_export["val/response_len_mean"]


@pytest.mark.shared_ray
@pytest.mark.figures  # 120 steps (~2 min); the group's update equals one worker's in the suite
@pytest.mark.timeout(3 * WAIT_S)
def test_the_main_job_learns_at_workers_2_on_fsdp2(workdir):
    summary, final, text = _fsdp2_main_job(workdir)
    assert summary["val_acc_end"] - summary["val_acc_start"] >= 0.08, summary
    assert "training group of stage 'model:policy': 2 worker(s) on 1 node(s)" in text
    assert len(list((final / "models" / "policy" / DCP_DIR).glob("*.distcp"))) == 2


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _worker_pids(root: int) -> list[int]:
    """The stage-worker actors under process ``root`` (the run's Ray cluster is its children's:
    another test's run beside it in the other test process has its own)."""
    r = subprocess.run(["pgrep", "-f", "ray::ActorStageWorker"], capture_output=True, text=True)
    mine = []
    for pid in (int(p) for p in r.stdout.split()):
        ancestor = pid
        while ancestor > 1 and ancestor != root:
            ancestor = _parent(ancestor)
        if ancestor == root:
            mine.append(pid)
    return mine


@pytest.mark.timeout(3 * WAIT_S)
def test_a_killed_group_worker_is_named_then_the_run_resumes_on_one_worker(workdir, small_graph):
    path = small_graph(workdir, name="group", steps=6, ckpt=2)
    uri = f"sqlite:///{workdir / 'dapo-flow-runs' / 'mlflow.db'}"
    log = workdir / "run.log"
    proc = subprocess.Popen([DAPO_FLOW, "run", str(path), "--set", "models.policy.train.workers=2",
                             "--set", "run.max_failures=0"],  # stops at the fault: run.max_failures 0
                            cwd=workdir, env=_env(), stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + WAIT_S
        while not list(workdir.glob("dapo-flow-runs/checkpoints/*/*/step_000002/manifest.json")):
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        pids = _worker_pids(proc.pid)
        assert len(pids) == 2, pids
        subprocess.run(["kill", "-9", str(pids[-1])], check=True)
        rc = proc.wait(WAIT_S)
    finally:
        proc.kill()
        subprocess.run(["pkill", "-9", "-g", str(proc.pid)], capture_output=True)
    out = log.read_text()
    assert rc == 2, out[-3000:]
    assert "of the training group of stage 'model:policy' died" in out and "Traceback" not in out, out[-3000:]
    assert "--resume" in out

    [run] = search_runs(uri, "runtime-tests")
    r = subprocess.run([DAPO_FLOW, "run", str(path), "--executor", "local", "--resume", run["run_id"],
                        "--set", "models.policy.train.workers=1"], cwd=workdir, env=_env(),
                       capture_output=True, text=True, timeout=WAIT_S)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "resuming from" in r.stdout
    done = read_run(uri, run["run_id"])
    assert done["status"] == "FINISHED"
    for key in ("batch/reward_mean", "actor/pg_loss"):  # every step exactly once, across the two
        assert [s for s, _ in done["history"][key]] == list(range(1, 7)), key
    [graph_folder] = workdir.glob("dapo-flow-runs/checkpoints/*")
    assert checkpoint.all_checkpoints(graph_folder)[-1].name == "step_000006"


@pytest.mark.timeout(3 * WAIT_S)
def test_a_group_spreads_over_two_nodes_of_a_cluster(workdir, small_graph):
    from ray.cluster_utils import Cluster as RayCluster

    ray_cluster = RayCluster(initialize_head=True, head_node_args={"num_cpus": 1})
    ray_cluster.add_node(num_cpus=1)
    ray_cluster.wait_for_nodes()
    try:
        path = small_graph(workdir, name="spread", steps=2, ckpt=2)
        placed = _placed(path, "models.policy.train.workers=2", "models.policy.train.placement_strategy=SPREAD",
                         cluster=Cluster(cpus=2, nodes=2))
        log = Console(file=open(workdir / "log.txt", "w"), width=200)
        summary = execute(placed, executor="ray", address=ray_cluster.address, console=log)
        assert summary["steps"] == 2
        text = (workdir / "log.txt").read_text()
        assert "training group of stage 'model:policy': 2 worker(s) on 2 node(s)" in text, text[-3000:]
        [step2] = workdir.glob("dapo-flow-runs/checkpoints/*/*/step_000002")
        assert len(list((step2 / "models/policy" / DCP_DIR).glob("*.distcp"))) == 2
    finally:
        import ray

        ray.shutdown()
        ray_cluster.shutdown()
