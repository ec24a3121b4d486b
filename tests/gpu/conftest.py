"""The tests marked ``gpu``: dapo-flow on CUDA. They are collected everywhere and skipped where
torch sees no CUDA device, so `python -m pytest -m gpu` on a CPU machine reports them skipped.

``DAPO_FLOW_TEST_DEVICE=cpu`` runs them on the CPU instead: a rehearsal of the tests themselves
on a machine without a GPU (their CUDA-against-CPU comparisons then compare the CPU with itself,
and the process groups are gloo's). What a GPU machine needs to run them offline:
scripts/gpu_check.sh.

The built-in models they read are resolved by their own fixtures, not declared with the
``models`` marker, so a CPU session that skips them starts no model builds; a GPU session builds
a missing one when a test first needs it (scripts/gpu_check.sh brings them built).
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from rich.console import Console

import gpu_runs

def pytest_collection_modifyitems(config, items) -> None:
    """Skip the ``gpu`` tests where there is no CUDA device to run them on."""
    if gpu_runs.target_device().type != "cuda" or torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is false; "
                                   f"{gpu_runs.DEVICE_ENV}=cpu rehearses them on the CPU)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where the tests run their models: CUDA (or the CPU when rehearsing)."""
    return gpu_runs.target_device()


@pytest.fixture(scope="session")
def builtin():
    """``builtin(name) -> Path``: a built-in model's directory, built on first use (cached)."""
    from dapo_flow.models import resolve_model

    return lambda name: resolve_model(f"builtin:{name}", progress=False)


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory) -> str:
    """What graphs on builtin:tiny-chat train here: the built-in model when it is already cached,
    else a build of its recipe cut to a few steps (seconds; the shipped one trains ~2-5 minutes on
    one core): the same directory layout, tokenizer and shapes, for runs of a few steps."""
    from dapo_flow.models import builtin_dir
    from dapo_flow.recipes import tiny_chat

    import model_builds

    if builtin_dir("tiny-chat").is_dir():
        return "builtin:tiny-chat"
    out = tmp_path_factory.mktemp("tiny-chat-short")
    tiny_chat.build_tiny_chat(out, progress=False, recipe=model_builds.short_tiny_chat())
    return str(out)


@pytest.fixture()
def workdir(tmp_path, monkeypatch, builtin) -> Path:
    """A fresh working directory (the MLflow store and checkpoints go under ./dapo-flow-runs)."""
    builtin("tiny-adder")  # before any test times a run: the model most of them train
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return tmp_path


@pytest.fixture()
def quiet() -> Console:
    return Console(file=io.StringIO(), width=400)
