"""Checkpoints: model weights, optimizer/scheduler/op states, data cursor, RNG, MLflow run id,
and the kept groups carried to the next step (run.carry_surplus) and the next steps' batches
a one_step_off or async run collected already, as Arrow IPC files.

Layout: ``{graph folder}/{MLflow run id}/step_NNNNNN/`` — one folder per run, so runs of the
same graph never overwrite each other. Checkpoints of dapo-flow versions before that sit
directly in the graph folder (``{graph folder}/step_NNNNNN/``); :func:`runs` reads them as
the runs their ``driver.json`` names and :func:`adopt_legacy` moves them into run folders.

A checkpoint is written to a temporary folder and renamed into place, so a crash mid-write
never leaves a checkpoint that looks complete. Its last file is a manifest of every other
file's size and SHA-256: :func:`verify` finds a checkpoint damaged afterwards (a truncated
file, a disk error) before anything loads it. ``latest()`` finds the newest complete one.

A write that fails for the storage's sake (a full disk or quota, a read-only or vanished
folder: an OSError, torch.save's writer error, safetensors' I/O error, also from inside an
actor) leaves no half-written folder and raises :class:`~dapo_flow.errors.CheckpointWriteError`
naming the checkpoint, the cause and the fix; the previous checkpoint is untouched.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch

from dapo_flow.errors import ActorFault, CheckpointWriteError
from dapo_flow.runtime.driver_state import DriverState

DRIVER_FILE = "driver.json"
OPS_FILE = "ops.pt"
CARRY_FILE = "carry.arrow"
AHEAD_FILE = "ahead_{}.arrow"  # one_step_off, async: the next steps' batches, collected already
MANIFEST_FILE = "manifest.json"  # written last: sizes and checksums of the other files
STEP_PREFIX = "step_"
DAMAGED_PREFIX = "damaged_"  # a damaged checkpoint moved aside by a resume (never listed again)

_NO_SPACE = {errno.ENOSPC, errno.EDQUOT}
_NO_WRITE = {errno.EACCES, errno.EPERM, errno.EROFS}


def step_dir(root: Path, step: int) -> Path:
    return root / f"{STEP_PREFIX}{step:06d}"


def step_of(path: Path) -> int:
    return int(path.name.removeprefix(STEP_PREFIX))


def save(root: Path, step: int, *, driver: DriverState, op_states: dict[str, Any],
         save_models, carry: pa.Table | None = None, ahead: list[pa.Table | None] = ()) -> Path:
    """``save_models(dir)`` writes the trained models' HF directories into ``dir``;
    ``carry`` is the table of groups carried over to the next step, if any; ``ahead`` the next
    steps' batches a one_step_off or async run has collected already (None: a step that trains
    nothing). ``root`` is the run's folder."""
    final = step_dir(root, step)
    tmp = root / f".tmp_{final.name}"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "models").mkdir(parents=True)
        save_models(tmp / "models")
        torch.save(op_states, tmp / OPS_FILE)
        for name, table in ((CARRY_FILE, carry), *((AHEAD_FILE.format(i), t) for i, t in enumerate(ahead))):
            if table is not None:
                with pa.OSFile(str(tmp / name), "wb") as sink, pa.ipc.new_file(sink, table.schema) as out:
                    out.write_table(table)
        (tmp / DRIVER_FILE).write_text(driver.model_dump_json(indent=2))
        _write_manifest(tmp)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)  # a half-written checkpoint never stays
        code = write_failure(exc)
        if code is False:
            raise  # not the storage's doing: a bug, a dead actor
        # disk full, quota, permissions, the folder gone: the previous checkpoint stays whole
        before = latest(root)
        why = _why(exc, code, root)
        fix = _write_fix(code, root)
        raise CheckpointWriteError(
            f"could not write checkpoint {final}: {why}\n    the previous checkpoint "
            f"{'is ' + str(before) if before else 'does not exist'} (intact)\n    fix: "
            f"{fix}, then `dapo-flow run GRAPH --resume`", path=final, why=why, fix=fix,
        ) from exc
    return final


_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how Rust writers (safetensors) name an errno
# torch.save's C++ writer on a failed write (a full disk): a RuntimeError without the errno
_TORCH_WRITER = ("PytorchStreamWriter", "inline_container", "file write failed")


def write_failure(exc: BaseException) -> int | None | bool:
    """Whether ``exc`` (or what caused it: on Ray the actor's own error) is a failed write to
    storage: its errno, None when the writer did not say which (torch.save's), False when it is
    something else."""
    if isinstance(exc, ActorFault):
        return False  # an actor died while it wrote: a fault to recover from, not the storage's
    seen = set()
    while isinstance(exc, BaseException) and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and isinstance(exc.errno, int):
            return exc.errno
        match = _OS_ERROR.search(str(exc))
        if match and "I/O error" in str(exc):
            return int(match.group(1))
        if isinstance(exc, RuntimeError) and any(s in str(exc) for s in _TORCH_WRITER):
            return None
        cause = getattr(exc, "cause", None)  # Ray's RayTaskError: the actor's own exception
        exc = cause if isinstance(cause, BaseException) else exc.__cause__
    return False


def _why(exc: BaseException, code: int | None, root: Path) -> str:
    """The failure in words, with the free space of the disk where it tells something."""
    text = os.strerror(code) if code else "the write failed"
    if code is None or code in _NO_SPACE or code == errno.EFBIG:
        with contextlib.suppress(OSError):
            free = shutil.disk_usage(_existing(root)).free
            text += f" ({free / 2**20:.0f} MiB free on its disk)"
    return text


def _existing(path: Path) -> Path:
    """``path`` or the nearest folder above it that exists."""
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def _write_fix(code: int | None, root: Path) -> str:
    """What to do about a failed checkpoint write, by its cause (errno)."""
    if code in _NO_SPACE or code == errno.EFBIG:
        return f"free space under {root} (run.keep_checkpoints bounds it)"
    if code in _NO_WRITE:
        return (f"make {root} writable (its permissions, or a read-only filesystem), or run "
                "from a folder you can write (checkpoints go under ./dapo-flow-runs)")
    if code == errno.ENOENT:
        return f"check that {root} stays there (deleted while the run wrote it? a disk unmounted?)"
    return f"check that {root} can be written (free space, permissions)"


# --- integrity: a manifest of sizes and checksums, written last -------------------------------


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _write_manifest(folder: Path) -> None:
    files = {p.relative_to(folder).as_posix(): {"size": p.stat().st_size, "sha256": _sha256(p)}
             for p in _files(folder)}
    (folder / MANIFEST_FILE).write_text(json.dumps({"version": 1, "files": files}, indent=1))


def verify(path: Path) -> str | None:
    """Why checkpoint ``path`` is damaged (a file missing, truncated or changed since it was
    written), or None when it is intact. Checkpoints without a manifest (older dapo-flow
    versions) can only be checked for a readable driver.json."""
    manifest = path / MANIFEST_FILE
    if not manifest.is_file():
        try:
            load_driver(path)
        except (OSError, ValueError) as exc:
            return f"{DRIVER_FILE} is unreadable ({exc})"
        return None
    try:
        files = json.loads(manifest.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{MANIFEST_FILE} is unreadable ({exc})"
    for name, expected in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        size = file.stat().st_size
        if size != expected["size"]:
            return f"{name} is {size} bytes, {expected['size']} when written (truncated?)"
        if _sha256(file) != expected["sha256"]:
            return f"{name} differs from what was written (checksum mismatch)"
    return None


def newest_intact(found: list[Path]) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest of ``found`` (oldest first) that :func:`verify` accepts (None if none does),
    and the newer damaged ones passed on the way, newest first, each with its problem."""
    damaged = []
    for path in reversed(found):
        problem = verify(path)
        if problem is None:
            return path, damaged
        damaged.append((path, problem))
    return None, damaged


# --- listing -------------------------------------------------------------------------------


def prune(root: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints under ``root``; returns what went.
    Oldest first, so a crash part-way leaves the newest ones."""
    gone = _complete(root)[:-keep] if keep > 0 else []
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    return gone


def latest(root: Path) -> Path | None:
    done = _complete(root)
    return done[-1] if done else None


def _complete(root: Path) -> list[Path]:
    """The complete checkpoints directly under ``root`` (renamed into place with their driver
    file), oldest first."""
    return sorted(p for p in root.glob(f"{STEP_PREFIX}*") if (p / DRIVER_FILE).is_file())


def written_at(path: Path) -> float:
    """When a checkpoint was completed (its last file's modification time)."""
    last = path / MANIFEST_FILE
    return (last if last.is_file() else path / DRIVER_FILE).stat().st_mtime


def runs(graph_root: Path) -> dict[str, list[Path]]:
    """MLflow run id -> its complete checkpoints (oldest first) under a graph's folder: the run
    folders, and checkpoints of the older layout (directly in ``graph_root``) by the run id
    their driver.json names (one with an unreadable driver.json cannot be placed: skipped)."""
    out: dict[str, list[Path]] = {}
    if not graph_root.is_dir():
        return out
    for legacy in _complete(graph_root):
        try:
            out.setdefault(load_driver(legacy).mlflow_run_id, []).append(legacy)
        except (OSError, ValueError, KeyError):
            continue
    for folder in sorted(graph_root.iterdir()):
        if folder.is_dir() and not folder.name.startswith((".", STEP_PREFIX, DAMAGED_PREFIX)):
            steps = _complete(folder)
            if steps:
                out[folder.name] = sorted(out.get(folder.name, []) + steps, key=step_of)
    return out


def all_checkpoints(folder: Path) -> list[Path]:
    """Every complete checkpoint under a graph's folder (or a run's), oldest written first."""
    found = [p for steps in runs(folder).values() for p in steps] or _complete(folder)
    return sorted(set(found), key=written_at)


def adopt_legacy(graph_root: Path, run_id: str) -> None:
    """Move a run's checkpoints of the older layout into its run folder, where it writes the
    next ones (and prunes), so that the run has one folder again."""
    target = graph_root / run_id
    for path in runs(graph_root).get(run_id, []):
        if path.parent == graph_root:
            target.mkdir(exist_ok=True)
            if not step_dir(target, step_of(path)).exists():
                path.rename(target / path.name)


def move_aside(path: Path) -> Path:
    """Rename a damaged checkpoint so that nothing lists it again (its files are kept)."""
    aside = path.with_name(DAMAGED_PREFIX + path.name)
    shutil.rmtree(aside, ignore_errors=True)
    path.rename(aside)
    return aside


# --- loading -------------------------------------------------------------------------------


def load_driver(path: Path) -> DriverState:
    """The driver state alone (step, sampler, MLflow run id, graph, ...): no tensors loaded; a
    ValueError when driver.json is unreadable."""
    return DriverState.model_validate_json((path / DRIVER_FILE).read_text())


def load(path: Path) -> tuple[DriverState, dict[str, Any]]:
    driver = load_driver(path)
    # on the host: a checkpoint written on a GPU resumes on a CPU-only machine (and the reverse:
    # an optimizer moves its state to its parameters' device when it loads it)
    ops = torch.load(path / OPS_FILE, weights_only=False, map_location="cpu")
    return driver, ops


def load_carry(path: Path) -> pa.Table | None:
    """The carried-over groups saved with the checkpoint (None when there were none)."""
    return _read_table(path / CARRY_FILE)


def load_ahead(path: Path, n: int) -> list[pa.Table | None]:
    """The ``n`` batches collected ahead that a one_step_off or async run saved with the
    checkpoint (None for one that trains nothing)."""
    return [_read_table(path / AHEAD_FILE.format(i)) for i in range(n)]


def _read_table(file: Path) -> pa.Table | None:
    if not file.is_file():
        return None
    with pa.memory_map(str(file)) as source:
        return pa.ipc.open_file(source).read_all()
