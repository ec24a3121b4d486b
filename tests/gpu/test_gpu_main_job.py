"""The README's main job on CUDA prints the CPU's figures: graphs/dapo.yaml's first 20 steps
with `--executor local`, once with the policy on the GPU and once on this machine's CPU, give the
same reward and val acc (start -> end) to the printed digit.

20 steps, not the README's 120: the run's sampled tokens follow its logits, and another device's
kernels round them differently, a difference 120 RL steps can carry into the second digit (as
another CPU type's kernels do: README). What the CPU gives itself is pinned by
tests/test_learning.py on the CPU types the README names; here the two devices of one machine are
compared with each other."""

from __future__ import annotations

import pytest

from gpu_runs import GRAPHS, devices_of, history, run_graph

pytestmark = pytest.mark.gpu

STEPS = 20


def _printed(summary: dict) -> tuple[str, str, str]:
    """The figures the run prints: its last step's reward (the progress bar's), val acc start -> end."""
    return (f"{summary['last_metrics']['batch/reward_mean']:+.3f}", f"{summary['val_acc_start']:.3f}",
            f"{summary['val_acc_end']:.3f}")


def test_the_main_jobs_first_20_steps_on_the_gpu_print_the_cpus_figures(workdir, quiet, device, policies, builtin):
    builtin("tiny-adder")
    figures, rewards = {}, {}
    for where, flags in ((device.type, []), ("cpu", [("set", "models.policy.device=cpu")])):
        policies.clear()
        summary, _ = run_graph(GRAPHS / "dapo.yaml", flags, steps=STEPS, console=quiet)
        assert summary["steps"] == STEPS
        assert devices_of(policies) == {where}
        figures[where] = _printed(summary)
        rewards[where] = [f"{v:+.3f}" for _, v in history(summary)["batch/reward_mean"]]
    assert figures[device.type] == figures["cpu"], (figures, rewards)
