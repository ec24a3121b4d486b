"""`run --address` places the graph on the Ray cluster it joins (what that cluster has free), not
on this machine; and a training group's process group follows the device its model trains on."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest

from dapo_flow import cli
from dapo_flow.errors import RunError
from dapo_flow.graph.plan import Cluster
from dapo_flow.runtime import executors

ROOT = Path(__file__).resolve().parents[2]
DAPO = str(ROOT / "graphs" / "dapo.yaml")

# what Ray reports of a cluster of two 8-GPU nodes with 2 GPUs taken (fakes: no Ray runs here)
FAKE_AVAILABLE = {"CPU": 120.0, "GPU": 14.0, "memory": 1e12, "node:10.0.0.1": 1.0, "node:10.0.0.2": 1.0}
FAKE_NODES = [{"NodeID": "a", "Alive": True, "Resources": {"CPU": 64.0, "GPU": 8.0}},
              {"NodeID": "b", "Alive": True, "Resources": {"CPU": 64.0, "GPU": 8.0}},
              {"NodeID": "c", "Alive": False, "Resources": {"CPU": 64.0, "GPU": 8.0}}]  # a node gone


def test_the_cluster_is_what_ray_reports_free_over_its_live_nodes():
    assert executors.cluster_of(FAKE_AVAILABLE, FAKE_NODES) == Cluster(cpus=120.0, gpus=14.0, nodes=2)
    assert executors.cluster_of({"CPU": 2.0}, [{"Alive": True}]) == Cluster(cpus=2.0, gpus=0.0, nodes=1)


@pytest.fixture
def fake_run(monkeypatch):
    """`dapo-flow run` with a fake Ray cluster to join and a fake execute: what it was asked to
    join, and the placed plan it would run."""
    seen: dict = {}

    def fake_joined_cluster(address: str) -> Cluster:
        seen["joined"] = address
        return executors.cluster_of(FAKE_AVAILABLE, FAKE_NODES)

    fake_runtime = types.ModuleType("dapo_flow.runtime")
    fake_runtime.execute = lambda placed, **kw: seen.update(placed=placed, address=kw["address"])
    monkeypatch.setattr(executors, "joined_cluster", fake_joined_cluster)
    monkeypatch.setitem(sys.modules, "dapo_flow.runtime", fake_runtime)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return seen


def test_run_with_an_address_places_the_graph_on_that_cluster(fake_run):
    assert cli.main(["run", DAPO, "--address", "10.0.0.1:6379"]) == 0
    placed = fake_run["placed"]
    assert fake_run["joined"] == fake_run["address"] == "10.0.0.1:6379"
    assert placed.cluster == Cluster(cpus=120.0, gpus=14.0, nodes=2)
    stage = placed.stage("model:policy")  # workers: auto -> a worker per free GPU of the cluster
    assert (stage.workers, stage.num_gpus, stage.strategy) == (14, 1.0, "ddp")


def test_ray_address_from_the_environment_is_joined_too(fake_run, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.2:6379")
    assert cli.main(["run", DAPO]) == 0
    assert fake_run["joined"] == "10.0.0.2:6379" and fake_run["placed"].cluster.gpus == 14.0


def test_without_an_address_or_on_the_local_executor_this_machine_is_placed_on(fake_run):
    assert cli.main(["run", DAPO, "--executor", "local", "--address", "10.0.0.1:6379"]) == 0
    assert "joined" not in fake_run and fake_run["placed"].cluster == Cluster.local()
    assert cli.main(["run", DAPO]) == 0
    assert "joined" not in fake_run


def test_a_cluster_that_cannot_be_joined_is_a_clear_error(monkeypatch, capsys):
    def fake_connect_ray(address):
        raise ConnectionError(f"Could not find any running Ray instance at {address}")

    monkeypatch.setattr(executors, "connect_ray", fake_connect_ray)
    with pytest.raises(RunError, match=r"could not join the Ray cluster at '10.0.0.9:6379': Could not find") as info:
        executors.joined_cluster("10.0.0.9:6379")
    assert "fix: start it (`ray start --head` on its head node)" in str(info.value)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert cli.main(["run", DAPO, "--address", "10.0.0.9:6379"]) == 2
    err = capsys.readouterr().err
    assert "could not join the Ray cluster" in err and "Traceback" not in err


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_real_ray_cluster_is_read_as_it_reports_itself():
    """Two simulated nodes (ray.cluster_utils), with GPUs declared as Ray resources: what
    joined_cluster reads from Ray itself, and the main job placed on it."""
    import ray
    from ray.cluster_utils import Cluster as RayCluster

    # the test process's shared cluster is stopped before an unmarked test (tests/conftest.py)
    assert not ray.is_initialized(), "a Ray of this process is up: an earlier test left it running"
    ray_cluster = RayCluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 2})
    ray_cluster.add_node(num_cpus=2, num_gpus=2)
    ray_cluster.wait_for_nodes()
    try:
        cluster = executors.joined_cluster(ray_cluster.address)
        assert cluster == Cluster(cpus=4.0, gpus=4.0, nodes=2)
        from dapo_flow.graph.compiler import compile_graph

        assert compile_graph(DAPO, cluster).stage("model:policy").workers == 4
    finally:
        ray.shutdown()
        ray_cluster.shutdown()


# --- the process group's backend --------------------------------------------------------------

GROUP_OF_ONE = """
import sys, torch
from dapo_flow.models import fsdp
from dapo_flow.core.ports import free_port
torch.cuda.is_available = lambda: True  # a GPU beside the model must not choose the backend
fsdp.init_group(0, 1, "127.0.0.1", free_port(), device=sys.argv[1])
import torch.distributed as dist
print(dist.get_backend())
"""


def test_a_group_training_on_cpu_uses_gloo_even_where_cuda_is_there():
    r = subprocess.run([sys.executable, "-c", GROUP_OF_ONE, "cpu"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[-1] == "gloo"


def test_a_device_without_a_backend_is_refused_before_joining():
    from dapo_flow.errors import ModelError
    from dapo_flow.models import fsdp

    assert fsdp.BACKEND_OF_DEVICE == {"cpu": "gloo", "cuda": "nccl"}
    with pytest.raises(ModelError, match="a training group trains on cpu, cuda, not on device 'meta'"):
        fsdp.init_group(0, 1, "127.0.0.1", 1, device="meta")
