"""Placement sized to the devices a run gets (dapo_flow.graph.sizing): `workers: auto` on 0, 1
and 4 GPUs and what `explain` says of it, GPUs shared by the actors when there are fewer GPUs than
actors, and the refusals (with their fixes) where sharing would put two ranks of one process
group on one device or leave a model without a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from dapo_flow.errors import GraphError
from dapo_flow.graph.compiler import compile_graph
from dapo_flow.graph.explain import explain
from dapo_flow.graph.edits import edit_file, parse_cli_edits
from dapo_flow.graph.plan import Cluster
from dapo_flow.graph.sizing import CPU_WORKERS

ROOT = Path(__file__).resolve().parents[1]
DAPO = ROOT / "graphs" / "dapo.yaml"
PPO = ROOT / "graphs" / "ppo.yaml"
# every runnable graph shipped (graphs/ablations/ holds patch files; graphs/recipes/ full-scale
# recipes sized for a cluster)
SHIPPED = sorted(p for p in (ROOT / "graphs").glob("*.yaml"))

CPU_BOX = Cluster(cpus=2)
ONE_GPU = Cluster(cpus=16, gpus=1)
FOUR_GPUS = Cluster(cpus=64, gpus=4)


def _placed(path: Path, *sets: str, cluster: Cluster):
    return edit_file(path, parse_cli_edits([("set", s) for s in sets])).compile(cluster)


def _stage(placed, name: str):
    return placed.stage(name)


# --- workers: auto --------------------------------------------------------------------------


def test_the_main_job_is_sized_auto():
    assert "train: {workers: auto, strategy: ddp}" in DAPO.read_text()


@pytest.mark.parametrize("cluster, workers, strategy, gpus, why", [
    (CPU_BOX, CPU_WORKERS, "ddp", 0.0, f"workers: auto -> 2 (no GPU: {CPU_WORKERS} CPU workers"),
    (ONE_GPU, 1, "none", 1.0, "workers: auto -> 1 (1 GPU free)"),
    (FOUR_GPUS, 4, "ddp", 1.0, "workers: auto -> 4 (4 GPUs free)"),
], ids=["0-gpus", "1-gpu", "4-gpus"])
def test_auto_follows_the_gpus_and_explain_says_why(cluster, workers, strategy, gpus, why):
    placed = compile_graph(DAPO, cluster)
    stage = placed.stage("model:policy")
    assert (stage.workers, stage.strategy, stage.num_gpus) == (workers, strategy, gpus)
    assert stage.is_group == (workers > 1)
    assert placed.plan.spec.models["policy"].train.workers == workers  # the placed spec holds the size
    text = explain(placed)
    assert why in text
    # the note sits under its stage's line
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("  model:policy "))
    assert lines[at + 1].strip().startswith("workers: auto ->")


def test_on_cpu_auto_places_what_two_workers_placed():
    """The README's figures come from the main job's CPU run: auto must place it as the
    `workers: 2` it replaced, to the CPU share of every stage."""
    auto = compile_graph(DAPO, CPU_BOX)
    two = _placed(DAPO, "models.policy.train.workers=2", cluster=CPU_BOX)
    assert [(s.name, s.num_cpus, s.num_gpus, s.workers, s.strategy, s.nodes) for s in auto.stages] == [
        (s.name, s.num_cpus, s.num_gpus, s.workers, s.strategy, s.nodes) for s in two.stages]
    assert auto.calls == two.calls and auto.plan.spec == two.plan.spec


def test_auto_without_a_strategy_shards_a_group_and_not_one_worker():
    many = _placed(DAPO, "models.policy.train.strategy=null", cluster=FOUR_GPUS)
    assert (many.stage("model:policy").workers, many.stage("model:policy").strategy) == (4, "fsdp2")
    one = _placed(DAPO, "models.policy.train.strategy=null", cluster=ONE_GPU)
    assert (one.stage("model:policy").workers, one.stage("model:policy").strategy) == (1, "none")


def test_auto_keeps_a_gpu_for_each_other_actor():
    placed = _placed(PPO, "models.policy.train.workers=auto", cluster=FOUR_GPUS)
    assert placed.stage("model:policy").workers == 3 and placed.stage("model:critic").num_gpus == 1.0
    assert "workers: auto -> 3 (4 GPUs free, 1 GPU kept for the other actors)" in explain(placed)
    two = _placed(PPO, "models.policy.train.workers=auto", "models.critic.train.workers=auto", cluster=FOUR_GPUS)
    assert two.stage("model:policy").workers == two.stage("model:critic").workers == 2
    assert "split between the 2 groups set to auto" in explain(two)


def test_auto_on_a_model_kept_on_cpu_is_the_cpu_size():
    placed = _placed(DAPO, "models.policy.device=cpu", cluster=FOUR_GPUS)
    stage = placed.stage("model:policy")
    assert (stage.workers, stage.num_gpus) == (CPU_WORKERS, 0.0)
    assert "workers: auto -> 2 (device: cpu: 2 CPU workers" in explain(placed)


def test_auto_with_placement_resources_divides_the_gpus_by_each_workers_ask():
    placed = _placed(DAPO, "placement.models.policy.num_gpus=2", cluster=Cluster(cpus=64, gpus=8))
    assert (placed.stage("model:policy").workers, placed.stage("model:policy").num_gpus) == (4, 2.0)
    assert "2 GPUs per worker (placement.models.policy.num_gpus)" in explain(placed)
    share = _placed(DAPO, "placement.models.policy.num_gpus=0.5", cluster=Cluster(cpus=64, gpus=8))
    assert share.stage("model:policy").workers == 1  # two ranks never share a device
    assert "is a share of a GPU" in explain(share)


def test_a_number_is_kept_as_written():
    placed = _placed(DAPO, "models.policy.train.workers=3", cluster=FOUR_GPUS)
    assert placed.stage("model:policy").workers == 3
    assert "workers: auto" not in explain(placed)


@pytest.mark.parametrize("value, got", [("0", "0"), ("many", "'many'"), ("true", "True"), ("4097", "4097")])
def test_bad_workers_names_what_it_takes(value: str, got: str):
    with pytest.raises(GraphError) as info:
        _placed(DAPO, f"models.policy.train.workers={value}", cluster=CPU_BOX)
    assert ("models.policy.train.workers: must be a number of workers from 1 to 4096, or `auto` (sized from "
            f"the devices the run gets) (got {got})") in str(info.value)


def test_strategy_none_takes_one_worker_not_auto():
    with pytest.raises(GraphError, match="strategy none trains one unsharded copy, but workers is auto"):
        _placed(DAPO, "models.policy.train.strategy=none", cluster=CPU_BOX)


def test_cpu_offload_with_auto_needs_fsdp2_written():
    with pytest.raises(GraphError, match="cpu_offload is an FSDP2 setting"):
        _placed(DAPO, "models.policy.train.strategy=null", "models.policy.train.cpu_offload=true", cluster=CPU_BOX)
    placed = _placed(DAPO, "models.policy.train.strategy=fsdp2", "models.policy.train.cpu_offload=true",
                     cluster=ONE_GPU)
    assert (placed.stage("model:policy").workers, placed.stage("model:policy").strategy) == (1, "fsdp2")


# --- fewer GPUs than actors -----------------------------------------------------------------


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_every_shipped_graph_places_on_one_gpu_with_every_model_on_it(path: Path):
    placed = compile_graph(path, ONE_GPU)
    actors = [s for s in placed.stages if s.kind == "actor"]
    assert actors and all(0 < s.num_gpus <= 1 for s in actors), [(s.name, s.num_gpus) for s in actors]
    assert all(not s.is_group or s.workers == 1 for s in actors)  # no two ranks on the one device
    assert sum(s.num_gpus * s.workers for s in actors) <= 1


def test_two_actors_on_one_gpu_share_it_and_explain_says_so():
    placed = compile_graph(PPO, ONE_GPU)
    assert placed.stage("model:policy").num_gpus == placed.stage("model:critic").num_gpus == 0.5
    assert ("gpus=0.5: 2 actors without placement.models resources share 1 GPU, fewer than one each"
            in explain(placed))


def test_a_disaggregated_rollout_shares_the_gpu_with_its_trainer():
    placed = _placed(DAPO, "placement.mode=disaggregated", cluster=ONE_GPU)
    assert placed.stage("rollout:policy").num_gpus == placed.stage("model:policy").num_gpus == 0.5


def test_shares_fit_one_device_each():
    """Three actors on two GPUs: 1/2 each (two to a GPU), never 2/3 (no GPU holds two of those)."""
    placed = _placed(PPO, "placement.mode=disaggregated", cluster=Cluster(cpus=16, gpus=2))
    assert {s.num_gpus for s in placed.stages if s.kind == "actor"} == {0.5}


def test_a_groups_workers_keep_whole_gpus_and_the_others_share_what_is_left():
    placed = _placed(PPO, "models.policy.train.workers=2", "placement.mode=disaggregated",
                     "models.policy.rollout.replicas=2", cluster=Cluster(cpus=16, gpus=3))
    assert placed.stage("model:policy").num_gpus == 1.0  # per worker, 2 workers
    assert placed.stage("rollout:policy").num_gpus == placed.stage("model:critic").num_gpus == pytest.approx(1 / 3)
    assert "share the 1 GPU left beside the training groups' own" in explain(placed)


def test_a_group_with_more_workers_than_gpus_is_refused_with_the_fix():
    with pytest.raises(GraphError) as info:
        _placed(DAPO, "models.policy.train.workers=2", cluster=ONE_GPU)
    text = str(info.value)
    assert "models.policy.train.workers: the training group of 'policy' has 2 workers, each needing a GPU of " \
           "its own (two ranks of one process group never share a device), but 1 GPU of the cluster's 1" in text
    assert "fix: set models.policy.train.workers: auto (a worker per free GPU) or at most 1" in text
    assert "num_gpus" not in text  # never a share of a GPU per worker


def test_nothing_left_for_the_other_actors_is_refused_with_the_fix():
    with pytest.raises(GraphError) as info:
        _placed(PPO, "models.policy.train.workers=2", cluster=Cluster(cpus=16, gpus=2))
    text = str(info.value)
    assert ("models.critic: stage 'model:critic' wants a GPU or a share of one, but the training group(s) of "
            "'policy' take all 2 GPUs free: nothing is left to share") in text
    assert "models.critic.device: cpu" in text


def test_a_model_kept_on_cpu_takes_no_share():
    placed = _placed(PPO, "models.critic.device=cpu", cluster=ONE_GPU)
    assert (placed.stage("model:policy").num_gpus, placed.stage("model:critic").num_gpus) == (1.0, 0.0)


def test_a_share_of_a_gpu_per_group_worker_is_refused():
    with pytest.raises(GraphError) as info:
        _placed(DAPO, "models.policy.train.workers=2", "placement.models.policy.num_gpus=0.5", cluster=ONE_GPU)
    text = str(info.value)
    assert "placement.models.policy.num_gpus: each of the 2 training workers of 'policy' asks for 0.5 of a GPU" in text
    assert "NCCL refuses it" in text and "fix: ask for num_gpus: 1 (or more) per worker" in text


def test_the_weight_bus_uses_nccl_only_between_whole_gpus():
    from dapo_flow.graph.plan import Stage
    from dapo_flow.runtime.weight_sync import bus_backend

    def stage(gpus: float) -> Stage:
        return Stage("s", "actor", (), (), 1.0, gpus)

    assert bus_backend(stage(1.0), stage(1.0)) == "nccl"
    assert bus_backend(stage(0.5), stage(0.5)) == "gloo"  # may be one device
    assert bus_backend(stage(1.0), stage(0.0)) == bus_backend(stage(0.0), stage(0.0)) == "gloo"
