"""A built-in OpenEnv environment (graphs/openenv.yaml's): a calculator that pays for computing the
prompt's product, ``builtin:tool-arith``'s task as an environment server. Written with
openenv-core's server API (``pip install 'dapo-flow[openenv]'``; this module imports it, so only
the server process imports this module). A graph names its app, ``app:
dapo_flow.envs.calculator_env:app``, and dapo-flow serves it on a loopback port for the run; to
run it by hand instead (then give the graph ``url: http://127.0.0.1:8000``)::

    uvicorn dapo_flow.envs.calculator_env:app --host 127.0.0.1 --port 8000

``reset(ground_truth=P)`` takes the prompt's product; each step's action ``{"expression": "12*34"}``
is evaluated exactly (dapo-flow's calculator, never ``eval``) and answered with the value; the
value P pays 1.0 and ends the episode, any other value pays 0 and the model may go on.
"""

from __future__ import annotations

from typing import Any

from openenv.core.env_server import Action, Environment, Observation, State, create_app

from dapo_flow.tools.calculator import CalcError, evaluate, format_number


class CalcAction(Action):
    expression: str


class CalcObservation(Observation):
    result: str = ""


class ProductEnv(Environment[CalcAction, CalcObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True  # one instance per session (a batch's episodes run at once)

    def __init__(self) -> None:
        super().__init__()
        self._state, self.target = State(), ""

    def reset(self, seed: int | None = None, episode_id: str | None = None, ground_truth: str = "",
              **kwargs: Any) -> CalcObservation:
        self._state, self.target = State(episode_id=episode_id), str(ground_truth).strip()
        return CalcObservation(result="")

    def step(self, action: CalcAction, timeout_s: float | None = None, **kwargs: Any) -> CalcObservation:
        self._state.step_count += 1
        try:
            value = format_number(evaluate(action.expression))
        except CalcError as exc:
            return CalcObservation(result=f"error: {exc}", reward=0.0)
        solved = value == self.target
        return CalcObservation(result=value, reward=1.0 if solved else 0.0, done=solved)

    @property
    def state(self) -> State:
        return self._state


# val: 64 prompts x val_n 4 episodes at once
app = create_app(ProductEnv, CalcAction, CalcObservation, max_concurrent_envs=512)
