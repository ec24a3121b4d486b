"""The agent loop's state machine and rounds, on a scripted engine (a fake, named so) and real
tools: every transition (answer, tool call, length stop inside a turn and at an observation,
max turns, a malformed call), masks and logprobs token by token, turns of different requests
batching together, tools running at once, timeouts and failures as observations."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from dapo_flow.agent.requests import Request, Status, TransitionError
from dapo_flow.agent.rollout import AgentLimits, rollout_metrics, run_agent
from dapo_flow.models.sampling import Rollouts, SamplingConfig
from dapo_flow.models.tokenizer import build_char_tokenizer
from dapo_flow.tools.base import ToolResult
from dapo_flow.tools.calculator import Calculator
from dapo_flow.tools.calls import ParsedCalls

TOK = build_char_tokenizer("0123456789+*= -<>/:abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.,;'()_\"")
EOS = TOK.eos_token_id


def enc(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


class FakeScriptedEngine:
    """A fake engine (named so): request ``prompt text`` -> its turns' texts, in order; a turn
    ends with EOS unless its text ends with "~" (then it runs to max_tokens, truncated).
    Records how many requests each call carried."""

    weights_version = 0

    def __init__(self, script: dict[str, list[str]], new_weights_each_call: bool = False):
        self.script, self.batches, self.contexts = script, [], []
        self.new_weights_each_call = new_weights_each_call  # a weight sync after every call

    def generate(self, prompts: list[list[int]], cfg: SamplingConfig) -> Rollouts:
        assert cfg.n == 1 and cfg.prompt_seeds is not None and len(cfg.prompt_seeds) == len(prompts)
        self.batches.append(len(prompts))
        ids, logps, truncated = [], [], []
        for context in prompts:
            self.contexts.append(TOK.decode(context, skip_special_tokens=True))
            text = TOK.decode(context, skip_special_tokens=True)
            prompt = next(p for p in self.script if text.startswith(p))
            turn = TOK.decode(context, skip_special_tokens=False).count(TOK.eos_token)
            reply = self.script[prompt][turn]
            if reply.endswith("~"):
                tokens = (enc(reply[:-1]) * cfg.max_tokens)[: cfg.max_tokens]
                truncated.append(True)
            else:
                tokens = enc(reply)[: cfg.max_tokens - 1] + [EOS]
                truncated.append(False)
            ids.append(tokens)
            logps.append([-0.5] * len(tokens))
        k = len(prompts)
        out = Rollouts(np.arange(k, dtype=np.int32), np.zeros(k, np.int32), ids, logps, np.array(truncated),
                       tokens_generated=sum(map(len, ids)), seconds=0.01)
        if self.new_weights_each_call:
            out.versions = [[self.weights_version] * len(t) for t in ids]
            self.weights_version += 1
        return out


def _run(script: dict[str, list[str]], tools=None, *, budget=400, max_turns=4, timeouts=None, n=1, calls=1,
         new_weights_each_call=False):
    engine = FakeScriptedEngine(script, new_weights_each_call)
    prompts = [TOK.encode(p) for p in script]  # BOS + the prompt, as the prompt table holds them
    tools = tools if tools is not None else {"calculator": Calculator()}
    out = run_agent(engine, TOK, tools, timeouts or {name: 5.0 for name in tools}, prompts,
                    [{"ground_truth": "x"} for _ in script], list(range(len(script))),
                    SamplingConfig(n=n, temperature=1.0), AgentLimits(max_turns, calls, budget, "compact"))
    return out, engine


def test_a_call_then_an_answer_masks_the_tool_tokens():
    out, engine = _run({"6*7=": ["<call>calculator: 6*7</call>", "42"]})
    (r,) = out.requests
    model1, obs, model2 = enc("<call>calculator: 6*7</call>") + [EOS], enc("<result>42</result>"), enc("42") + [EOS]
    assert r.response_ids == model1 + obs + model2
    assert r.loss_mask == [1] * len(model1) + [0] * len(obs) + [1] * len(model2)
    assert r.logprobs == [-0.5] * len(model1) + [0.0] * len(obs) + [-0.5] * len(model2)
    assert (r.status, r.stop, r.turns, r.tool_calls, r.tool_errors, r.truncated) == (
        Status.COMPLETED, "answer", 2, 1, 0, False)
    assert engine.contexts[-1] == "6*7=<call>calculator: 6*7</call><result>42</result>"  # what turn 2 saw
    from dapo_flow.operators.agent_generate import conversation

    assert conversation(r, TOK) == "[assistant] <call>calculator: 6*7</call>\n[tool] <result>42</result>\n[assistant] 42"
    m = rollout_metrics(out, 4)
    assert (m["agent/turns_mean"], m["agent/tool_call_success"], m["agent/stop_answer"]) == (2.0, 1.0, 1.0)
    assert m["agent/turn2_requests"] == 1 and m["agent/turn2_tokens_mean"] == 3


def test_each_token_keeps_the_version_that_sampled_it_and_an_observation_its_turns():
    """Weights that change between turns (partial rollouts): each model token reports its turn's
    version, each tool token the version of the turn it answers."""
    out, _ = _run({"6*7=": ["<call>calculator: 6*7</call>", "42"]}, new_weights_each_call=True)
    (r,) = out.requests
    model1, obs, model2 = enc("<call>calculator: 6*7</call>") + [EOS], enc("<result>42</result>"), enc("42") + [EOS]
    assert r.versions == [0] * len(model1) + [0] * len(obs) + [1] * len(model2)
    assert len(r.versions) == len(r.response_ids)


def test_a_turn_that_runs_out_of_budget_is_a_length_stop():
    out, _ = _run({"1+1=": ["<call>calculator: 1+1</call>", "22222~"]}, budget=60)
    (r,) = out.requests
    assert (r.stop, r.truncated, len(r.response_ids), r.turns) == ("length", True, 60, 2)
    assert r.loss_mask[-1] == 1  # the budget ended in the model's turn


def test_an_observation_that_does_not_fit_ends_the_request_before_it():
    call = enc("<call>calculator: 1+1</call>") + [EOS]
    out, _ = _run({"1+1=": ["<call>calculator: 1+1</call>", "2"]}, budget=len(call) + 5)  # <result>2</result> is 17
    (r,) = out.requests
    assert (r.stop, r.truncated, r.response_ids, r.tool_calls) == ("length", True, call, 1)
    assert r.loss_mask == [1] * len(call)  # never ends inside an observation


def test_max_turns_ends_a_request_that_keeps_calling():
    out, _ = _run({"2*2=": ["<call>calculator: 2*2</call>"] * 3}, max_turns=2)
    (r,) = out.requests
    assert (r.stop, r.turns, r.tool_calls) == ("max_turns", 2, 1)  # the second turn's call is not run
    assert not r.truncated


def test_a_malformed_call_is_an_error_the_model_sees_and_the_run_goes_on():
    out, engine = _run({"3*3=": ["<call>calculator 3*3</call>", "<call>calculator: 3*/3</call>", "9"]}, budget=400)
    (r,) = out.requests
    assert (r.stop, r.turns, r.tool_calls, r.tool_errors) == ("answer", 3, 1, 2)
    assert "<result>error: write a call as <call>TOOL: ARGUMENT</call></result>" in engine.contexts[1]
    assert "<result>error:" in engine.contexts[2]  # the calculator's own error for 3*/3
    assert rollout_metrics(out, 4)["agent/tool_call_success"] == 0.0  # 2 calls written, both failed


def test_turns_of_different_requests_batch_together_and_tools_run_at_once():
    barrier = threading.Barrier(2, timeout=10)

    class FakeMeet:  # a tool whose calls only return when two are in flight at once
        name = "meet"
        schema = {"type": "function", "function": {"name": "meet", "description": "d", "parameters": {
            "type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}}}

        def create(self, instance_id, **kwargs): pass
        def execute(self, instance_id, arguments):
            barrier.wait()
            return ToolResult("ok")
        def calc_reward(self, instance_id): return 0.0
        def release(self, instance_id): pass

    script = {"a=": ["<call>meet: 1</call>", "1"], "b=": ["<call>meet: 2</call>", "2"], "c=": ["3"]}
    out, engine = _run(script, {"meet": FakeMeet()})
    assert engine.batches == [3, 2]  # round 1: every request; round 2: the two that called
    assert [r.tool_errors for r in out.requests] == [0, 0, 0]  # both calls met: they ran at once
    assert [r.stop for r in out.requests] == ["answer"] * 3


class FakeStuck:
    """A tool that hangs (the test releases it at the end) or raises."""

    name = "stuck"
    schema = {"type": "function", "function": {"name": "stuck", "description": "d", "parameters": {
        "type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}}}

    def __init__(self):
        self.release_all = threading.Event()

    def create(self, instance_id, **kwargs): pass
    def execute(self, instance_id, arguments):
        if arguments["x"] == "raise":
            raise KeyError("boom")
        self.release_all.wait()
        return ToolResult("late")
    def calc_reward(self, instance_id): return 0.0
    def release(self, instance_id): pass


def test_a_hung_tool_times_out_and_a_raising_tool_is_an_error_observation():
    stuck = FakeStuck()
    try:
        out, engine = _run({"h=": ["<call>stuck: hang</call>", "x"], "r=": ["<call>stuck: raise</call>", "y"]},
                           {"stuck": stuck}, timeouts={"stuck": 0.1})
    finally:
        stuck.release_all.set()
    assert [r.tool_errors for r in out.requests] == [1, 1]
    seen = " ".join(engine.contexts)
    assert "error: tool 'stuck' timed out" in seen and "KeyError" in seen
    assert out.tool_metrics["tool/stuck/timeout"] == 0.5 and out.tool_metrics["tool/stuck/raised"] == 0.5


def test_the_python_sandbox_through_the_loop_stops_a_program_that_loops_forever():
    from dapo_flow.tools.sandbox import PythonSandbox

    sandbox = PythonSandbox(PythonSandbox.Config(timeout_s=1.0))
    out, engine = _run({"p=": ["<call>python: while 1: pass</call>", "x"]}, {"python": sandbox},
                       timeouts={"python": 1.0})
    (r,) = out.requests
    assert r.tool_errors == 1 and r.stop == "answer" and "time" in engine.contexts[-1]


def test_tool_rewards_sum_calls_and_calc_reward_per_request():
    class FakePaid:
        name = "paid"
        schema = FakeStuck.schema | {"function": FakeStuck.schema["function"] | {"name": "paid"}}

        def create(self, instance_id, **kwargs): self.truth = kwargs["ground_truth"]
        def execute(self, instance_id, arguments): return ToolResult("ok", reward=0.25)
        def calc_reward(self, instance_id): return 1.0
        def release(self, instance_id): pass

    out, _ = _run({"q=": ["<call>paid: 1</call>", "<call>paid: 2</call>", "z"], "w=": ["z"]}, {"paid": FakePaid()})
    assert out.tool_rewards["paid"].tolist() == [1.5, 1.0]


def test_transitions_in_the_wrong_state_are_refused():
    r = Request(row=0, sample_idx=0, prompt_ids=[1], seed=0, budget=8, max_turns=2)
    with pytest.raises(TransitionError):
        r.turn([5], [0.0], True, ParsedCalls((), ()))
    r.start()
    with pytest.raises(TransitionError):
        r.observe([5], 0, 0)
