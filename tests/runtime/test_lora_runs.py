"""A graph trained with `train.lora` end to end (local executor): checkpoints hold the
adapters and name the base, a run that dies resumes to exactly what an uninterrupted one logs,
`export` writes the merged model (or, with --adapter, peft's format), and a `logprob` node with
role ref on the trained model reads its base (the adapters off) with no second copy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dapo_flow import cli
from dapo_flow.graph.compiler import compile_graph
from dapo_flow.models import lora as lora_lib
from dapo_flow.models.hf import HFPolicy
from dapo_flow.experiments.evaluate import evaluate
from dapo_flow.runtime import checkpoint, execute
from dapo_flow.runtime.resume import checkpoint_root
from dapo_flow.tracking import read_run

from test_checkpoints import CLUSTER, _deterministic, _quiet, _run_and_die

pytestmark = pytest.mark.slow  # end-to-end runs (the fast tier keeps tests/models/test_lora.py)

STEPS = 4
LORA = "  policy: {path: \"builtin:tiny-adder\", backend: hf, train: {lora: {rank: 8, alpha: 16}}}\n"


def _lora_graph(small_graph, where, *, ref: bool = False, **options):
    path = small_graph(where, steps=STEPS, ckpt=2, **options)
    text = path.read_text().replace('  policy: {path: "builtin:tiny-adder", backend: hf}\n', LORA)
    text = text.replace("lr: 1.0e-4", "lr: 2.0e-3")
    if ref:  # a reference on the trained model itself, and the KL as a loss term
        text = text.replace("  - {id: adv,", "  - {id: ref_logp, op: logprob, model: policy, inputs: [old_logp], "
                            "params: {role: ref}}\n  - {id: adv,").replace("inputs: [old_logp]}", "inputs: [ref_logp]}")
        text = text.replace("mini_batches: 2}", "mini_batches: 1, kl_coef: 0.01}")  # step 1: fresh adapters
    assert LORA in text
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def straight(tmp_path_factory, small_graph, tiny_adder_path) -> dict:
    where = tmp_path_factory.mktemp("lora-straight")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(where)
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        summary = execute(compile_graph(_lora_graph(small_graph, where), CLUSTER), executor="local",
                          console=_quiet())
        return _deterministic(read_run(summary["tracking_uri"], summary["run_id"])["history"])


def test_a_lora_run_checkpoints_its_adapters_and_resumes_exactly(workdir, small_graph, straight, tiny_adder_path,
                                                                 policies):
    placed = compile_graph(_lora_graph(small_graph, workdir), CLUSTER)
    _run_and_die(placed, 3)  # dies in step 4: the checkpoint of step 2 is the newest
    [run_folder] = checkpoint_root(placed.plan.spec).iterdir()
    saved = checkpoint.step_dir(run_folder, 2) / "models" / "policy"
    assert lora_lib.is_adapter_dir(saved) and lora_lib.base_of(saved) == str(tiny_adder_path)
    adapters = (saved / lora_lib.ADAPTER_WEIGHTS).stat().st_size
    assert adapters < 0.5 * (tiny_adder_path / "model.safetensors").stat().st_size

    summary = execute(placed, executor="local", resume=True, console=_quiet())
    run = read_run(summary["tracking_uri"], summary["run_id"])
    assert [s for s, _ in run["history"]["actor/pg_loss"]] == list(range(1, STEPS + 1))
    assert _deterministic(run["history"]) == straight  # the adapters and AdamW state came back exactly

    final = checkpoint.step_dir(run_folder, STEPS)
    # eval of the checkpoint reads the adapters (merged into a frozen copy), not the bare base:
    # step 4's validation reproduced exactly (greedy)
    policies.clear()
    evaluated = evaluate(placed, which=str(final), console=_quiet())
    assert evaluated["metrics"]["val/acc"] == run["history"]["val/acc"][-1][1]
    merged = HFPolicy(tiny_adder_path, trainable=True, lora=placed.plan.spec.models["policy"].train.lora,
                      adapters=final / "models" / "policy").named_weights()
    sampler = policies[-1].named_weights()  # the copy eval sampled with: the adapters merged in
    assert sampler.keys() == merged.keys()
    assert all(np.allclose(sampler[k], merged[k], atol=1e-6) for k in merged)
    merged_dir, adapter_dir = workdir / "merged", workdir / "adapter"
    assert cli.main(["export", str(final), "-o", str(merged_dir)]) == 0
    assert cli.main(["export", str(final), "-o", str(adapter_dir), "--adapter"]) == 0
    assert lora_lib.is_adapter_dir(adapter_dir) and not lora_lib.is_adapter_dir(merged_dir)
    # the merged export computes what the trained adapters do
    trained = HFPolicy(tiny_adder_path, trainable=True, lora=placed.plan.spec.models["policy"].train.lora,
                       adapters=final / "models" / "policy")
    ids = torch.tensor([[1, 5, 7, 9, 11, 3]])
    with torch.no_grad():
        want = trained.model(input_ids=ids).logits
        got = HFPolicy(merged_dir).model(input_ids=ids).logits
        base = HFPolicy(tiny_adder_path).model(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(want, base, atol=1e-4)  # the run trained something


def test_export_without_adapters_refuses_adapter(workdir, small_graph):
    path = small_graph(workdir, steps=2, ckpt=2)
    execute(compile_graph(path, CLUSTER), executor="local", console=_quiet())
    assert cli.main(["export", "dapo-flow-runs", "-o", str(workdir / "out"), "--adapter"]) == 2
    assert not (workdir / "out").exists()


def test_a_reference_on_the_lora_model_is_its_base(workdir, small_graph, tiny_adder_path, monkeypatch):
    from dapo_flow.core import columns as C
    from dapo_flow.operators.logprob import Logprob

    passes: list = []  # every ref pass of the run (the local executor runs the nodes in this process)
    call = Logprob.__call__

    def recording(self, batch):
        out = call(self, batch)
        if self.params.role == "ref":
            passes.append(out.select([C.PROMPT_IDS, C.RESPONSE_IDS, C.REF_LOGP]))
        return out

    monkeypatch.setattr(Logprob, "__call__", recording)
    placed = compile_graph(_lora_graph(small_graph, workdir, ref=True), CLUSTER)
    summary = execute(placed, executor="local", console=_quiet())
    history = read_run(summary["tracking_uri"], summary["run_id"])["history"]
    kl = [v for _, v in history["actor/kl_loss"]]
    assert kl[0] == pytest.approx(0.0, abs=1e-7)  # step 1: fresh adapters, the policy is its base
    assert kl[-1] > 1e-7  # later the adapters moved it away from the base the reference reads
    # what the reference read at every step, the last ones after the adapters moved, is the base
    assert len(passes) == STEPS
    base = HFPolicy(tiny_adder_path)
    for table in passes:
        logp, _, mask = base.response_logprobs(table.column(C.PROMPT_IDS).to_pylist(),
                                               table.column(C.RESPONSE_IDS).to_pylist())
        want = torch.cat([row[m] for row, m in zip(logp, mask.bool())])
        got = torch.tensor([v for row in table.column(C.REF_LOGP).to_pylist() for v in row])
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
