"""Every graph in graphs/ runs on the GPU as `dapo-flow run GRAPH --executor local` runs it: a
few steps, the graph's own settings otherwise (its validation cut to a few prompts, a
checkpoint at the last step), each of its torch models on CUDA."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

from gpu_runs import GRAPHS, devices_of, history, run_graph

pytestmark = pytest.mark.gpu

STEPS = 2
#: graphs that cannot run here, and why (each still compiles in tests/test_graphs.py)
NOT_RUN = {"recipes/dapo-qwen2.5-7b.yaml": "the DAPO paper's recipe: a local Qwen2.5-7B directory and 16 GPUs"}
# graphs/ablations/ holds patch files (variants of these graphs, run by `dapo-flow sweep`)
RUN = sorted(p for p in GRAPHS.glob("**/*.yaml")
             if "ablations" not in p.parts and str(p.relative_to(GRAPHS)) not in NOT_RUN)


def test_every_graph_but_the_recipe_is_run_here():
    assert {p.name for p in RUN} >= {"dapo.yaml", "dapo-chat.yaml", "grpo.yaml", "ppo.yaml", "agent.yaml"}
    assert all((GRAPHS / name).is_file() for name in NOT_RUN)


def _flags(graph: Path, chat_model: str) -> list[tuple[str, str]]:
    """A few validation prompts, a checkpoint at the last step, and builtin:tiny-chat replaced by
    ``chat_model`` where that is not the built-in itself (a short build of its recipe, run
    without the graph's group-filter)."""
    flags = [("set", "data.val.size=8"), ("set", f"run.checkpoint_every={STEPS}")]
    spec = _spec(graph)
    short = [name for name, model in spec.models.items()
             if model.path == "builtin:tiny-chat" and chat_model != model.path]
    flags += [("set", f"models.{name}.path={chat_model}") for name in short]
    if short:  # a build of a few steps answers nothing right: every group's acc is flat and dynamic
        # sampling would keep none, so no update would run; without the filter every group trains
        flags += [("drop", node.id) for node in spec.nodes if node.op == "group-filter"]
    return flags


def _spec(graph: Path):
    from dapo_flow.graph.compiler import load, validate

    return validate(load(graph)).spec


@pytest.mark.parametrize("graph", RUN, ids=lambda p: str(p.relative_to(GRAPHS)))
def test_the_graph_runs_on_the_gpu(graph: Path, workdir, quiet, device, policies, builtin, chat_model):
    spec = _spec(graph)
    if any(m.backend == "vllm" for m in spec.models.values()) and importlib.util.find_spec("vllm") is None:
        pytest.skip("backend vllm: vLLM is not installed here")
    for model in spec.models.values():  # built before the run, not inside its timings
        if model.path.startswith("builtin:") and model.path != "builtin:tiny-chat":
            builtin(model.path.removeprefix("builtin:"))
    policies.clear()  # a build trains its model on the CPU: only the run's policies are judged

    summary, _ = run_graph(graph, _flags(graph, chat_model), steps=STEPS, console=quiet)

    assert summary["steps"] == STEPS
    assert policies and devices_of(policies) == {device.type}, [p.path for p in policies]
    assert summary["val_acc_start"] is not None and summary["val_acc_end"] is not None
    logged = history(summary)
    trained = [k for k in logged if k.startswith(("actor/", "critic/")) and k.endswith("loss")]
    assert trained, sorted(logged)
    for key in trained + ["actor/grad_norm"] * ("actor/grad_norm" in logged):
        assert all(math.isfinite(v) for _, v in logged[key]), (key, logged[key])
