"""Policy backends and model resolution.

``resolve_model("builtin:tiny-adder")`` (or ``builtin:tiny-chat``, ``builtin:tiny-agent``, ``builtin:tiny-moe``) builds the model on first use and caches it under
``dapo_flow_home()/models``; any other string must be a local Hugging Face causal-LM directory
(nothing is downloaded from the Hub). Backends: ``models.hf.HFPolicy`` (torch) and
``models.vllm_engine.VLLMGenerator``. Importing this package loads neither torch nor vLLM.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from dapo_flow.errors import ModelError
from dapo_flow.home import dapo_flow_home
from dapo_flow.models.heads import SCALAR_SUFFIXES  # a critic's or reward model's directory loads too

BUILTIN_PREFIX = "builtin:"
FIX = "point `path:` at a local Hugging Face model directory (config.json + weights)"
CAUSAL_LM_SUFFIXES = ("ForCausalLM", "LMHeadModel")  # e.g. LlamaForCausalLM, GPT2LMHeadModel


@dataclass(frozen=True)
class Builtin:
    """A built-in model: ``module`` builds it (its ``builder`` function, ``RECIPE_VERSION`` and
    ``shape_config()``), imported only when one of these is used, so that importing this package
    loads neither torch nor transformers."""

    module: str
    builder: str
    tokenizer: str  # its tokenizer's family: builtins of one family read each other's token ids

    def build(self, out_dir: Path, progress: bool) -> Path:
        return getattr(self._module(), self.builder)(out_dir, progress=progress)

    def version(self) -> int:
        """The recipe version: part of the cache path, so a new recipe builds anew."""
        return self._module().RECIPE_VERSION

    def shape(self) -> dict | None:
        """The config.json keys that size the model, known before it is built."""
        return self._module().shape_config()

    def _module(self):
        return importlib.import_module(self.module)


BUILTINS: dict[str, Builtin] = {
    "tiny-adder": Builtin("dapo_flow.recipes.tiny_adder", "build_tiny_adder", "char"),
    "tiny-chat": Builtin("dapo_flow.recipes.tiny_chat", "build_tiny_chat", "chat-bpe"),
    "tiny-adder-critic": Builtin("dapo_flow.recipes.tiny_adder_critic", "build_tiny_adder_critic", "char"),
    "tiny-adder-rm": Builtin("dapo_flow.recipes.tiny_adder_rm", "build_tiny_adder_rm", "char"),
    "tiny-adder-judge": Builtin("dapo_flow.recipes.tiny_adder_judge", "build_tiny_adder_judge", "char"),
    "tiny-agent": Builtin("dapo_flow.recipes.tiny_agent", "build_tiny_agent", "char"),
    "tiny-adder-teacher": Builtin("dapo_flow.recipes.tiny_adder_teacher", "build_tiny_adder_teacher", "char"),
    # a Qwen3-MoE (4 experts, top-2) on tiny-adder's task and tokenizer
    "tiny-moe": Builtin("dapo_flow.recipes.tiny_moe", "build_tiny_moe", "char"),
    # printable-ASCII characters, not tiny-adder's arithmetic ones: its own family
    "tiny-gym": Builtin("dapo_flow.recipes.tiny_gym", "build_tiny_gym", "char-ascii"),
}


def builtin_dir(name: str) -> Path:
    """Cache directory of a builtin model (it may not exist yet)."""
    if name not in BUILTINS:
        raise ModelError(f"unknown builtin model '{BUILTIN_PREFIX}{name}'; builtins: {_builtin_names()}")
    return dapo_flow_home() / "models" / f"{name}-v{BUILTINS[name].version()}"


def build_builtin(name: str, *, force: bool = False, progress: bool = True) -> Path:
    """Build a builtin model into the cache (unless cached and not ``force``); returns its dir.

    Safe across processes: builds into a temp dir beside the target under a file lock, then
    renames it into place, so readers never see a half-written model.
    """
    from filelock import FileLock

    final = builtin_dir(name)
    final.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(final) + ".lock"):
        if final.is_dir() and not force:
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
        try:
            BUILTINS[name].build(tmp, progress)
            tmp.chmod(0o755)  # mkdtemp makes it owner-only; the cache is meant to be shared
            if final.exists():  # force: move the old build aside first, rename is atomic
                old = Path(tempfile.mkdtemp(prefix=f".{final.name}-old-", dir=final.parent))
                os.rename(final, old / final.name)
                shutil.rmtree(old)
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def model_config(path: str) -> dict | None:
    """A model's config.json as a dict without building or loading anything: a builtin's declared
    shape, a local directory's file; None when there is none to read (loading reports why)."""
    if path.startswith(BUILTIN_PREFIX):
        name = path[len(BUILTIN_PREFIX):]
        return BUILTINS[name].shape() if name in BUILTINS else None
    try:
        config = json.loads((Path(path).expanduser() / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def reads_tokens_of(reader: str, writer: str) -> bool | None:
    """Whether model ``reader`` reads the token ids model ``writer`` writes as ``writer`` means
    them: every token of the writer's vocabulary has the same id in the reader's (the reader may
    add tokens of its own, e.g. a reward model's pad token). Builtins compare their tokenizer
    families; local directories (and built builtins) their tokenizer.json. None when it cannot
    be told without loading anything: a directory without a readable tokenizer.json, a builtin
    not built yet beside a directory."""
    if reader.startswith(BUILTIN_PREFIX) and writer.startswith(BUILTIN_PREFIX):
        families = [BUILTINS.get(p[len(BUILTIN_PREFIX):]) for p in (reader, writer)]
        return None if None in families else families[0].tokenizer == families[1].tokenizer
    theirs, ours = _token_ids(writer), _token_ids(reader)
    if theirs is None or ours is None:
        return None
    return all(ours.get(token) == i for token, i in theirs.items())


def _token_ids(path: str) -> dict[str, int] | None:
    """token -> id of a model's tokenizer.json (its vocabulary and added tokens), None when there
    is none to read (a builtin not built yet, another tokenizer format)."""
    if path.startswith(BUILTIN_PREFIX):
        name = path[len(BUILTIN_PREFIX):]
        if name not in BUILTINS or not builtin_dir(name).is_dir():
            return None
        path = str(builtin_dir(name))
    file = Path(path).expanduser() / "tokenizer.json"
    try:
        stat = file.stat()
    except OSError:
        return None
    return _tokenizer_json_ids(str(file), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=16)
def _tokenizer_json_ids(file: str, mtime_ns: int, size: int) -> dict[str, int] | None:
    """The ids of one version of a tokenizer.json (the cache key includes its mtime and size:
    a validate in a long-lived process reads a file changed since)."""
    try:
        doc = json.loads(Path(file).read_text(encoding="utf-8"))
        vocab = doc["model"]["vocab"]
        # BPE / WordPiece / WordLevel: {token: id}; Unigram: [[piece, score], ...] in id order
        ids = dict(vocab) if isinstance(vocab, dict) else {piece: i for i, (piece, _) in enumerate(vocab)}
        ids.update({t["content"]: t["id"] for t in doc.get("added_tokens") or ()})
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return ids if all(isinstance(i, int) for i in ids.values()) else None


def model_head(path: str, head: str | None = None) -> str:
    """What a model is: ``head`` when given (`lm`, `value` or `reward`), else read from its config
    (``models.heads.head_of_config``: a token classifier is a value model, a sequence classifier
    a reward model); `lm` when no config
    can be read yet (loading reports why)."""
    from dapo_flow.models.heads import head_of_config

    return head if head is not None else head_of_config(model_config(path))


def resolve_model(path: str, *, progress: bool = True) -> Path:
    """A model directory for ``path``: a builtin (built and cached on first use) or a local dir."""
    if path.startswith(BUILTIN_PREFIX):
        name = path[len(BUILTIN_PREFIX) :]
        cached = builtin_dir(name)
        return cached if cached.is_dir() else build_builtin(name, progress=progress)
    model_dir = Path(path).expanduser()
    fix = _fix_for(model_dir)
    if not model_dir.exists():
        raise ModelError(f"model path '{path}' does not exist; {fix}, or use one of {_builtin_names()}")
    if not model_dir.is_dir():
        raise ModelError(f"model path '{path}' is a file, not a directory; {fix}")
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        raise ModelError(f"model path '{path}' has no config.json; {fix}")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelError(f"{config_file} is not valid JSON ({exc}); {fix}") from None
    problem = _not_causal_lm(config)
    if problem:
        lm = " of a causal (decoder-only) LM" if fix == FIX else ""
        raise ModelError(f"model path '{path}': {problem}; {fix}{lm}")
    return model_dir.resolve()


def _fix_for(model_dir: Path) -> str:
    """The fix for a model directory that does not load: a checkpoint's model (written by a
    run: ``step_*/models/NAME``, beside the checkpoint's driver.json) is damaged, and the user
    never wrote a `path:` for it; any other is the graph's `path:`."""
    step = model_dir.parent.parent
    if model_dir.parent.name == "models" and (step / "driver.json").is_file():
        return (f"checkpoint {step} is damaged: `dapo-flow run GRAPH --resume` falls back to the "
                "run's previous intact checkpoint (eval: pass an older --checkpoint), or run "
                "without --resume to start a new run")
    return FIX


def _not_causal_lm(config: dict) -> str | None:
    """Why ``config`` does not describe a causal LM, or None when it does."""
    archs = config.get("architectures") or []
    if any(a.endswith(CAUSAL_LM_SUFFIXES + SCALAR_SUFFIXES) for a in archs):
        return None
    model_type = config.get("model_type")
    if not archs and model_type:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            return None
    if not archs and not model_type:
        return "config.json names neither `architectures` nor `model_type`"
    what = ", ".join(archs) if archs else f"model_type {model_type!r}"
    return f"config.json describes {what}, not a causal LM"


def _builtin_names() -> str:
    return ", ".join(BUILTIN_PREFIX + n for n in BUILTINS)
