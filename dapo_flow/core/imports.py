"""Load user code named as `package.module:Name` or `path/to/file.py:Name`; keep transformers from
importing what a language model never uses."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from dapo_flow.errors import DapoFlowError


class ImportSpecError(DapoFlowError):
    """A `module:Name` / `file.py:Name` reference cannot be loaded."""


def load_object(ref: str, *, base_dir: Path | None = None) -> Any:
    """Return the object ``ref`` names. A relative file path resolves against ``base_dir`` (the
    graph's folder) only, so a graph loads the same code whatever the working directory;
    without ``base_dir``, against the working directory. Importing runs the module's top-level
    code: anything it raises, ``SystemExit`` included, is an ImportSpecError."""
    target, sep, name = ref.rpartition(":")
    if not sep or not target or not name:
        raise ImportSpecError(
            f"'{ref}' is not a reference: write `package.module:Name` or `path/to/file.py:Name`"
        )
    if target.endswith(".py"):
        module = _load_file(ref, _resolve(Path(target), base_dir))
    else:
        try:
            module = importlib.import_module(target)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # user code: report, don't crash or exit with it
            raise ImportSpecError(f"'{ref}': cannot import module '{target}': {_describe(exc)}") from exc
    try:
        return getattr(module, name)
    except AttributeError:
        raise ImportSpecError(f"'{ref}': module '{target}' has no attribute '{name}'") from None


def _resolve(path: Path, base_dir: Path | None) -> Path:
    if path.is_absolute() or base_dir is None:
        return path
    return base_dir / path


def _load_file(ref: str, path: Path) -> ModuleType:
    if not path.is_file():
        where = "" if path.is_absolute() else f" (resolved: {path.resolve()})"
        raise ImportSpecError(f"'{ref}': file {path} does not exist{where}")
    mod_name = f"dapo_flow_user_{abs(hash(str(path.resolve())))}"
    module = sys.modules.get(mod_name)
    if module is not None:
        return module
    spec = importlib.util.spec_from_file_location(mod_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # user code: report, don't crash or exit with its traceback
        raise ImportSpecError(f"'{ref}': importing {path} failed: {_describe(exc)}") from exc
    sys.modules[mod_name] = module
    return module


def _describe(exc: BaseException) -> str:
    if isinstance(exc, SystemExit):
        return f"its top-level code called sys.exit({exc.code!r}) (importing runs it)"
    return repr(exc)


#: transformers imports these, when installed, for features a language model's training and
#: sampling never reach (sklearn: assisted decoding's confidence threshold; scipy: the object-
#: detection losses): 1.8 of the ~6.4 CPU seconds a fresh process spends importing a model class
#: (mlflow installs scikit-learn, so both are there). Each actor and worker process pays it.
NOT_NEEDED_BY_LMS = ("is_sklearn_available", "is_scipy_available")


def skip_unneeded_transformers_imports() -> None:
    """Tell transformers that sklearn and scipy are absent, before its modeling code is first
    imported in this process (a no-op after that, or if transformers renames the checks)."""
    import sys

    if "transformers.modeling_utils" in sys.modules:
        return
    import transformers.utils
    import transformers.utils.import_utils

    for name in NOT_NEEDED_BY_LMS:
        for module in (transformers.utils, transformers.utils.import_utils):
            if hasattr(module, name):
                setattr(module, name, _absent)


def _absent() -> bool:
    return False
