#!/usr/bin/env bash
# kvserve vs OpenVINO GenAI, each precision against its counterpart, in one sitting (issue 34's workload):
#   offline: 64 random requests, prompts 64-384, outputs 32-160, ignore_eos (ContinuousBatchingPipeline);
#   batch 1: a 16-token prompt, 128 tokens (LLMPipeline); 2 threads for both engines.
#
#   benchmarks/peers/setup_openvino.sh                                # once: the environment and the IR folders
#   benchmarks/peers/compare_openvino.sh [OUT_DIR] [fp32 bf16 int8 avx2-fp32 avx2-int8]
#
# Pairs: fp32 = kvserve float32 vs the fp32 IR with INFERENCE_PRECISION_HINT=f32; bf16 = kvserve bfloat16 vs the
# default IR at OpenVINO's default precision; int8 = kvserve int8 weights vs the int8 IR at OpenVINO's default
# precision. avx2-*: both engines on a CPU capped to AVX2 (benchmarks/peers/avx2_cap.sh: CPUID shows no AVX-512,
# AVX-VNNI or AMX, so OpenVINO's oneDNN, MLAS and JIT kernels all pick AVX2 code; needs CPUID faulting, else the
# pair is refused), kvserve at its AVX2 level (KVSERVE_CPU_ISA=avx2). Before the cap, ONEDNN_MAX_CPU_ISA alone
# reached only OpenVINO's oneDNN kernels (docs/benchmarks.md).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-bench-results/openvino}
shift || true
PAIRS=${*:-fp32 bf16 int8}
PY=${KVSERVE_PYTHON:-.venv/bin/python}
IR=${OPENVINO_IR:-${KVSERVE_CACHE_DIR:-$HOME/.cache/kvserve}/openvino/smollm2-135m-instruct}
mkdir -p "$OUT"
OFFLINE=(--num-requests 64 --input-len 64 384 --output-len 32 160)
BATCH1=(--prompt-len 16 --tg-prompt-len 16 --gen-len 128 --repeat 3)
for pair in $PAIRS; do
  isa=(KVSERVE_CPU_ISA=)
  cap=()
  case "$pair" in
    fp32) kv=(--dtype float32) ov=fp32 ;;
    bf16) kv=(--dtype bfloat16) ov=default ;;
    int8) kv=(--quantization int8) ov=int8 ;;
    # An AVX2 CPU has no bf16: OpenVINO would compute in f32 there, so it is told to here.
    avx2-fp32) kv=(--dtype float32 --openvino-precision f32) ov=fp32 isa=(KVSERVE_CPU_ISA=avx2) cap=(benchmarks/peers/avx2_cap.sh) ;;
    avx2-int8) kv=(--quantization int8 --openvino-precision f32) ov=int8 isa=(KVSERVE_CPU_ISA=avx2) cap=(benchmarks/peers/avx2_cap.sh) ;;
    *) echo "compare_openvino.sh: unknown pair $pair" >&2; exit 2 ;;
  esac
  echo "==== $pair: offline"
  env "${isa[@]}" ${cap[@]+"${cap[@]}"} "$PY" -m kvserve.entrypoints.cli bench throughput "${OFFLINE[@]}" "${kv[@]}" --num-threads 2 \
    --openvino "$IR/$ov" --json "$OUT/offline-$pair.json"
  echo "==== $pair: batch 1"
  env "${isa[@]}" ${cap[@]+"${cap[@]}"} "$PY" -m kvserve.entrypoints.cli bench latency "${BATCH1[@]}" "${kv[@]}" --num-threads 2 \
    --openvino "$IR/$ov" --json "$OUT/batch1-$pair.json"
done
