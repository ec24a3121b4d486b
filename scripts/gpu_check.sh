#!/usr/bin/env bash
# Check dapo-flow on an offline GPU machine: install the kit scripts/gpu_kit_pack.sh packed, run
# the tests marked `gpu` and the GPU benchmark, write what they found as files.
#
# Run on the GPU machine, from the repository root, with the kit beside it (gpu-kit/, or GPU_KIT):
#
#     bash scripts/gpu_check.sh [OUT_DIR]        # default $OUT, else gpu-check/
#
# Nothing is downloaded and nothing outside /tmp (or TMPDIR) and OUT_DIR is written: the kit's
# wheels are installed with `pip install --no-index --no-deps --target` into a temporary folder
# put on PYTHONPATH before this repository, so the machine's own torch and the rest of its image
# are used as they are; its models go into a fresh DAPO_FLOW_HOME.
#
# OUT_DIR gets: machine.txt (torch, CUDA, the GPU), pytest-gpu.log and pytest-gpu.xml
# (`pytest -m gpu`), gpu_step.json and gpu_step.log (benchmarks/gpu_step.py), lora.json and
# lora.log (benchmarks/lora.py: LoRA against full fine-tuning), summary.txt.
# GPU_CHECK_TESTS_TIMEOUT / GPU_CHECK_BENCH_TIMEOUT / GPU_CHECK_LORA_TIMEOUT (seconds) bound each
# part with `timeout`, so a leased machine's minutes leave room for the other parts (exit 124
# means it ran out of time).
# Exit status: 0 when the tests passed and the benchmarks ran; 1 when any failed; 3 when torch
# sees no CUDA device (the gpu tests would all skip: nothing would have been checked).
set -uo pipefail

KIT=${GPU_KIT:-gpu-kit}
OUT_DIR=${1:-${OUT:-gpu-check}}
PY=${PYTHON:-python3}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
SITE="$scratch/site"
mkdir -p "$SITE"

if [[ ! -d "$KIT" ]]; then
  echo "error: no kit at $KIT: pack one with scripts/gpu_kit_pack.sh on a networked machine" >&2
  exit 2
fi

echo "== installing the kit ($KIT) into $SITE"
set -e
shopt -s nullglob
wheels=("$KIT"/*.whl)
(( ${#wheels[@]} )) && "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "${wheels[@]}"
for packed in "$KIT"/*.tar.xz; do
  [[ $(basename "$packed") == models.tar.xz ]] && continue
  tar -xJf "$packed" -C "$SITE"  # an unpacked wheel: its files as pip would install them
done
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export DAPO_FLOW_HOME="${DAPO_FLOW_HOME:-$scratch/dapo-flow-home}"
mkdir -p "$DAPO_FLOW_HOME/models"
[[ -f "$KIT/models.tar.xz" ]] && tar -xJf "$KIT/models.tar.xz" -C "$DAPO_FLOW_HOME/models"
set +e

"$PY" - > "$OUT_DIR/machine.txt" <<'EOF'
import platform

import torch

print(f"python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"GPU: {torch.cuda.get_device_name(0)}, {p.total_memory / 2**30:.1f} GiB, "
          f"{p.multi_processor_count} SMs, {torch.cuda.device_count()} device(s)")
else:
    print("GPU: none (torch.cuda.is_available() is false)")
EOF
cat "$OUT_DIR/machine.txt"
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "error: torch does not import here, or sees no CUDA device: the gpu tests would all skip" >&2
  exit 3
fi
"$PY" -c 'import dapo_flow, mlflow, polars, pydantic, ruamel.yaml' || { echo "error: the kit's packages do not import" >&2; exit 1; }

echo "== pytest -m gpu"
parallel=()
"$PY" -c 'import xdist' 2>/dev/null && parallel=(-n 2)
# the project's addopts name pytest-xdist options the image's version may lack: set them here
limit_tests=(); [[ -n ${GPU_CHECK_TESTS_TIMEOUT:-} ]] && limit_tests=(timeout "$GPU_CHECK_TESTS_TIMEOUT")
limit_bench=(); [[ -n ${GPU_CHECK_BENCH_TIMEOUT:-} ]] && limit_bench=(timeout "$GPU_CHECK_BENCH_TIMEOUT")
"${limit_tests[@]}" "$PY" -m pytest -o addopts="" -ra --durations=15 "${parallel[@]}" -p no:cacheprovider -m gpu \
  --junitxml "$OUT_DIR/pytest-gpu.xml" tests/gpu 2>&1 | tee "$OUT_DIR/pytest-gpu.log"
tests_rc=${PIPESTATUS[0]}

echo "== benchmarks/gpu_step.py"
"${limit_bench[@]}" "$PY" benchmarks/gpu_step.py --json "$OUT_DIR/gpu_step.json" 2>&1 | tee "$OUT_DIR/gpu_step.log"
bench_rc=${PIPESTATUS[0]}

echo "== benchmarks/lora.py"
limit_lora=(); [[ -n ${GPU_CHECK_LORA_TIMEOUT:-} ]] && limit_lora=(timeout "$GPU_CHECK_LORA_TIMEOUT")
"${limit_lora[@]}" "$PY" benchmarks/lora.py --device cuda --json "$OUT_DIR/lora.json" 2>&1 | tee "$OUT_DIR/lora.log"
lora_rc=${PIPESTATUS[0]}

{
  cat "$OUT_DIR/machine.txt"
  echo "pytest -m gpu: exit $tests_rc ($(tail -n 1 "$OUT_DIR/pytest-gpu.log"))"
  echo "benchmarks/gpu_step.py: exit $bench_rc"
  echo "benchmarks/lora.py: exit $lora_rc"
} | tee "$OUT_DIR/summary.txt"
(( tests_rc == 0 && bench_rc == 0 && lora_rc == 0 )) || exit 1
