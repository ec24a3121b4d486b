"""Load user code named as `package.module:Name` or `path/to/file.py:Name`."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from dapo_flow.errors import DapoFlowError


class ImportSpecError(DapoFlowError):
    """A `module:Name` / `file.py:Name` reference cannot be loaded."""


def load_object(ref: str, *, base_dir: Path | None = None) -> Any:
    """Return the object ``ref`` names; relative file paths resolve against ``base_dir``."""
    target, sep, name = ref.rpartition(":")
    if not sep or not target or not name:
        raise ImportSpecError(
            f"'{ref}' is not a reference: write `package.module:Name` or `path/to/file.py:Name`"
        )
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_absolute() and base_dir is not None and not path.exists():
            path = base_dir / path
        if not path.is_file():
            raise ImportSpecError(f"'{ref}': file {path} does not exist")
        mod_name = f"dapo_flow_user_{abs(hash(str(path.resolve())))}"
        module = sys.modules.get(mod_name)
        if module is None:
            spec = importlib.util.spec_from_file_location(mod_name, path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            try:
                spec.loader.exec_module(module)
            except Exception as exc:  # user code: report, don't crash with its traceback
                raise ImportSpecError(f"'{ref}': importing {path} failed: {exc!r}") from exc
            sys.modules[mod_name] = module
    else:
        try:
            module = importlib.import_module(target)
        except Exception as exc:
            raise ImportSpecError(f"'{ref}': cannot import module '{target}': {exc!r}") from exc
    try:
        return getattr(module, name)
    except AttributeError:
        raise ImportSpecError(f"'{ref}': module '{target}' has no attribute '{name}'") from None
