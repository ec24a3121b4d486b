"""A TEST OpenEnv environment (for tests/envs/test_openenv.py only): guess the number, written
with openenv-core's server API and served like any OpenEnv app (``uvicorn``, here through
``python -m dapo_flow.envs.serve tests/envs/openenv_test_env.py:app PORT``).

``reset(ground_truth=N)`` hides N; each step's action ``{"guess": "K"}`` answers ``higher`` /
``lower`` (reward -0.25) or ``correct`` (reward 1.0, done). Test hooks: ``sleep S`` sleeps S
seconds before answering (timeouts), ``boom`` raises in the environment (an execution error).
Every reset and step is recorded, and ``GET /test/log`` returns the record, so a test can see
what reached the server.
"""

from __future__ import annotations

import time
from typing import Any

from openenv.core.env_server import Action, Environment, Observation, State, create_app

LOG: list[dict[str, Any]] = []  # this server process's resets and steps, in order


class GuessAction(Action):
    guess: str


class GuessObservation(Observation):
    feedback: str = ""


class GuessTestEnv(Environment[GuessAction, GuessObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True  # one instance per session, nothing shared but LOG

    def __init__(self) -> None:
        super().__init__()
        self._state, self.target = State(), 0

    def reset(self, seed: int | None = None, episode_id: str | None = None, ground_truth: str | None = None,
              **kwargs: Any) -> GuessObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        self.target = int(ground_truth)
        LOG.append({"kind": "reset", "episode": episode_id, "seed": seed, "target": self.target,
                    "extra": sorted(kwargs)})
        return GuessObservation(feedback="guess a number")

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:
        self._state.step_count += 1
        LOG.append({"kind": "step", "episode": self._state.episode_id, "guess": action.guess})
        if action.guess.startswith("sleep "):
            time.sleep(float(action.guess.split()[1]))
        if action.guess == "boom":
            raise ValueError("the test environment blew up")
        guess = int(action.guess)
        if guess == self.target:
            return GuessObservation(feedback="correct", reward=1.0, done=True)
        return GuessObservation(feedback="higher" if guess < self.target else "lower", reward=-0.25)

    @property
    def state(self) -> State:
        return self._state


app = create_app(GuessTestEnv, GuessAction, GuessObservation, max_concurrent_envs=64)


@app.get("/test/log")
def _log() -> list[dict[str, Any]]:
    return LOG
