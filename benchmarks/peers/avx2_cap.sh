#!/usr/bin/env bash
# Runs a command on what looks like an AVX2-only CPU: every process it starts sees no AVX-512, AVX-VNNI or AMX in
# CPUID (cpuid_avx2.c, preloaded), and glibc's own string functions are capped the same way (GLIBC_TUNABLES). This
# is how issue 34's forced-AVX2 comparisons cap their peers (OpenVINO's MLAS and JIT kernels, which
# ONEDNN_MAX_CPU_ISA does not reach), and kvserve beside them.
#
#   benchmarks/peers/avx2_cap.sh COMMAND [ARGS...]
#   benchmarks/peers/avx2_cap.sh --check             # prints what CPUID shows under the cap, fails if uncapped
#
# Needs a CPU and kernel with CPUID faulting ("cpuid_fault" in /proc/cpuinfo); without it the command is refused
# (exit 97), never run uncapped. Builds the shim once into ~/.cache/kvserve/peers (gcc).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
DIR=${KVSERVE_CACHE_DIR:-$HOME/.cache/kvserve}/peers
SO=$DIR/cpuid_avx2.so
if [ ! -f "$SO" ] || [ "$HERE/cpuid_avx2.c" -nt "$SO" ]; then
  mkdir -p "$DIR"
  gcc -O2 -Wall -shared -fPIC -o "$SO.tmp" "$HERE/cpuid_avx2.c"
  mv "$SO.tmp" "$SO"
fi
export LD_PRELOAD="$SO${LD_PRELOAD:+:$LD_PRELOAD}"
caps=-AVX512F,-AVX512CD,-AVX512BW,-AVX512DQ,-AVX512ER,-AVX512PF,-AVX512VL,-AVX512_VNNI,-AVX512_BF16,-AVX512_FP16,-AVX_VNNI
export GLIBC_TUNABLES="glibc.cpu.hwcaps=$caps${GLIBC_TUNABLES:+:$GLIBC_TUNABLES}"
if [ "${1:-}" = "--check" ]; then
  exec python3 - <<'PY'
import ctypes, mmap, sys
# CPUID leaf 7 subleaf 0 from a few bytes of machine code: the shim traps CPUID wherever it comes from.
code = bytes([0x53, 0xB8, 7, 0, 0, 0, 0x31, 0xC9, 0x0F, 0xA2, 0x89, 0xD8, 0x5B, 0xC3])  # push rbx; cpuid; eax=ebx
buf = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
buf.write(code)
fn = ctypes.CFUNCTYPE(ctypes.c_uint32)(ctypes.addressof(ctypes.c_char.from_buffer(buf)))
ebx = fn()
avx2, avx512f = bool(ebx >> 5 & 1), bool(ebx >> 16 & 1)
print(f"under the cap: AVX2 {avx2}, AVX-512F {avx512f}")
sys.exit(0 if avx2 and not avx512f else 1)
PY
fi
exec "$@"
