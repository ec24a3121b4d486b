"""A graph on a mixture of two reasoning-gym tasks, end to end on the local executor: two steps
logging score and accuracy per task (training and validation), resumed to the run an unbroken
one gives, then evaluated per task."""

from __future__ import annotations

import dataclasses

import pytest

from dapo_flow.graph.compiler import compile_graph
from dapo_flow.graph.plan import Cluster
from dapo_flow.runtime import execute
from dapo_flow.tracking import read_run

SUM = "{min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 2}"
GRAPH = f"""\
name: gym-mix
seed: 0
models:
  policy: {{path: "{{model}}", backend: hf}}
data:
  train:
    sources:
      - {{source: "reasoning_gym:chain_sum", weight: 3, config: {SUM}, options: {{system_prompt: direct}}, size: 64}}
      - {{source: "reasoning_gym:lcm", weight: 1, config: {{max_value: 20}}, options: {{system_prompt: direct}}, size: 64}}
  val:
    sources:
      - {{source: "reasoning_gym:chain_sum", config: {SUM}, options: {{system_prompt: direct}}, size: 6}}
      - {{source: "reasoning_gym:lcm", config: {{max_value: 20}}, options: {{system_prompt: direct}}, size: 6}}
run: {{steps: {{steps}}, prompts_per_step: 4, val_every: 2, val_n: 1, checkpoint_every: 1}}
tracking: {{experiment: gym-tests}}
nodes:
  - {{id: rollout, op: generate, model: policy, inputs: [prompts], params: {{n: 2, max_tokens: 20}}}}
  - {{id: verify, op: score, inputs: [rollout], params: {{reward: "builtin:reasoning-gym", correct: 1.0, wrong: 0.0}}}}
  - {{id: old_logp, op: logprob, model: policy, inputs: [verify]}}
  - {{id: adv, op: advantage, inputs: [old_logp]}}
  - {{id: train, op: update, model: policy, inputs: [adv], params: {{lr: 1.0e-4}}}}
"""


@pytest.fixture(scope="module")
def short_tiny_gym(tmp_path_factory):
    """tiny-gym's recipe cut to a few steps: its tokenizer and shapes, not what it learns (evaluated
    on the 7 of the first 10 val items whose word no train item has)."""
    from dapo_flow.recipes import tiny_gym

    recipe = dataclasses.replace(tiny_gym.RECIPE, steps=4, batch_size=8, eval_items=10, eval_samples_per_prompt=1)
    return tiny_gym.build_tiny_gym(tmp_path_factory.mktemp("tiny-gym"), progress=False, recipe=recipe)


@pytest.mark.slow
def test_a_gym_mixture_trains_resumes_and_evaluates_per_task(workdir, short_tiny_gym):
    from dapo_flow.experiments.evaluate import evaluate

    path = workdir / "gym.yaml"
    path.write_text(GRAPH.replace("{model}", str(short_tiny_gym)).replace("{steps}", "2"))
    def det(history):  # what a resume must replay; the 1-step run also validated at its last step
        return {k: [(s, v) for s, v in points if not (k.startswith("val/") and s == 1)]
                for k, points in history.items() if not k.startswith(("time/", "perf/", "gen/"))}

    straight = execute(compile_graph(path, Cluster(cpus=2)), executor="local")
    hist = read_run(straight["tracking_uri"], straight["run_id"])["history"]
    for task in ("chain_sum", "lcm"):
        for key in (f"score/{task}/mean", f"acc/{task}/mean"):
            assert [s for s, _ in hist[key]] == [1, 2], key
        for key in (f"val/{task}/acc", f"val/{task}/score"):
            assert [s for s, _ in hist[key]] == [0, 2], key
    # validation's per-task accuracies average, weighted by their rows, to val/acc (6 items each
    # unless a repeat of a train item was dropped: then the weights are the rows kept)
    assert min(v for _, v in hist["val/acc"]) >= 0.0

    first = execute(compile_graph(path, Cluster(cpus=2)), executor="local", steps=1)
    resumed = execute(compile_graph(path, Cluster(cpus=2)), executor="local", resume=first["run_id"], steps=2)
    got = read_run(resumed["tracking_uri"], resumed["run_id"])["history"]
    assert det(got) == det(hist)

    result = evaluate(compile_graph(path, Cluster(cpus=2)), n=1)
    assert {"val/chain_sum/acc", "val/lcm/acc"} <= set(result["metrics"])
    assert result["metrics"]["val/acc"] == pytest.approx(hist["val/acc"][-1][1])
