"""Every extension point is one file plus one registry line (README, "Extending dapo-flow"): an
operator, an advantage estimator, a reward function, a generation backend and an executor, all
defined in one module in a temp dir, registered, and used by a real run through the CLI."""

from __future__ import annotations

import sys

import pytest

from dapo_flow import cli
from dapo_flow import algos
from dapo_flow.graph.registry import OPERATORS
from dapo_flow.models.engines import BACKENDS, Backend
from dapo_flow.runtime.executors import EXECUTORS
from dapo_flow.tracking import default_tracking_uri, latest_run, read_run

EXTENSIONS = '''
import pyarrow as pa

from dapo_flow.core import columns as C
from dapo_flow.core.contract import PARAMS_CONFIG
from dapo_flow.runtime.executors import LocalExecutor
from pydantic import BaseModel

USED = {"operator": 0, "estimator": 0, "reward": 0, "backend": 0, "executor": 0}


class ClipReward:
    """An operator: clips the shaped reward to [-1, 1]."""

    class Params(BaseModel):
        model_config = PARAMS_CONFIG
        bound: float = 1.0

    REQUIRES = C.typed(C.REWARD)
    PRODUCES = C.typed(C.REWARD)
    CARDINALITY = "map"
    NEEDS_MODEL = False

    def __init__(self, params, ctx):
        self.params = params

    def __call__(self, batch):
        USED["operator"] += 1
        b = self.params.bound
        clipped = [min(max(r, -b), b) for r in batch.column(C.REWARD).to_pylist()]
        return batch.set_column(batch.column_names.index(C.REWARD), C.REWARD, pa.array(clipped, pa.float32()))


def centred(s, seg, norm_by_std, lengths):
    """An estimator: reward minus its group mean (float64, per sequence)."""
    USED["estimator"] += 1
    return s - seg.mean(s)[seg.codes]


def exact_sum(response_text, ground_truth, extra_info):
    """A reward function: 1 for the right sum, else 0."""
    USED["reward"] += 1
    return 1.0 if response_text.strip() == str(ground_truth).strip() else 0.0


class CountingEngine:
    """A backend's rollout engine: the hf policy, counted."""

    def __init__(self, inner):
        self.inner, self.tokenizer = inner, inner.tokenizer

    def generate(self, prompt_ids, cfg):
        USED["backend"] += 1
        return self.inner.generate(prompt_ids, cfg)

    @property
    def weights_version(self):
        return self.inner.weights_version

    def load_weights(self, weights, version=None):
        self.inner.load_weights(weights, version)

    def set_weights_version(self, version):
        self.inner.set_weights_version(version)

    def close(self):
        pass


def counting_engine(path, *, dtype, device, seed, trainer=None, options=None):
    from dapo_flow.models.hf import rollout_engine

    return CountingEngine(rollout_engine(path, dtype=dtype, device=device, seed=seed))


class CountingExecutor(LocalExecutor):
    """An executor: the local one, counting calls."""

    name = "counting"

    def call(self, stage, method, *args):
        USED["executor"] += 1
        return super().call(stage, method, *args)
'''


def test_an_operator_estimator_reward_backend_and_executor_each_plug_in(workdir, small_graph, monkeypatch):
    (workdir / "ext").mkdir()
    (workdir / "ext" / "my_ext.py").write_text(EXTENSIONS)
    monkeypatch.syspath_prepend(str(workdir / "ext"))
    monkeypatch.delitem(sys.modules, "my_ext", raising=False)
    import my_ext

    # the one registry line of each
    monkeypatch.setitem(OPERATORS, "clip-reward", my_ext.ClipReward)
    monkeypatch.setitem(algos.ESTIMATORS, "centred", algos.Estimator("r - group mean", my_ext.centred))
    monkeypatch.setitem(BACKENDS, "counting", Backend("my_ext:counting_engine", generates_with_trainer=False))
    monkeypatch.setitem(EXECUTORS, "counting", my_ext.CountingExecutor)

    path = small_graph(workdir, steps=2, ckpt=0)
    text = (path.read_text()
            .replace("backend: hf", "backend: counting")
            .replace("params: {correct: 1.0, wrong: -1.0}", "params: {reward: 'my_ext:exact_sum'}")
            .replace("{id: filter, op: group-filter, inputs: [overlong]",
                     "{id: clip, op: clip-reward, inputs: [overlong]}\n  - {id: filter, op: group-filter, inputs: [clip]")
            .replace("{id: adv, op: advantage, inputs: [old_logp]}",
                     "{id: adv, op: advantage, inputs: [old_logp], params: {estimator: centred}}"))
    path.write_text(text)
    assert cli.main(["run", str(path), "--executor", "counting"]) == 0
    assert all(my_ext.USED[k] > 0 for k in my_ext.USED), my_ext.USED
    run = read_run(default_tracking_uri(), latest_run(default_tracking_uri(), "runtime-tests")["run_id"])
    assert run["params"]["executor"] == "counting" and run["params"]["models.policy.backend"] == "counting"
    assert [s for s, _ in run["history"]["actor/pg_loss"]] == [1, 2]


def test_installed_plugins_register_through_entry_points(monkeypatch, tmp_path, capsys):
    """A package declares `dapo_flow.plugins = my_pkg.plugin`: the CLI imports it before parsing,
    so an executor it registers is a valid --executor choice; one that fails is a clear error."""
    from importlib.metadata import EntryPoint

    from dapo_flow.graph import registry

    (tmp_path / "plugin_mod.py").write_text(
        "from dapo_flow.runtime.executors import EXECUTORS, LocalExecutor\n"
        "EXECUTORS['from-plugin'] = LocalExecutor\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "plugin_mod", raising=False)
    group = registry.MODULE_PLUGIN_GROUP
    points = {group: [EntryPoint("mine", "plugin_mod", group)]}
    monkeypatch.setattr(registry, "entry_points", lambda group: points.get(group, []))
    try:
        with pytest.raises(SystemExit) as done:  # argparse exits after --help
            cli.main(["run", "--help"])
        assert done.value.code == 0 and "from-plugin" in capsys.readouterr().out  # a listed choice
    finally:
        EXECUTORS.pop("from-plugin", None)
    points[group] = [EntryPoint("broken", "no_such_module_xyz", group)]
    assert cli.main(["validate", "graphs/dapo.yaml"]) == 2
    assert "plugin 'broken' (no_such_module_xyz, entry point group dapo_flow.plugins) failed to load" in capsys.readouterr().err
