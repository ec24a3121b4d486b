"""OpenEnv environments as agent-generate's environment (dapo_flow/envs/openenv.py), against a real
OpenEnv server of the tests' own (tests/envs/openenv_test_env.py, guess the number) on loopback:
an episode per sample, actions reaching the server, observations as masked tokens, rewards and
done; environment errors, timeouts, a server killed mid-rollout and one never there."""

from __future__ import annotations

import string
from pathlib import Path

import httpx
import numpy as np
import pyarrow as pa
import pytest

from dapo_flow.agent.rollout import AgentLimits, run_agent
from dapo_flow.core.contract import OpContext
from dapo_flow.envs.serve import LoopbackServer
from dapo_flow.errors import RunError
from dapo_flow.models.sampling import Rollouts, SamplingConfig
from dapo_flow.models.tokenizer import build_char_tokenizer
from dapo_flow.operators.score import Params as ScoreParams, Score
from dapo_flow.core.ports import free_port
from dapo_flow.tools import ToolSpec, load_tool

HERE = Path(__file__).resolve().parent
APP = f"{HERE / 'openenv_test_env.py'}:app"
TOK = build_char_tokenizer(string.digits + string.ascii_letters + " <>/:.,'()_-=!?*\"")
EOS = TOK.eos_token_id


class FakeTurnsEngine:
    """A fake engine (named so): prompt text -> the texts of its turns, in order, each ended by
    EOS; ``on_call(k)`` runs before the k-th generate call (0-based)."""

    weights_version = 0

    def __init__(self, script: dict[str, list[str]], on_call=None):
        self.script, self.calls, self.on_call = script, 0, on_call

    def generate(self, prompts: list[list[int]], cfg: SamplingConfig) -> Rollouts:
        if self.on_call is not None:
            self.on_call(self.calls)
        self.calls += 1
        ids = []
        for context in prompts:
            text = TOK.decode(context, skip_special_tokens=True)
            prompt = next(p for p in self.script if text.startswith(p))
            turn = TOK.decode(context, skip_special_tokens=False).count(TOK.eos_token)
            ids.append(TOK.encode(self.script[prompt][turn], add_special_tokens=False) + [EOS])
        k = len(prompts)
        return Rollouts(np.arange(k, dtype=np.int32), np.zeros(k, np.int32), ids, [[-0.5] * len(t) for t in ids],
                        np.zeros(k, bool), tokens_generated=sum(map(len, ids)), seconds=0.01)


def guess_env(timeout_s: float = 5.0, **config):
    return load_tool(ToolSpec(name="guess", impl="openenv", timeout_s=timeout_s,
                              config={"action_field": "guess", "observation_field": "feedback", **config}))


def rollout(env, script: dict[str, list[str]], truths: list[str], *, n: int = 1, on_call=None):
    engine = FakeTurnsEngine(script, on_call)
    return run_agent(engine, TOK, {"guess": env}, {"guess": env.config.timeout_s},
                     [TOK.encode(p) for p in script],
                     [{"ground_truth": t, "prompt_id": p} for p, t in zip(script, truths)],
                     list(range(len(script))), SamplingConfig(n=n, temperature=1.0), AgentLimits(4, 1, 600, "compact"))


@pytest.fixture(scope="module")
def server():
    served = LoopbackServer(APP)
    yield served
    served.stop()


def server_log(url: str) -> list[dict]:
    return httpx.get(f"{url}/test/log").json()


@pytest.mark.slow  # an OpenEnv server's start (~10 s: openenv-core imports gradio)
def test_each_sample_is_an_episode_its_calls_are_steps_its_observations_masked(server):
    env = guess_env(url=server.url)
    before = len(server_log(server.url))
    out = rollout(env, {"g42 ": ["<call>guess: 50</call>", "<call>guess: 42</call>", "unreached"],
                        "g7 ": ["<call>guess: 3</call>", "it is 3"]}, ["42", "7"], n=2)
    log = server_log(server.url)[before:]
    resets = [e for e in log if e["kind"] == "reset"]
    ids = [f"{r.row}-{r.sample_idx}-{r.seed}" for r in out.requests]
    assert [e["episode"] for e in resets] == ids  # one episode per sample, in order
    assert [e["target"] for e in resets] == [42, 42, 7, 7]  # reset got the row's ground truth
    assert len({e["seed"] for e in resets}) == 4 and all(e["extra"] == ["prompt_id"] for e in resets)
    steps = {i: [e["guess"] for e in log if e["kind"] == "step" and e["episode"] == i] for i in ids}
    assert list(steps.values()) == [["50", "42"], ["50", "42"], ["3"], ["3"]]  # the calls' actions
    first, third = out.requests[0], out.requests[2]
    assert (first.stop, first.turns, third.stop, third.turns) == ("done", 2, "answer", 2)
    text = TOK.decode(first.response_ids)
    assert text.count("<result>lower</result>") == 1 and "correct" not in text  # done: the last one unshown
    observed = len("<result>lower</result>")  # a token per character
    (start,) = [a for role, a, _ in first.segments if role == "tool"]
    assert TOK.decode(first.response_ids[start:start + observed]) == "<result>lower</result>"
    assert first.loss_mask[start:start + observed] == [0] * observed
    assert sum(first.loss_mask) == len(first.response_ids) - observed  # the model's tokens, all of them
    # the steps' rewards summed: -0.25 + 1.0 for the solved episodes, -0.25 for the others
    assert out.tool_rewards["guess"].tolist() == [0.75, 0.75, -0.25, -0.25]
    assert out.tool_metrics["tool/guess/done"] == pytest.approx(2 / 6)


@pytest.mark.slow  # shares the module's server, and waits out a 1 s step timeout
def test_environment_errors_are_observations_and_a_timeout_ends_the_episode(server):
    env = guess_env(timeout_s=1.0, url=server.url)
    out = rollout(env, {"g5 ": ["<call>guess: boom</call>", "<call>guess: x</call>", "<call>guess: sleep 3</call>",
                                "unreached"]}, ["5"])
    (r,) = out.requests
    text = TOK.decode(r.response_ids)
    assert text.count("error: the environment: Server error") == 2  # the session went on after each
    assert (r.stop, r.turns, r.tool_errors) == ("done", 3, 3)  # the timeout ended the sample
    assert out.tool_metrics["tool/guess/timeout"] == pytest.approx(1 / 3)


@pytest.mark.slow  # shares the module's server
def test_more_episodes_than_the_server_allows_is_a_run_error_with_the_fix(server):
    with pytest.raises(RunError, match=rf"(?s)OpenEnv server at {server.url} refused a session .*"
                                       r".*max_concurrent_envs=N"):
        rollout(guess_env(url=server.url, connect_timeout_s=1.0), {"g1 ": ["<call>guess: 1</call>"]}, ["1"],
                n=65)  # it allows 64


@pytest.mark.slow  # a server of its own (~10 s to start), killed with SIGKILL
def test_a_server_killed_mid_rollout_stops_the_step_naming_its_url():
    served = LoopbackServer(APP)
    env = guess_env(url=served.url)

    def kill_before_second_turn(call: int) -> None:
        if call == 1:
            served.proc.kill()
            served.proc.wait()

    with pytest.raises(RunError, match=rf"OpenEnv server at {served.url} went away mid-episode \(2 episode"):
        rollout(env, {"g9 ": ["<call>guess: 1</call>", "<call>guess: 9</call>"]}, ["9"], n=2,
                on_call=kill_before_second_turn)
    served.stop()


@pytest.mark.slow  # a server of its own (~10 s to start)
def test_a_served_app_dies_with_the_process_that_served_it(tmp_path):
    """The owner killed with SIGKILL (no finalizer runs): the kernel's parent-death signal stops
    the server."""
    import os
    import signal
    import subprocess
    import sys
    import time

    owner = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from dapo_flow.envs.serve import LoopbackServer; "
        f"s = LoopbackServer({APP!r}); print(s.proc.pid, flush=True); time.sleep(600)")],
        stdout=subprocess.PIPE, text=True)
    server_pid = int(owner.stdout.readline())
    os.kill(owner.pid, signal.SIGKILL)
    owner.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _alive(server_pid):
        time.sleep(0.1)
    assert not _alive(server_pid)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def test_an_unreachable_server_is_a_run_error_naming_the_url():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(RunError, match=rf"tool 'guess': create\(\): cannot reach the OpenEnv server at {url}"):
        rollout(guess_env(url=url, connect_timeout_s=2.0), {"g1 ": ["<call>guess: 1</call>"]}, ["1"])


def test_tool_reward_is_the_score_and_its_sign_the_accuracy():
    op = Score(ScoreParams(reward="builtin:tool-reward"), OpContext(node_id="verify"))
    batch = pa.table({"response_text": ["a", "b", "c"], "ground_truth": ["1", "2", "3"],
                      "tool_reward": pa.array([0.75, -0.25, 0.0], pa.float32())})
    out = op(batch)
    assert out.column("score").to_pylist() == [0.75, -0.25, 0.0]
    assert out.column("acc").to_pylist() == [1.0, 0.0, 0.0]


ROOT = HERE.parents[1]


@pytest.mark.slow  # a 2-step local run of graphs/openenv.yaml, its environment served by dapo-flow (~1 min)
@pytest.mark.models("tiny-agent")
def test_the_openenv_graph_runs_with_the_environment_it_serves(tmp_path, monkeypatch):
    from rich.console import Console

    from dapo_flow.graph.edits import edit_file, parse_cli_edits
    from dapo_flow.graph.plan import Cluster
    from dapo_flow.runtime import execute
    from dapo_flow.tracking import read_run

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    edits = [("set", "run.steps=2"), ("set", "run.val_every=0"), ("set", "run.checkpoint_every=0"),
             ("set", "data.val.size=8"), ("set", "run.gen_prompts_per_batch=16"), ("set", "run.prompts_per_step=8")]
    placed = edit_file(str(ROOT / "graphs" / "openenv.yaml"), parse_cli_edits(edits)).compile(Cluster(cpus=2))
    summary = execute(placed, executor="local", console=Console(file=open(tmp_path / "log.txt", "w")))
    history = read_run(summary["tracking_uri"], summary["run_id"])["history"]
    assert len(history["batch/acc_mean"]) == 2
    # episodes the environment ended (a right product), and its rewards as the samples' scores
    assert all(v > 0 for _, v in history["agent/stop_done"])
    assert all(v > 0 for _, v in history["tool/calculator/reward"])
    assert all(0 < v < 1 for _, v in history["batch/acc_mean"])
