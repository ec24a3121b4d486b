"""A small DAPO graph for runtime tests: a few steps of 4 prompts x 4 samples."""

from __future__ import annotations

from pathlib import Path

TEMPLATE = """\
name: {name}
seed: {seed}
models:
  policy: {{path: "builtin:tiny-adder", backend: {backend}}}
data:
  train: {{source: "builtin:addition", split: train}}
  val: {{source: "builtin:addition", split: val, size: 16}}
run: {{steps: {steps}, prompts_per_step: 4, gen_prompts_per_batch: 8, val_every: 2, val_n: {val_n}, val_temperature: {val_temp}, checkpoint_every: {ckpt}, keep_checkpoints: {keep}, chunk_prompts: 4, carry_surplus: {carry}}}
tracking: {{experiment: runtime-tests, log_samples: 4}}
nodes:
  - {{id: rollout, op: generate, model: policy, inputs: [prompts], params: {{n: 4, max_tokens: 8}}}}
  - {{id: verify, op: score, inputs: [rollout], params: {{correct: 1.0, wrong: {wrong}}}}}
  - {{id: overlong, op: overlong-shape, inputs: [verify], params: {{max_len: 8, buffer_len: 4}}}}
  - {{id: filter, op: group-filter, inputs: [overlong], params: {{metric: {metric}, max_gen_batches: {cap}, on_cap: {on_cap}}}}}
  - {{id: old_logp, op: logprob, model: policy, inputs: [filter]}}
  - {{id: adv, op: advantage, inputs: [old_logp]}}
  - {{id: train, op: update, model: policy, inputs: [adv], params: {{lr: 1.0e-4, mini_batches: 2}}}}
"""


def write_graph(tmp: Path, *, name: str = "small", seed: int = 0, steps: int = 3, ckpt: int = 2,
                metric: str = "acc", cap: int = 10, on_cap: str = "train-on-what-we-have",
                wrong: float = -1.0, backend: str = "hf", carry: bool = False, val_n: int = 1,
                val_temp: float = 0.0, keep: int | None = None) -> Path:
    path = tmp / f"{name}.yaml"
    path.write_text(TEMPLATE.format(name=name, seed=seed, steps=steps, ckpt=ckpt, metric=metric,
                                    cap=cap, on_cap=on_cap, wrong=wrong, backend=backend,
                                    carry=str(carry).lower(), val_n=val_n, val_temp=val_temp,
                                    keep="null" if keep is None else keep))
    return path


import pytest  # noqa: E402


@pytest.fixture(scope="session")  # a plain function: module fixtures may use it too
def small_graph():
    """`small_graph(dir, **options) -> path` writes the small DAPO graph."""
    return write_graph


@pytest.fixture()
def workdir(tmp_path, monkeypatch, tiny_adder_path):
    """A fresh working directory: the default MLflow store (a copy of an empty migrated one:
    dapo_flow.tracking) and checkpoints live under ./dapo-flow-runs."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return tmp_path


@pytest.fixture()
def fails_in_update(monkeypatch):
    """``with fails_in_update(k): run`` makes the k-th update of the runs inside raise (a
    trainer's node lost mid-run: RuntimeError "the trainer's node went away"); after the block,
    updates run again."""
    import contextlib

    from dapo_flow.runtime.loop import Runner

    finish = Runner.finish_update

    @contextlib.contextmanager
    def failing(k: int):
        calls = []

        def finish_or_fail(runner, state, update):
            if update.rollout.batch is not None:  # a step that trains
                calls.append(update)
                if len(calls) == k:
                    raise RuntimeError("the trainer's node went away")
            return finish(runner, state, update)

        monkeypatch.setattr(Runner, "finish_update", finish_or_fail)
        try:
            with pytest.raises(RuntimeError, match="went away"):
                yield
        finally:
            monkeypatch.setattr(Runner, "finish_update", finish)

    return failing


@pytest.fixture()
def executors_started(monkeypatch) -> list:
    """Every RayExecutor the test's runs start, in order."""
    from dapo_flow.runtime import executors

    started = []
    init = executors.RayExecutor.__init__

    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        started.append(self)

    monkeypatch.setattr(executors.RayExecutor, "__init__", recording)
    return started


@pytest.fixture()
def at_step(monkeypatch, executors_started):
    """``at_step(k, action, session=0)``: ``action(executor)`` runs in the driver as the run's
    ``session``-th start (0: the first, 1: the one after a recovery) begins step ``k``, before
    that step's calls; the executor is that session's."""
    from dapo_flow.runtime import session as sessions

    real = sessions._step
    actions: dict[tuple[int, int], list] = {}

    def step(runner, state, *args, **kwargs):
        for action in actions.pop((len(executors_started) - 1, state.step + 1), []):
            action(executors_started[-1])
        return real(runner, state, *args, **kwargs)

    monkeypatch.setattr(sessions, "_step", step)
    return lambda k, action, session=0: actions.setdefault((session, k), []).append(action)
