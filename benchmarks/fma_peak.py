"""The CPU's fp32 FMA roofline, measured: the GFLOP/s of independent vector FMA chains on 1 and N threads, at the
vector width of kvserve's ISA level (8 lanes on AVX2, 16 on AVX-512). The figure the fp32 linears are held
against (issue 34: "against the fp32 FMA roofline that the CPU's ISA gives, not only against what torch's matmul
reaches"); linear_shapes.py gives the linears' own GFLOP/s.

    python benchmarks/fma_peak.py [--threads N]

Built with torch's cpp_extension on first use (~20 s).
"""

import argparse

import torch
from torch.utils.cpp_extension import load_inline

from kvserve.platform import cpu_info, kernel_compile_flags

_SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
#include <chrono>

// 12 independent accumulator chains per thread: enough to cover the FMA latency (4-5 cycles) on two FMA pipes.
double fma_gflops(int64_t iters, int64_t threads) {
  auto t0 = std::chrono::steady_clock::now();
  double sink = 0;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
  {
#if defined(__AVX512F__)
    __m512 a[12];
    const __m512 b = _mm512_set1_ps(1.0000001f), c = _mm512_set1_ps(1e-9f);
    for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_ps(float(i));
    for (int64_t it = 0; it < iters; ++it)
#pragma GCC unroll 12
      for (int i = 0; i < 12; ++i) a[i] = _mm512_fmadd_ps(a[i], b, c);
    for (int i = 1; i < 12; ++i) a[0] = _mm512_add_ps(a[0], a[i]);
    sink += _mm512_reduce_add_ps(a[0]);
#else
    __m256 a[12];
    const __m256 b = _mm256_set1_ps(1.0000001f), c = _mm256_set1_ps(1e-9f);
    for (int i = 0; i < 12; ++i) a[i] = _mm256_set1_ps(float(i));
    for (int64_t it = 0; it < iters; ++it)
#pragma GCC unroll 12
      for (int i = 0; i < 12; ++i) a[i] = _mm256_fmadd_ps(a[i], b, c);
    for (int i = 1; i < 12; ++i) a[0] = _mm256_add_ps(a[0], a[i]);
    float t[8];
    _mm256_storeu_ps(t, a[0]);
    sink += t[0];
#endif
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
#if defined(__AVX512F__)
  const double lanes = 16;
#else
  const double lanes = 8;
#endif
  return sink == -1.0 ? 0.0 : 2.0 * lanes * 12 * iters * threads / seconds / 1e9;
}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    info = cpu_info()
    if info.isa not in ("avx2", "avx512", "avx512_bf16"):
        raise SystemExit(f"fma_peak: needs an x86 CPU with AVX2 or AVX-512 (isa={info.isa})")
    mod = load_inline(
        name=f"kvserve_fma_peak_{info.isa}",
        cpp_sources=_SOURCE,
        functions=["fma_gflops"],
        extra_cflags=["-O3", *kernel_compile_flags(info.isa), "-fopenmp"],
        extra_ldflags=["-fopenmp"],
    )
    print(f"{info.model_name}, isa={info.isa}")
    for threads in sorted({1, args.threads}):
        best = max(mod.fma_gflops(20_000_000, threads) for _ in range(args.repeat))
        print(f"fp32 FMA peak, {threads} thread(s): {best:.1f} GFLOP/s (best of {args.repeat})")


if __name__ == "__main__":
    main()
