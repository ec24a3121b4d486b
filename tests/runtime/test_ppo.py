"""PPO with a critic end to end: a value model in `models:`, a `values` node, estimator `gae`
(advantages and the critic's returns), a `critic-update`; the critic gets its own actor, no weight
sync, and is checkpointed and resumed like the policy (an interrupted run replays exactly); the
bad combinations are validate-time errors; graphs/ppo.yaml learns."""

from __future__ import annotations

import io
import json
import math
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from rich.console import Console

from dapo_flow import algos
from dapo_flow.errors import GraphError
from dapo_flow.core import columns as C
from dapo_flow.graph.compiler import compile_graph
from dapo_flow.graph.explain import explain
from dapo_flow.core.contract import OpContext
from dapo_flow.graph.plan import Cluster
from dapo_flow.runtime import checkpoint, execute
from dapo_flow.runtime.loop import Runner
from dapo_flow.runtime.resume import checkpoint_root
from dapo_flow.tracking import read_run
from figures import assert_learned, results_row
from dapo_flow.operators.advantage import Advantage, Params as AdvantageParams

pytestmark = pytest.mark.models("tiny-adder-critic")

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = Cluster(cpus=2)

PPO = """\
name: {name}
seed: 0
models:
  policy: {{path: "builtin:tiny-adder"}}
  critic: {{path: "{critic}"{head}}}
data:
  train: {{source: "builtin:addition", split: train}}
  val: {{source: "builtin:addition", split: val, size: 16}}
run: {{steps: {steps}, prompts_per_step: 4, val_every: 2, checkpoint_every: {ckpt}}}
tracking: {{experiment: runtime-tests, log_samples: 0}}
nodes:
  - {{id: rollout, op: generate, model: policy, inputs: [prompts], params: {{n: 2, max_tokens: 8}}}}
  - {{id: verify, op: score, inputs: [rollout], params: {{correct: 1.0, wrong: 0.0}}}}
  - {{id: old_logp, op: logprob, model: policy, inputs: [verify], params: {{source: rollout}}}}
  - {{id: values, op: values, model: {values_model}, inputs: [old_logp]}}
  - {{id: adv, op: advantage, inputs: [{adv_input}], params: {{estimator: gae, lam: 0.95}}}}
  - {{id: critic_train, op: critic-update, model: {critic_model}, inputs: [adv], params: {{lr: 1.0e-3, mini_batches: 2}}}}
  - {{id: train, op: update, model: policy, inputs: [adv], params: {{lr: 1.0e-4, critic_warmup: 1}}}}
"""


def ppo_graph(where: Path, *, name: str = "ppo-small", steps: int = 4, ckpt: int = 2,
              critic: str = "builtin:tiny-adder-critic", head: str | None = None, values_model: str = "critic",
              critic_model: str = "critic", adv_input: str = "values") -> Path:
    path = where / f"{name}.yaml"
    path.write_text(PPO.format(name=name, steps=steps, ckpt=ckpt, critic=critic,
                               head=f", head: {head}" if head else "", values_model=values_model,
                               critic_model=critic_model, adv_input=adv_input))
    return path


def _quiet() -> Console:
    return Console(file=io.StringIO(), width=400)


def _deterministic(history: dict) -> dict:
    return {k: v for k, v in history.items()
            if not k.startswith(("time/", "perf/")) and k not in ("gen/seconds", "gen/tokens_per_s")}


def test_the_critic_is_its_own_trained_model_with_no_weight_sync(workdir):
    placed = compile_graph(ppo_graph(workdir), CLUSTER)
    stage = placed.stage(placed.node_stage["critic_train"])
    assert stage.models == ("critic",) and placed.node_stage["values"] == stage.name
    assert placed.plan.trained_models == ("critic", "policy")
    assert placed.syncs == ()  # the policy samples where it trains (colocated), the critic never does
    text = explain(placed)
    assert "adds     token_advantage:list<float>, returns:list<float>" in text
    assert "emits    critic/vf_loss:float" in text
    assert placed.plan.node("train").params.advantage_column == "token_advantage"


def test_ppo_trains_the_critic_and_resumes_it_exactly(workdir):
    """4 steps straight vs. killed after step 2 and resumed from its checkpoint: the same
    histories, critic metrics included (its weights, AdamW state and counters came back)."""
    straight = execute(compile_graph(ppo_graph(workdir, name="ppo-straight"), CLUSTER), executor="local",
                       console=_quiet())
    history = read_run(straight["tracking_uri"], straight["run_id"])["history"]
    assert [s for s, _ in history["critic/vf_loss"]] == [1, 2, 3, 4]
    assert all(math.isfinite(v) for _, v in history["critic/grad_norm"])
    assert history["critic/values_mean"][0][1] == 0.0  # the zero head: V = 0 before any update
    assert history["critic/values_mean"][-1][1] != 0.0  # ... which the critic update moved
    assert history["actor/grad_norm"][0][1] == 0.0  # critic_warmup 1: the policy waits a step
    assert history["actor/grad_norm"][1][1] > 0.0

    placed = compile_graph(ppo_graph(workdir, name="ppo-killed"), CLUSTER)
    collect = Runner.collect

    class Crash(BaseException):
        pass

    def collect_or_die(self, state):
        if state.step == 2:
            raise Crash()
        return collect(self, state)

    with pytest.MonkeyPatch.context() as mp, pytest.raises(Crash):
        mp.setattr(Runner, "collect", collect_or_die)
        execute(placed, executor="local", console=_quiet())
    [run_folder] = checkpoint_root(placed.plan.spec).iterdir()
    saved = checkpoint.step_dir(run_folder, 2) / "models" / "critic"
    assert json.loads((saved / "config.json").read_text())["architectures"] == ["LlamaForTokenClassification"]
    resumed = execute(placed, executor="local", resume=True, console=_quiet())
    again = read_run(resumed["tracking_uri"], resumed["run_id"])["history"]
    assert _deterministic(again) == _deterministic(history)


def _errors(path: Path) -> str:
    with pytest.raises(GraphError) as err:
        compile_graph(path, CLUSTER)
    return str(err.value)


def test_bad_critic_combinations_are_validate_time_errors(workdir, capsys):
    text = _errors(ppo_graph(workdir, critic_model="policy"))
    assert "op 'critic-update' needs a value model (a critic: one value per token), but model 'policy' is a " \
           "causal LM" in text and "head: value" in text
    text = _errors(ppo_graph(workdir, values_model="policy"))
    assert "op 'values' needs a value model" in text
    text = _errors(ppo_graph(workdir, adv_input="old_logp"))  # gae without a values column
    assert re.search(r"requires column 'values' \(list<float>\) but no upstream node produces it.*op 'values'", text, re.S)
    # the critic named where a causal LM is needed
    bad = ppo_graph(workdir)
    bad.write_text(bad.read_text().replace("op: generate, model: policy", "op: generate, model: critic"))
    assert "op 'generate' needs a causal LM (it generates and gives token logprobs), but model 'critic' is a " \
           "value model" in _errors(bad)
    # and from the CLI (in this process: the module's entry point is tests/test_edits.py's): exit 2,
    # the file and line
    from dapo_flow import cli

    code = cli.main(["validate", str(ppo_graph(workdir, critic_model="policy"))])
    out = capsys.readouterr()
    assert code == 2 and "ppo-small.yaml" in out.out + out.err and "Traceback" not in out.out + out.err


def test_a_causal_lm_path_with_head_value_is_a_critic(workdir, tiny_adder_path):
    """verl's way: the critic from the actor's directory, a new value head on its backbone."""
    path = ppo_graph(workdir, critic=str(tiny_adder_path), head="value", steps=1, ckpt=0)
    # a wrong answer scores -1: step 1's 8 samples (all wrong at seed 0) have returns to learn
    path.write_text(path.read_text().replace("wrong: 0.0", "wrong: -1.0"))
    summary = execute(compile_graph(path, CLUSTER), executor="local", console=_quiet())
    assert summary["steps"] == 1
    history = read_run(summary["tracking_uri"], summary["run_id"])["history"]
    assert history["critic/values_mean"] == [(1, 0.0)]  # the new head starts at V = 0 everywhere
    for key in ("critic/vf_loss", "critic/grad_norm"):  # and is trained toward the returns
        [(_, value)] = history[key]
        assert value > 0 and math.isfinite(value), key


def test_gae_advantage_node_is_algos_gae_on_the_last_token_rewards():
    rows = pa.table({
        C.PROMPT_ID: pa.array(["a", "a", "b"]),
        C.RESPONSE_LEN: pa.array([3, 1, 2], pa.int32()),
        C.SCORE: pa.array([1.0, 0.0, 1.0], pa.float32()),
        C.VALUES: pa.array([[0.1, 0.2, 0.3], [0.5], [0.0, 0.9]], C.TOKEN_FLOATS),
    })
    op = Advantage(AdvantageParams(estimator="gae", gamma=0.9, lam=0.8, reward_column="score"), OpContext("adv"))
    out = op(rows)
    rewards = torch.tensor([[0, 0, 1.0], [0, 0, 0], [0, 1.0, 0]])
    values = torch.tensor([[0.1, 0.2, 0.3], [0.5, 0, 0], [0.0, 0.9, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]], dtype=torch.bool)
    adv, returns = algos.gae(rewards, values, mask, gamma=0.9, lam=0.8)
    for column, expected in ((C.TOKEN_ADVANTAGE, adv), (C.RETURNS, returns)):
        got = out.column(column).to_pylist()
        for i, n in enumerate([3, 1, 2]):
            np.testing.assert_allclose(got[i], expected[i, :n].numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.shared_ray
@pytest.mark.figures
@pytest.mark.slow
def test_the_ppo_graph_learns(workdir):
    """graphs/ppo.yaml as `dapo-flow run` runs it (on Ray): val acc rises as docs/results.md
    says, and the critic's values follow the reward."""
    summary = execute(compile_graph(ROOT / "graphs" / "ppo.yaml", CLUSTER), executor="ray", console=_quiet())
    assert_learned(summary, results_row("ppo"), "graphs/ppo.yaml val acc start -> end")
    history = read_run(summary["tracking_uri"], summary["run_id"])["history"]
    late_values = np.mean([v for s, v in history["critic/values_mean"] if s > 80])
    late_acc = np.mean([v for s, v in history["batch/acc_mean"] if s > 80])
    assert abs(late_values - late_acc) < 0.1, (late_values, late_acc)


@pytest.mark.shared_ray
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_critic_trained_by_a_group_matches_one_worker(workdir):
    """The critic on an FSDP2 group of 2 (Ray, gloo) learns what one worker learns: the same
    value losses and values, step by step (the group cuts mini-batches as one worker does). The
    one worker runs in-process (the local executor computes what Ray's one actor does:
    tests/runtime/test_ray_run.py), which spares a second Ray run's actor starts."""
    def history(name: str, executor: str, **train) -> dict:
        path = ppo_graph(workdir, name=name, steps=3, ckpt=0)
        if train:
            path.write_text(path.read_text().replace(
                'critic: {path: "builtin:tiny-adder-critic"}',
                'critic: {path: "builtin:tiny-adder-critic", train: {workers: 2, strategy: fsdp2}}'))
        summary = execute(compile_graph(path, CLUSTER), executor=executor, console=_quiet())
        return read_run(summary["tracking_uri"], summary["run_id"])["history"]

    one, group = history("ppo-one", "local"), history("ppo-group", "ray", workers=2)
    for key in ("critic/vf_loss", "critic/values_mean", "critic/vpred_mean"):
        # float rounding of the group's reductions, through two Adam steps: ~5e-5 on values ~0.01
        np.testing.assert_allclose([v for _, v in group[key]], [v for _, v in one[key]], rtol=1e-3, atol=2e-4)
