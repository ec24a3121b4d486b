"""ReMax end to end: a second, greedy `generate` and its `score`, joined onto the samples by prompt
id in a `baseline` node (the one node whose inputs may carry different rows), estimator `remax`;
the join's run-time errors, the validate-time ones, a short run, and graphs/remax.yaml learning."""

from __future__ import annotations

import io
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from rich.console import Console

from dapo_flow.errors import GraphError, RunError
from dapo_flow.core import columns as C
from dapo_flow.graph.compiler import compile_graph
from dapo_flow.graph.explain import explain
from dapo_flow.graph.plan import Cluster
from dapo_flow.runtime import execute
from dapo_flow.tracking import read_run
from dapo_flow.operators.baseline import Baseline, Params
from figures import assert_learned, results_row

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = Cluster(cpus=2)

REMAX = """\
name: remax-small
models:
  policy: {{path: "builtin:tiny-adder"}}
data:
  train: {{source: "builtin:addition", split: train}}
  val: {{source: "builtin:addition", split: val, size: 8}}
run: {{steps: 2, prompts_per_step: 4, val_every: 0, checkpoint_every: 0}}
tracking: {{experiment: runtime-tests, log_samples: 0}}
nodes:
  - {{id: rollout, op: generate, model: policy, inputs: [prompts], params: {{n: 4, max_tokens: 8}}}}
  - {{id: verify, op: score, inputs: [rollout], params: {{correct: 1.0, wrong: 0.0}}}}
  - {{id: greedy, op: generate, model: policy, inputs: [prompts], params: {{n: 1, temperature: 0.0, max_tokens: 8}}}}
  - {{id: greedy_verify, op: score, inputs: [{greedy_scored}], params: {{correct: 1.0, wrong: 0.0}}}}
  - {{id: with_baseline, op: baseline, inputs: {baseline_inputs}}}
  - {{id: old_logp, op: logprob, model: policy, inputs: [{logp_input}], params: {{source: rollout}}}}
  - {{id: adv, op: advantage, inputs: [old_logp], params: {{estimator: remax}}}}
  - {{id: train, op: update, model: policy, inputs: [adv], params: {{lr: 1.0e-4}}}}
"""


def remax_graph(where: Path, *, baseline_inputs: str = "[verify, greedy_verify]", logp_input: str = "with_baseline",
                greedy_scored: str = "greedy") -> Path:
    path = where / "remax-small.yaml"
    path.write_text(REMAX.format(baseline_inputs=baseline_inputs, logp_input=logp_input, greedy_scored=greedy_scored))
    return path


def test_baseline_joins_by_prompt_id_not_by_row():
    samples = pa.table({C.PROMPT_ID: ["b", "a", "b", "a"], "x": [1, 2, 3, 4]})
    greedy = pa.table({C.PROMPT_ID: ["a", "b"], C.SCORE: pa.array([0.25, 1.0], pa.float32())})
    out = Baseline.combine(Params(), [samples, greedy])
    assert out.column(C.BASELINE).to_pylist() == [1.0, 0.25, 1.0, 0.25]
    assert out.column("x").to_pylist() == [1, 2, 3, 4] and out.num_rows == 4
    with pytest.raises(RunError, match=r"prompt 'a' has 2 baseline rows.*n: 1"):
        Baseline.combine(Params(), [samples, pa.concat_tables([greedy, greedy.slice(0, 1)])])
    with pytest.raises(RunError, match=r"prompt 'b' has no baseline row"):
        Baseline.combine(Params(), [samples, greedy.slice(0, 1)])


def _errors(path: Path) -> str:
    with pytest.raises(GraphError) as err:
        compile_graph(path, CLUSTER)
    return str(err.value)


def test_bad_remax_wiring_is_a_validate_time_error(workdir):
    text = _errors(remax_graph(workdir, logp_input="verify"))  # remax without a baseline
    assert re.search(r"node 'adv' inputs: requires column 'baseline' \(float\) but no upstream node produces it"
                     r".*op 'baseline'", text, re.S)
    text = _errors(remax_graph(workdir, baseline_inputs="[verify]"))
    assert "op 'baseline' takes 2 inputs, got 1" in text and "one scored row per prompt" in text
    text = _errors(remax_graph(workdir, greedy_scored="rollout", baseline_inputs="[verify, greedy]"))
    assert "input 'greedy' lacks column 'score' (float)" in text and "op 'score'" in text


def test_a_remax_graph_runs(workdir):
    placed = compile_graph(remax_graph(workdir), CLUSTER)
    assert "adds     baseline:float" in explain(placed)
    summary = execute(placed, executor="local", console=Console(file=io.StringIO()))
    history = read_run(summary["tracking_uri"], summary["run_id"])["history"]
    assert [s for s, _ in history["baseline/mean"]] == [1, 2]
    assert all(0.0 <= v <= 1.0 for _, v in history["baseline/mean"])
    assert all(np.isfinite(v) for _, v in history["actor/grad_norm"])


@pytest.mark.shared_ray
@pytest.mark.figures
@pytest.mark.slow
@pytest.mark.models("tiny-chat")
@pytest.mark.timeout(2400)  # a fresh machine first builds tiny-chat (~2-5 min of one core), then ~3-7 min
def test_the_remax_graph_learns(workdir):
    """graphs/remax.yaml on Ray (tiny-chat on the chain task) raises val acc as docs/results.md says."""
    summary = execute(compile_graph(ROOT / "graphs" / "remax.yaml", CLUSTER), executor="ray",
                      console=Console(file=io.StringIO()))
    assert_learned(summary, results_row("remax"), "graphs/remax.yaml val acc start -> end")
