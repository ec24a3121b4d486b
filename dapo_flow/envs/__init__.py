"""Environments a multi-turn rollout acts in, served by other projects: as tools of
``agent-generate``, or whole (their tasks, rollout and reward) through ``harness-generate``.

- :mod:`~dapo_flow.envs.openenv`: an OpenEnv environment server (``impl: openenv``): the
  model's calls are its actions, its observations the responses, its rewards the tool's, its
  ``done`` the end of the sample.
- :mod:`~dapo_flow.envs.serve`: an OpenEnv app served on a loopback port for the run.
- :mod:`~dapo_flow.envs.calculator_env`: a built-in OpenEnv environment (imports openenv-core):
  ``builtin:tool-arith``'s calculator, paying for the prompt's product (graphs/openenv.yaml).
- :mod:`~dapo_flow.envs.verifiers_env`: a verifiers environment by id: its taskset as prompts
  (``source: verifiers:ENV_ID``), its episodes and rubric as a harness (``harness: verifiers:ENV_ID``).
"""
