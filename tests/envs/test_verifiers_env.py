"""verifiers environments by id (dapo_flow/envs/verifiers_env.py), offline: the test environment
tests/envs/vf_environments/vf_product_test (single turn, a rubric worth 0.5) and the shipped
graphs/environments/vf_calculator (a calculator tool) are loaded by verifiers' own loader from
their folder (options.path): the taskset's tasks become prompt rows, each sample is the
environment's episode through harness-generate's endpoint on builtin:tiny-agent, its rubric's
reward is the sample's, and every trained token is one the engine sampled. A missing package or
an unknown id fails validation (exit 2) with the fix."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from dapo_flow import cli
from dapo_flow.core import columns as C
from dapo_flow.core.contract import OpContext
from dapo_flow.data.prompts import load_prompts
from dapo_flow.envs import verifiers_env
from dapo_flow.errors import DataError
from dapo_flow.graph.spec import ModelSpec
from dapo_flow.models.hf import HFPolicy
from dapo_flow.operators.harness_generate import HarnessGenerate
from dapo_flow.runtime.resources import ModelResource

pytestmark = pytest.mark.models("tiny-agent")
ROOT = Path(__file__).resolve().parents[2]
TEST_ENVS = Path(__file__).resolve().parent / "vf_environments"
SHIPPED = ROOT / "graphs" / "environments"


class RecordingEngine:
    """The real engine, the token ids of every sequence it sampled kept."""

    def __init__(self, engine: HFPolicy):
        self.engine, self.sampled = engine, []
        self.tokenizer, self.eos_ids, self.model = engine.tokenizer, engine.eos_ids, engine.model

    @property
    def weights_version(self) -> int:
        return self.engine.weights_version

    def generate(self, prompt_ids, cfg):
        out = self.engine.generate(prompt_ids, cfg)
        self.sampled += [(list(ids), list(logp)) for ids, logp in zip(out.response_ids, out.logprobs)]
        return out


@pytest.fixture(scope="module")
def model() -> ModelResource:
    from dapo_flow.models import resolve_model

    path = resolve_model("builtin:tiny-agent", progress=False)
    policy = HFPolicy(path)
    engine = RecordingEngine(policy)
    return ModelResource("policy", ModelSpec(path="builtin:tiny-agent"), path, policy, engine, policy.tokenizer)


def _rows(model, source: str, folder: Path, config: dict, size: int | None = None) -> pa.Table:
    table, dropped = load_prompts(source, tokenizer=model.tokenizer, split="train", size=size,
                                  config=config, options={"path": str(folder)})
    assert dropped == 0
    return table


def _play(model, rows: pa.Table, ref: str, node: str, n: int) -> tuple[pa.Table, dict]:
    op = HarnessGenerate(HarnessGenerate.Params(harness=ref, n=n, max_tokens=64, max_requests=4, format="compact"),
                         OpContext(node_id=node, seed=0, model=model, models={"policy": model}, workdir=str(ROOT)))
    try:
        return op(rows), op.last_metrics()
    finally:
        op.close()


def _runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """(start, end, flag) of each run of equal loss-mask flags."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((start, i, mask[start]))
            start = i
    return out


def test_an_environment_loads_by_id_and_its_tasks_become_prompts(model):
    rows = _rows(model, "verifiers:vf-product-test", TEST_ENVS, {"count": 3, "first": 40}).to_pylist()
    assert [r[C.PROMPT_TEXT] for r in rows] == ["40*23=", "41*30=", "42*37="]  # its args passed through
    tok = model.tokenizer
    # chat messages (the first request's ids, which replace these, are the endpoint's rendering)
    assert rows[0][C.PROMPT_IDS] == tok.encode("40*23=", add_special_tokens=False)
    payload = json.loads(rows[1][C.GROUND_TRUTH])
    assert payload["env"] == "vf-product-test" and payload["env_args"] == {"count": 3, "first": 40}
    assert payload["task"]["answer"] == "1230" and payload["task"]["id"] == "p1" and payload["task"]["idx"] == 1
    assert {r[C.DATA_SOURCE] for r in rows} == {"verifiers:vf-product-test"}

    with pytest.raises(DataError, match=r"vf-product-test.*count.*\n    fix: config: holds the fields"):
        _rows(model, "verifiers:vf-product-test", TEST_ENVS, {"count": "many"})


def test_its_rubric_is_the_reward_and_every_trained_token_was_sampled(model):
    rows = _rows(model, "verifiers:vf-product-test", TEST_ENVS, {"count": 4})
    model.generator.sampled.clear()
    out, metrics = _play(model, rows, "verifiers:vf-product-test", "vf-product", n=4)
    assert out.num_rows == 16 and metrics["harness/masked_frac"] == 0.0
    sampled = {tuple(ids): logp for ids, logp in model.generator.sampled}
    for r in out.to_pylist():
        # one request, no tools: the whole response is one sequence the engine sampled, its logprobs
        assert r[C.LOSS_MASK] == [1] * r[C.RESPONSE_LEN] and r[C.NUM_TURNS] == 1
        assert tuple(r[C.RESPONSE_IDS]) in sampled
        np.testing.assert_array_equal(np.float32(r[C.ROLLOUT_LOGP]), np.float32(sampled[tuple(r[C.RESPONSE_IDS])]))
        answer = json.loads(r[C.GROUND_TRUTH])["task"]["answer"]
        assert r[C.HARNESS_REWARD] == (0.5 if r[C.RESPONSE_TEXT].strip() == answer else 0.0)  # the rubric's weight


def test_the_shipped_tool_environment_masks_what_its_harness_inserted(model):
    rows = _rows(model, "verifiers:vf-calculator", SHIPPED, {"split": "val"}, size=2)
    model.generator.sampled.clear()
    out, metrics = _play(model, rows, "verifiers:vf-calculator", "vf-calculator", n=8)
    assert metrics["harness/masked_frac"] == 0.0  # verifiers' interception passed the history on unchanged
    sampled = {tuple(ids) for ids, _ in model.generator.sampled}
    rows = out.to_pylist()
    assert any(r[C.NUM_TOOL_CALLS] > 0 for r in rows), "the warm start calls the calculator in about a fifth"
    for r in rows:
        runs = _runs(r[C.LOSS_MASK])
        for start, end, flag in runs:  # each model turn sampled whole; what lies between is masked
            if flag:
                assert tuple(r[C.RESPONSE_IDS][start:end]) in sampled
        assert r[C.NUM_TURNS] == sum(flag for _, _, flag in runs)
        final = model.tokenizer.decode(r[C.RESPONSE_IDS][runs[-1][0]:], skip_special_tokens=True).strip()
        assert r[C.HARNESS_REWARD] == (1.0 if final == json.loads(r[C.GROUND_TRUTH])["task"]["answer"] else 0.0)


GRAPH = textwrap.dedent("""\
    name: vf
    models:
      policy: {{path: "builtin:tiny-agent", dtype: float32, backend: hf}}
    data:
      train: {{source: "verifiers:{env}", options: {{path: "{path}"}}}}
    run: {{steps: 1, prompts_per_step: 2}}
    nodes:
      - {{id: rollout, op: harness-generate, model: policy, inputs: [prompts],
          params: {{harness: "verifiers:{env}", n: 2, max_tokens: 64, format: compact}}}}
      - {{id: verify, op: score, inputs: [rollout], params: {{reward: "builtin:harness"}}}}
      - {{id: old_logp, op: logprob, model: policy, inputs: [verify], params: {{role: actor, source: rollout}}}}
      - {{id: adv, op: advantage, inputs: [old_logp], params: {{estimator: grpo}}}}
      - {{id: train, op: update, model: policy, inputs: [adv]}}
    """)


def test_an_unknown_id_or_a_missing_package_fails_validation(tmp_path, capsys, monkeypatch):
    graph = tmp_path / "vf.yaml"
    graph.write_text(GRAPH.format(env="vf-product-test", path=TEST_ENVS))
    assert cli.main(["validate", str(graph)]) == 0

    graph.write_text(GRAPH.format(env="vf-no-such-env", path=TEST_ENVS))
    assert cli.main(["validate", str(graph)]) == 2
    err = capsys.readouterr().err
    assert "data.train.source" in err and "no verifiers environment 'vf-no-such-env' is installed" in err
    assert "pip install the environment's package, or set options.path" in err

    monkeypatch.setattr(verifiers_env, "installed", lambda: False)
    graph.write_text(GRAPH.format(env="vf-product-test", path=TEST_ENVS))
    assert cli.main(["validate", str(graph)]) == 2
    err = capsys.readouterr().err
    assert "needs the optional verifiers package" in err and "harness" in err and "data.train.source" in err
    assert err.count(verifiers_env.INSTALL) >= 2  # the source and the harness


@pytest.mark.slow
def test_the_verifiers_graph_runs_locally(tmp_path, monkeypatch, capsys):
    """graphs/verifiers.yaml, shortened, on the local executor."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    from dapo_flow.tracking import default_tracking_uri, latest_run

    short = ["--steps", "2", "--set", "run.prompts_per_step=4", "--set", "run.gen_prompts_per_batch=4",
             "--set", "rollout.n=4", "--set", "data.val.size=4", "--set", "run.val_n=2",
             "--set", "run.checkpoint_every=0", "--set", "dynamic_sampling.max_gen_batches=2",
             "--set", f"data.train.options.path={SHIPPED}", "--set", f"data.val.options.path={SHIPPED}",
             "--set", "tracking.experiment=verifiers-local"]
    assert cli.main(["run", str(ROOT / "graphs" / "verifiers.yaml"), "--executor", "local", *short]) == 0
    metrics = latest_run(default_tracking_uri(), "verifiers-local")["metrics"]
    assert "OpenAI-compatible endpoint http://127.0.0.1:" in capsys.readouterr().out
    assert metrics["harness/masked_frac"] == 0.0 and metrics["harness/engine_calls"] >= 1
