#!/usr/bin/env bash
# Run HERE (a machine with network), in the repository root, before a GPU session: the GPU machine's image
# (Python 3.12, its own torch, Triton and transformers) lacks msgspec and llguidance of what kvserve imports, and
# the server's stack (FastAPI, Starlette, uvicorn, pydantic, pyzmq) for gpu_suite.py's `serve` stage; nothing can
# be fetched there. The wheels land in .whl/ (git-ignored), which the device call carries (docs/gpu.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
mkdir -p .whl
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl msgspec==0.22.0 llguidance==1.9.1 \
    pydantic_core==2.50.5 pyzmq==27.3.0 \
    fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.4 annotated_types==0.8.0 \
    typing_inspection==0.4.5 typing_extensions==4.16.0 opentelemetry_api==1.45.2 annotated_doc==0.0.7
ls -la .whl
