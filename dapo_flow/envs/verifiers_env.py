"""verifiers environments by id: their taskset as a prompt source (``verifiers:ENV_ID``), their
rollout and rubric as a harness of ``harness-generate`` (``harness: verifiers:ENV_ID``).

verifiers (``pip install 'dapo-flow[verifiers]'``, 0.4, its ``verifiers.v1`` API) finds an
environment by id as an installed package (``vf-calculator`` imports ``vf_calculator``) that
exports a ``Taskset`` subclass (the tasks), optionally an ``Env`` and a ``Harness``; its
``load_environment`` builds the ``Env``. Here:

- Source ``verifiers:ENV_ID`` with ``config:`` (the environment's args: its taskset config's
  fields, e.g. ``{split: val}``) and ``options: {path: DIR}`` (a folder put on ``sys.path``
  first, for an environment not installed: relative to the working directory). Each task the
  taskset yields is a row: its prompt (the task's system prompt and prompt as chat messages), and
  as ground truth a JSON object with the env id, its args, the folder and the task's data as the
  taskset made it, so any process can rebuild the task from the row alone.
- Harness ``verifiers:ENV_ID``: per sample, the environment's own episode
  (``Env.run_episode``: its agent, its harness program, then its task's ``@vf.reward``\\ s) with
  a model client pointed at dapo-flow's endpoint. verifiers' interception server (loopback) sits
  between the environment's program and the endpoint and passes the sample's episode header
  on, so the endpoint records the exact tokens of every model call (nothing is re-tokenized),
  and the sample's reward is the episode's: the sum of its trace's weighted rewards
  (``score`` with ``reward: builtin:harness``). An episode that verifiers records as failed (its
  program or a reward raised, a timeout) raises here: the sample is masked, the step goes on.

Without verifiers, or with an id no installed package (or ``options.path``) provides, a graph
naming either fails validation with the fix (:func:`source_problems`, :func:`harness_problem`).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

from dapo_flow.errors import DataError

PREFIX = "verifiers:"
INSTALL = "pip install 'dapo-flow[verifiers]'"
OPTIONS = ("path",)
EPISODE_HEADER = "X-Episode-Id"  # dapo_flow.endpoint.harness's (not imported: it needs openai)


def is_verifiers(source: str | None) -> bool:
    return bool(source) and source.startswith(PREFIX)


def env_name(ref: str) -> str:
    return ref[len(PREFIX):]


def installed() -> bool:
    return importlib.util.find_spec("verifiers") is not None


def library() -> Any:
    """``verifiers.v1``; a DataError naming the install command when it is missing."""
    try:
        import verifiers.v1 as vf
    except ImportError as exc:
        raise DataError(f"a verifiers environment needs the verifiers package ({exc})\n    fix: {INSTALL}") from None
    return vf


def _use_path(path: str | None) -> None:
    if path and path not in sys.path:
        sys.path.insert(0, path)


def resolve_path(options: dict[str, Any]) -> str | None:
    """``options.path`` as an absolute folder (None: the environment is installed)."""
    path = options.get("path")
    return str(Path(path).resolve()) if path else None


def source_problems(source: str, config: dict[str, Any], options: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(field, message, fix) for each thing wrong with a verifiers source that shows without
    importing verifiers (seconds) or the environment: the library missing, unknown options, a
    missing folder, an environment id nothing provides. Its args are checked when the taskset
    loads (a DataError naming them, :func:`records`)."""
    if not installed():
        return [("source", f"{source} needs the optional verifiers package, not installed", INSTALL)]
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        return [(f"options.{unknown[0]}", f"a verifiers source takes no option '{unknown[0]}'",
                 f"options: {list(OPTIONS)} (the environment's own args go under config:)")]
    path = resolve_path(options)
    if path and not Path(path).is_dir():
        return [("options.path", f"folder {options['path']} does not exist (resolved: {path})",
                 "give the folder that holds the environment's package, relative to where the run starts")]
    env_id = env_name(source)
    if not _findable(env_id, path):
        where = f", nor in {options['path']}" if path else ""
        return [("source", f"no verifiers environment '{env_id}' is installed (no package "
                 f"'{module_name(env_id)}'{where})", "pip install the environment's package, or set "
                 "options.path to the folder that holds it")]
    return []


def harness_problem(ref: str) -> str:
    """What is wrong with ``harness: verifiers:ENV_ID`` before the run ('' when nothing is)."""
    if not installed():
        return f"harness {ref!r} needs the optional verifiers package, not installed; fix: {INSTALL}"
    if not env_name(ref):
        return f"harness {ref!r} names no environment: write verifiers:ENV_ID"
    return ""


def module_name(env_id: str) -> str:
    """The package verifiers imports for ``env_id`` (its loader's rule: a Hub id ``owner/name@version``
    is installed as ``name``, dashes as underscores)."""
    return env_id.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()


def _findable(env_id: str, path: str | None) -> bool:
    name = module_name(env_id)
    if not name.isidentifier():
        return False
    if path and ((Path(path) / name).is_dir() or (Path(path) / f"{name}.py").is_file()):
        return True
    builtin = importlib.util.find_spec("verifiers").submodule_search_locations  # verifiers' own tasksets
    if any((Path(root) / "v1" / "tasksets" / name).is_dir() for root in builtin or ()):
        return True
    return importlib.util.find_spec(name) is not None


def env_config(env_id: str, env_args: dict[str, Any], path: str | None) -> Any:
    """The environment's validated config: ``env_args`` are its taskset config's fields; every
    agent role runs its program on this host (verifiers' ``subprocess`` runtime: the default,
    ``prime``, is a remote sandbox needing an account)."""
    from verifiers.v1.configs.agent import agent_config_fields

    vf = library()
    _use_path(path)
    taskset = {**env_args, "id": env_id}
    roles = agent_config_fields(vf.resolve_env_config({"taskset": taskset}))
    return vf.resolve_env_config({"taskset": taskset, **{role: {"runtime": {"type": "subprocess"}} for role in roles}})


@functools.lru_cache(maxsize=32)
def _env(env_id: str, args_json: str, path: str | None) -> Any:
    vf = library()
    return vf.load_environment(env_config(env_id, json.loads(args_json), path))


def load_env(env_id: str, env_args: dict[str, Any], path: str | None = None) -> Any:
    """The ``Env`` for (id, args), built once per process."""
    return _env(env_id, json.dumps(env_args, sort_keys=True), path)


def records(source: str, config: dict[str, Any], options: dict[str, Any], size: int | None) -> list[tuple[int, dict]]:
    """(index, row fields) of the taskset's first ``size`` tasks (all of a finite taskset)."""
    env_id, path = env_name(source), resolve_path(options)
    try:
        taskset = load_env(env_id, config, path).taskset
    except DataError:
        raise
    except Exception as exc:  # noqa: BLE001 - pydantic's errors, or the environment's own code
        raise DataError(f"{source}: cannot load the environment with config {config}: {_first_lines(exc)}\n"
                        "    fix: config: holds the fields of the environment's taskset config") from None
    if size is not None:
        taskset = taskset.take(size)
    elif not taskset.bounded:
        raise DataError(f"{source}: the taskset is infinite\n    fix: set `size:` next to `source:`")
    rows = []
    for position, task in enumerate(taskset):
        data = task.data
        payload = {"env": env_id, "env_args": config, "path": path, "task": data.model_dump(mode="json")}
        rows.append((position, {"prompt": _messages(data), "ground_truth": json.dumps(payload),
                                "extra_info": {"index": data.idx if data.idx is not None else position}}))
    return rows


def _messages(data: Any) -> list[dict[str, Any]]:
    """The task's opening as chat messages (what its harness sends first, for a chat loop)."""
    system = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str) or data.prompt is None:
        return system + [{"role": "user", "content": data.prompt or ""}]
    return system + [m.model_dump(mode="json", exclude_none=True) for m in data.prompt]


def harness(ref: str) -> Callable:
    """``async def run(client, task)`` playing one episode of environment ``ref``'s id on the
    row ``task`` through ``client``'s endpoint; returns the episode's reward. verifiers is
    imported here, not in the first episode (seconds that would hold every episode's loop)."""
    env_id = env_name(ref)
    library()

    async def run(client: Any, task: dict[str, Any]) -> float:
        vf = library()
        payload = _payload(task, env_id)
        env = load_env(env_id, payload["env_args"], payload["path"])
        task_cls = env.taskset.task_type()
        vtask = task_cls(task_cls.data_type().model_validate(payload["task"]), env.taskset.config.task)
        base_url = str(client.base_url).rstrip("/")
        headers = {EPISODE_HEADER: client.default_headers[EPISODE_HEADER]}
        ctx = vf.ModelContext(model=await _model(client),
                              client=vf.EvalClientConfig(base_url=base_url, api_key_var=_key_var(base_url, client.api_key),
                                                         headers=headers))
        try:
            episode = await env.run_episode(vtask, ctx)
        except SystemExit as exc:  # verifiers exits where it wants a login: the sample is masked, not the run
            raise RuntimeError(f"verifiers episode of {env_id} exited: {exc}") from None
        errors = list(episode.errors) + [e for t in episode.traces for e in t.errors]
        if not episode.ok or errors:
            raise RuntimeError(f"verifiers episode of {env_id} failed: "
                               + "; ".join(f"{e.type}: {e.message}" for e in errors)[:500])
        return float(sum(t.reward for t in episode.traces))

    return run


def _payload(task: dict[str, Any], env_id: str) -> dict[str, Any]:
    try:
        payload = json.loads(task["ground_truth"])
        if payload["env"] != env_id:
            raise ValueError(f"the row is environment {payload['env']!r}'s")
        return payload
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"row {task.get('prompt_id')!r} is not a task of verifiers:{env_id} ({exc}): read the "
                         f"prompts from source verifiers:{env_id}") from None


_MODELS: dict[str, str] = {}


async def _model(client: Any) -> str:
    """The endpoint's model name (one ``/v1/models`` per endpoint and process)."""
    key = str(client.base_url)
    if key not in _MODELS:
        _MODELS[key] = (await client.models.list()).data[0].id
    return _MODELS[key]


def _key_var(base_url: str, token: str) -> str:
    """The environment variable verifiers reads the endpoint's token from (its clients take a
    variable's name, not a key); named so verifiers' subprocess runtime keeps it from programs."""
    name = "DAPO_FLOW_ENDPOINT_API_KEY_" + hashlib.sha256(f"{base_url} {token}".encode()).hexdigest()[:12]
    os.environ[name] = token
    return name


def _first_lines(exc: BaseException, lines: int = 3) -> str:
    return " / ".join(str(exc).strip().splitlines()[:lines]) or type(exc).__name__
