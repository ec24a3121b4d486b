"""`dapo-flow eval` on CUDA: the base model and a run's newest checkpoint, sampled on the GPU;
the checkpoint's eval reproduces the run's own last validation."""

from __future__ import annotations

import pytest

from gpu_runs import devices_of, history, run_graph, small_graph

pytestmark = pytest.mark.gpu


def test_eval_of_the_base_model_and_a_checkpoint_on_the_gpu(workdir, quiet, device, policies):
    from dapo_flow.experiments.evaluate import evaluate

    path = small_graph(workdir, steps=2, ckpt=2)
    trained, placed = run_graph(path, [("set", "run.val_n=4"), ("set", "run.val_temperature=1.0")], console=quiet)

    policies.clear()
    base = evaluate(placed, which="base", n=4, temperature=1.0, console=quiet)
    assert base["checkpoint"] is None and devices_of(policies) == {device.type}
    m = base["metrics"]
    assert m["eval/prompts"] == 16 and 0 <= m["val/acc"] <= m["val/pass_at_2"] <= m["val/pass_at_4"] <= 1

    policies.clear()
    latest = evaluate(placed, console=quiet)  # the graph's val_n / temperature and seed
    assert latest["step"] == 2 and latest["checkpoint"].endswith("step_000002")
    assert devices_of(policies) == {device.type}
    val = history(trained)
    for key in ("val/acc", "val/pass_at_4"):
        assert latest["metrics"][key] == val[key][-1][1]  # step 2's validation, reproduced exactly
