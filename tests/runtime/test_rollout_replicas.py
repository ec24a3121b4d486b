"""Rollout replicas (models.X.rollout.replicas with disaggregated placement): a generate call's
prompts are split across R engines and merged in prompt order, and per-prompt seeds make the
samples the same for any R. Placement and executor errors for replicas are clear."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from dapo_flow.errors import GraphError, RunError
from dapo_flow.graph.edits import edit_file, parse_cli_edits
from dapo_flow.graph.plan import Cluster
from dapo_flow.runtime.executors import LocalExecutor, RayExecutor
from dapo_flow.runtime.setup import stage_setups

STAGE = "rollout:policy"


def _graph(tmp_path: Path, small_graph) -> Path:
    path = small_graph(tmp_path, name="replicas")
    path.write_text(path.read_text() + "placement: {mode: disaggregated}\n")
    return path


def _placed(path: Path, replicas: int):
    return edit_file(path, parse_cli_edits([("set", f"models.policy.rollout.replicas={replicas}")])).compile(
        Cluster(cpus=4))


def _prompts(tokenizer, count: int) -> pa.Table:
    texts = [f"{a}+{b}=" for a, b in zip(range(3, 3 + count), range(40, 40 + 3 * count, 3))]
    return pa.table({"prompt_id": [f"p{i}" for i in range(count)], "prompt_text": texts,
                     "prompt_ids": pa.array([tokenizer(t)["input_ids"] for t in texts], pa.list_(pa.int32())),
                     "ground_truth": ["0"] * count, "data_source": ["addition"] * count})


def test_replicas_need_their_own_rollout_stage(tmp_path, small_graph):
    colocated = small_graph(tmp_path, name="colocated")
    with pytest.raises(GraphError) as info:
        edit_file(colocated, parse_cli_edits([("set", "models.policy.rollout.replicas=2")])).compile(Cluster(cpus=4))
    assert "models.policy.rollout.replicas" in str(info.value) and "disaggregated" in str(info.value)
    placed = _placed(_graph(tmp_path, small_graph), 2)
    assert placed.stage(STAGE).workers == 2 and not placed.stage(STAGE).is_group
    from dapo_flow.graph.explain import explain

    assert "2 replicas (resources above are per replica)" in explain(placed)
    with pytest.raises(RunError, match="rollout.replicas: 1"):
        LocalExecutor(placed.plan.spec, {STAGE: stage_setups(placed)[STAGE]}, seed=0)


@pytest.mark.slow
def test_two_replicas_sample_what_one_engine_samples(tmp_path, small_graph, tiny_adder_path):
    import ray
    from transformers import AutoTokenizer

    prompts = _prompts(AutoTokenizer.from_pretrained(tiny_adder_path), 9)
    path = _graph(tmp_path, small_graph)
    outs = {}
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="ERROR",
             configure_logging=True)
    try:
        for replicas in (1, 2):
            placed = _placed(path, replicas)
            setup = stage_setups(placed)[STAGE]
            ex = RayExecutor(placed.plan.spec, {STAGE: setup}, seed=0, resources={STAGE: (1.0, 0.0)})
            try:
                outs[replicas] = [ex.get(ex.call(STAGE, "run_chain", ["rollout"], prompts))[0] for _ in range(2)]
                if replicas == 2:
                    assert len(ex.groups[STAGE].members) == 2
                    assert ex.get(ex.call(STAGE, "op_states"))["rollout"]["calls"] == 2  # every replica counts calls
            finally:
                ex.shutdown()
    finally:
        ray.shutdown()
    for one, two in zip(outs[1], outs[2]):  # two calls: the second draws new samples alike
        assert one.column("prompt_id").to_pylist() == two.column("prompt_id").to_pylist()  # prompt order
        assert one.column("response_ids").to_pylist() == two.column("response_ids").to_pylist()
        for a, b in zip(one.column("rollout_logp").to_pylist(), two.column("rollout_logp").to_pylist()):
            np.testing.assert_allclose(a, b, atol=1e-5)
    assert outs[1][0].column("response_ids").to_pylist() != outs[1][1].column("response_ids").to_pylist()


@pytest.mark.shared_ray
@pytest.mark.slow
def test_a_training_group_syncs_weights_into_every_replica(workdir, small_graph):
    """Disaggregated: 2 FSDP2 workers train, 2 replicas roll out; each step's weights reach both."""
    from rich.console import Console

    from dapo_flow.runtime import execute
    from dapo_flow.tracking import read_run

    path = small_graph(workdir, name="both", steps=2, ckpt=2)
    # the rollout logprobs against the trainer's recomputation: at step 2 they agree only if the
    # broadcast sync brought the group's updated weights to both replicas
    check = Path(__file__).with_name("logp_agreement.py")
    adv = "{id: adv, op: advantage, inputs: [old_logp]}"
    text = path.read_text().replace(adv, f"{{id: check, op: custom, impl: '{check}:CheckLogp', inputs: [old_logp]}}\n"
                                         "  - {id: adv, op: advantage, inputs: [check]}")
    path.write_text(text + "placement: {mode: disaggregated}\n")
    placed = edit_file(path, parse_cli_edits([("set", "models.policy.rollout.replicas=2"),
                                              ("set", "models.policy.train.workers=2")])).compile(Cluster(cpus=2))
    log = Console(file=open(workdir / "log.txt", "w"), width=200)
    summary = execute(placed, executor="ray", console=log)
    text = (workdir / "log.txt").read_text()
    assert "rollout replicas of stage 'rollout:policy': 2 worker(s)" in text
    assert "training group of stage 'model:policy': 2 worker(s)" in text
    history = read_run(summary["tracking_uri"], summary["run_id"])["history"]
    assert [s for s, _ in history["time/weight_sync"]] == [1, 2]
    assert [s for s, _ in history["actor/pg_loss"]] == [1, 2]
    assert max(v for _, v in history["check/logp_max_abs_diff"]) < 1e-4, history["check/logp_max_abs_diff"]
