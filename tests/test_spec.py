"""GraphSpec: what a YAML graph is, field by field."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest

from dapo_flow.graph.loader import load
from dapo_flow.graph.spec import GraphSpec, ModelSpec, NodeSpec, RunSpec, TrainSpec

ROOT = Path(__file__).resolve().parents[1]

MINIMAL = {
    "name": "tiny",
    "models": {"policy": {"path": "builtin:tiny-adder"}},
    "data": {"train": {"source": "builtin:addition"}},
    "nodes": [{"id": "rollout", "op": "generate", "model": "policy", "inputs": ["prompts"]}],
}


def test_round_trip_minimal():
    spec = GraphSpec.model_validate(MINIMAL)
    again = GraphSpec.model_validate(spec.model_dump())
    assert again == spec
    assert spec.run == RunSpec()  # defaults live in the spec classes only
    assert spec.placement.mode == "colocated"


def test_round_trip_dapo_graph():
    spec = GraphSpec.model_validate(load(ROOT / "graphs" / "dapo.yaml").raw)
    assert GraphSpec.model_validate(spec.model_dump()) == spec
    assert GraphSpec.model_validate_json(spec.model_dump_json()) == spec
    assert [n.id for n in spec.nodes][:2] == ["rollout", "verify"]


def test_frozen():
    spec = GraphSpec.model_validate(MINIMAL)
    with pytest.raises(pydantic.ValidationError):
        spec.name = "other"
    with pytest.raises(pydantic.ValidationError):
        spec.nodes[0].op = "score"


@pytest.mark.parametrize(
    "cls, data",
    [
        (GraphSpec, {**MINIMAL, "trainer": {}}),
        (ModelSpec, {"path": "x", "dtpye": "float32"}),
        (NodeSpec, {"id": "a", "op": "score", "param": {}}),
        (RunSpec, {"stepz": 3}),
    ],
)
def test_extra_forbidden(cls, data):
    with pytest.raises(pydantic.ValidationError, match="Extra inputs are not permitted"):
        cls.model_validate(data)


def test_node_id_pattern():
    with pytest.raises(pydantic.ValidationError, match="pattern"):
        NodeSpec.model_validate({"id": "has space", "op": "score"})


def test_auto_batch_size_from_keep_rate():
    from dapo_flow.runtime.loop import auto_batch_size

    assert auto_batch_size(24, None, 24) == 24  # nothing seen yet: one step's worth
    assert auto_batch_size(24, 0.5, 24) == 56  # ceil(24 * 1.15 / 0.5)
    assert auto_batch_size(3, 0.9, 24) == 4
    assert auto_batch_size(24, 0.0, 24) == 8 * 24  # all filtered so far: capped, not unbounded


@pytest.mark.parametrize("value, ok", [("auto", True), (48, True), (None, True), (0, False), ("twice", False)])
def test_gen_prompts_per_batch_accepts_auto(value, ok):
    from pydantic import ValidationError

    from dapo_flow.graph.spec import RunSpec

    if ok:
        assert RunSpec(gen_prompts_per_batch=value).gen_prompts_per_batch == value
    else:
        with pytest.raises(ValidationError):
            RunSpec(gen_prompts_per_batch=value)


def test_seed_is_bounded_to_what_every_library_accepts():
    # a 65-bit seed passed validate, then failed inside torch.manual_seed in a worker
    from dapo_flow.graph.spec import MAX_SEED

    assert MAX_SEED == 2**32 - 1
    assert GraphSpec.model_validate({**MINIMAL, "seed": MAX_SEED}).seed == MAX_SEED
    for seed in (MAX_SEED + 1, 2**64, -1):
        with pytest.raises(pydantic.ValidationError, match="seed"):
            GraphSpec.model_validate({**MINIMAL, "seed": seed})


def test_rollout_settings_need_a_backend_that_takes_them(tmp_path):
    from pydantic import ValidationError

    from dapo_flow.graph.spec import ModelSpec

    assert ModelSpec(path="x", backend="vllm", rollout={"gpu_memory_utilization": 0.9}).rollout.gpu_memory_utilization == 0.9
    with pytest.raises(ValidationError, match=r"rollout.tensor_parallel is a setting of the rollout engine, "
                                              r"which backend 'hf' does not take \(it generates with the torch policy\)"):
        ModelSpec(path="x", backend="hf", rollout={"tensor_parallel": 2})


def test_tensor_parallel_must_divide_the_attention_heads(tmp_path):
    from pydantic import ValidationError

    from dapo_flow.graph.spec import ModelSpec

    (tmp_path / "config.json").write_text('{"num_attention_heads": 12}')
    assert ModelSpec(path=str(tmp_path), backend="vllm", rollout={"tensor_parallel": 4}).rollout.tensor_parallel == 4
    with pytest.raises(ValidationError, match=r"tensor_parallel 5 does not divide the model's 12 attention heads: "
                                              r"use one of \[1, 2, 3, 4, 6, 12\]"):
        ModelSpec(path=str(tmp_path), backend="vllm", rollout={"tensor_parallel": 5})


def test_a_bad_rollout_setting_is_a_graph_error_with_its_line(tmp_path, capsys):
    from dapo_flow import cli

    original = (ROOT / "graphs" / "dapo.yaml").read_text()
    graph = original.replace('    backend: hf\n', '    backend: hf\n    rollout: {kv_cache_gib: 2}\n')
    assert graph != original
    path = tmp_path / "g.yaml"
    path.write_text(graph)
    assert cli.main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    line = graph.splitlines().index("  policy:") + 1
    assert f"{path}:{line}: models.policy" in err and "rollout.kv_cache_gib is a setting of the rollout engine" in err


@pytest.mark.parametrize("train, dtype", [
    ({"mixed_precision": "bf16"}, "float32"),  # one worker: torch.autocast over float32 state
    ({"mixed_precision": "bf16", "workers": 2, "strategy": "ddp"}, "float32"),
    ({"mixed_precision": "bf16", "strategy": "ddp"}, "float32"),  # ddp of one: a plain worker
    ({"mixed_precision": "bf16", "workers": 2}, "float32"),  # fsdp2
    # any dtype: the trained copy holds float32 master weights whatever it; dtype is the others'
    ({"mixed_precision": "bf16"}, "bfloat16"),
    ({"mixed_precision": "bf16", "strategy": "none"}, "float16"),
    ({"mixed_precision": "bf16", "workers": 2, "strategy": "ddp"}, "bfloat16"),
    ({"mixed_precision": "bf16", "strategy": "fsdp2"}, "bfloat16"),
])
def test_mixed_precision_is_accepted_with_every_strategy_and_dtype(train, dtype):
    spec = ModelSpec(path="builtin:tiny-adder", dtype=dtype, train=train)
    assert spec.train.mixed_precision == "bf16" and spec.dtype == dtype


def test_cpu_offload_stays_an_fsdp2_setting():
    with pytest.raises(pydantic.ValidationError, match="cpu_offload is an FSDP2 setting"):
        ModelSpec(path="builtin:tiny-adder", train={"cpu_offload": True, "workers": 2, "strategy": "ddp"})
    assert ModelSpec(path="builtin:tiny-adder", train={"cpu_offload": True, "strategy": "fsdp2"}).train.cpu_offload


def test_routing_replay_needs_experts_and_the_hf_backend(tmp_path):
    from pydantic import ValidationError

    from dapo_flow.graph.spec import ModelSpec

    assert ModelSpec(path="builtin:tiny-moe", train={"routing_replay": True}).train.routing_replay
    with pytest.raises(ValidationError, match=r"train.routing_replay needs a mixture-of-experts model, but "
                                              r"builtin:tiny-adder \(llama\) has no experts"):
        ModelSpec(path="builtin:tiny-adder", train={"routing_replay": True})
    (tmp_path / "config.json").write_text('{"num_attention_heads": 4, "num_experts": 8}')
    # the refusal says what this installation lacks (tests/models/test_vllm_routes.py: each case)
    with pytest.raises(ValidationError) as refused:
        ModelSpec(path=str(tmp_path), backend="vllm", train={"routing_replay": True})
    from dapo_flow.models.vllm_routes import routes_unrecorded

    assert (f"train.routing_replay is not supported with the vllm backend ({routes_unrecorded()}): "
            "use backend: hf") in str(refused.value)
    with pytest.raises(ValidationError, match=r"routing_replay does not work with train.grad_checkpointing"):
        ModelSpec(path="builtin:tiny-moe", train={"routing_replay": True, "grad_checkpointing": True})
    with pytest.raises(ValidationError, match=r"routing_replay does not work with train.sequence_parallel"):
        ModelSpec(path="builtin:tiny-moe", train={"routing_replay": True, "sequence_parallel": 2, "workers": 2})


def test_routing_replay_on_a_dense_model_is_a_validate_error(tmp_path, capsys):
    from dapo_flow import cli

    graph = (ROOT / "graphs" / "dapo.yaml").read_text()
    block = "train: {workers: auto, strategy: ddp}"
    assert block in graph and "builtin:tiny-adder" in graph
    path = tmp_path / "g.yaml"
    path.write_text(graph.replace(block, "train: {workers: auto, strategy: ddp, routing_replay: true}"))
    assert cli.main(["validate", str(path)]) != 0
    out = capsys.readouterr()
    assert "routing_replay needs a mixture-of-experts model" in out.err + out.out


def test_expert_parallelism_is_refused_saying_what_runs_instead():
    with pytest.raises(pydantic.ValidationError, match=r"expert parallelism is not built; every worker runs every expert "
                                              r"on its own rows, and strategy fsdp2 .* remove expert_parallel"):
        TrainSpec(workers=2, expert_parallel=2)
    assert TrainSpec(workers=2, expert_parallel=1).expert_parallel == 1
