"""A custom operator declaring ``ROLE = "generate"`` is treated like the built-in generate: placed
in the rollout actor, synced after the update, sampled with by validation, checkpointed and
resumed. The compiler and runtime read roles, never op names."""

from __future__ import annotations

from dapo_flow.graph.compiler import compile_graph
from dapo_flow.graph.plan import Cluster
from dapo_flow.runtime import execute
from dapo_flow.tracking import read_run

CLUSTER = Cluster(cpus=2)

WRAPPER = '''
from dapo_flow.operators.generate import Generate


class WrappedGenerate:
    """The built-in generate behind a custom operator (delegation, no subclassing)."""

    Params = Generate.Params
    REQUIRES = Generate.REQUIRES
    PRODUCES = Generate.PRODUCES
    CARDINALITY = "expand"
    NEEDS_MODEL = True
    ROLE = "generate"

    def __init__(self, params, ctx):
        self.params, self.ctx = params, ctx
        self.inner = Generate(params, ctx)

    def __call__(self, batch):
        return self.inner(batch)

    def last_metrics(self):
        return self.inner.last_metrics()

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state):
        self.inner.load_state_dict(state)
'''


def _custom_graph(workdir, small_graph, **kw):
    (workdir / "wrapped.py").write_text(WRAPPER)
    path = small_graph(workdir, **kw)
    text = path.read_text().replace("op: generate, model: policy", "op: custom, impl: wrapped.py:WrappedGenerate, model: policy")
    path.write_text(text + "placement: {mode: disaggregated}\n")
    return path


def test_a_custom_generator_is_placed_synced_and_validated_with(workdir, small_graph):
    placed = compile_graph(_custom_graph(workdir, small_graph, steps=2, ckpt=0), CLUSTER)
    assert placed.node_stage["rollout"] == "rollout:policy"  # its own actor when disaggregated
    assert [(s.after, s.target, s.kind) for s in placed.syncs] == [("train", "rollout:policy", "transfer")]
    summary = execute(placed, executor="local")
    log = summary["call_log"]
    assert ("validate", "rollout:policy", ("rollout",)) in log
    assert log.count(("sync", "model:policy", ("rollout:policy", "transfer"))) == 2


def test_a_custom_generator_resumes_exactly(workdir, small_graph):
    path = _custom_graph(workdir, small_graph, steps=3, ckpt=1)
    whole = execute(compile_graph(path, CLUSTER), executor="local")
    first = execute(compile_graph(path, CLUSTER), executor="local", steps=2)
    resumed = execute(compile_graph(path, CLUSTER), executor="local", resume=first["run_id"], steps=3)
    a = read_run(whole["tracking_uri"], whole["run_id"])["history"]
    b = read_run(resumed["tracking_uri"], resumed["run_id"])["history"]
    # the generator's sampling-seed counter came back from the checkpoint: step 3 samples the same
    for key in ("batch/reward_mean", "actor/pg_loss", "gen/tokens"):
        assert a[key] == b[key], key
