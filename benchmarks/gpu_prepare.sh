#!/usr/bin/env bash
# Run HERE (a machine with network), in the repository root, before a GPU session: the GPU machine's image
# (Python 3.12, its own torch, Triton and transformers) lacks only msgspec and llguidance of what kvserve imports,
# and nothing can be fetched there. The wheels land in .whl/ (git-ignored), which the device call carries (docs/gpu.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
mkdir -p .whl
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl msgspec==0.22.0 llguidance==1.9.1
ls -la .whl
