"""q.k alone, AVX2 fp32, SmolLM2's shape (head_dim 64, G = 3 query heads per kv head, 16-key blocks), data in L1:
(a) today's loop (dims inner per key, kW keys at a time, one query head at a time, vhsum) on [token][head][dim] rows;
(b) keys in the lanes: K stored [dim][key] per block and head, q broadcast per dim and head, no horizontal sums
    (2 blocks at a time: 4 key vectors x 3 heads = 12 accumulators).
Both in one process, alternated; prints cycles a key and kv head at 3 GHz (an AVX2 CPU; NB blocks, even).

    python benchmarks/qk_layouts.py            # NB=4 REPS=20000 by default
"""

import os
import statistics
import sys
from pathlib import Path

import torch
from torch.utils.cpp_extension import load_inline

from kvserve.platform import cpu_info, kernel_compile_flags

if "avx2" not in cpu_info().features:
    sys.exit("qk_layouts.py: needs an AVX2 CPU")

src = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <chrono>
#include "vec.h"  // the kernels' own AVX2 helpers: vhsum reduces 8 vectors as paged_attention.cpp does
constexpr int HD = 64, G = 3, BS = 16, HKV = 3;
// (a): k [nblocks][BS][HKV][HD], head 0; scores [G][nblocks*BS]
double run_a(torch::Tensor q, torch::Tensor k, torch::Tensor scores, int64_t reps) {
  const float* qp = q.data_ptr<float>(); const float* kp = k.data_ptr<float>(); float* sp = scores.data_ptr<float>();
  const int64_t nb = k.size(0), n = nb * BS;
  auto t0 = std::chrono::steady_clock::now();
  for (int64_t r = 0; r < reps; ++r)
    for (int64_t b = 0; b < nb; ++b)
      for (int g = 0; g < G; ++g)
        for (int t0_ = 0; t0_ < BS; t0_ += 8) {
          const float* kr = kp + (b * BS + t0_) * HKV * HD;
          __m256 a[8];
          const __m256 q0 = _mm256_loadu_ps(qp + g * HD);
#pragma GCC unroll 8
          for (int t = 0; t < 8; ++t) a[t] = _mm256_mul_ps(q0, _mm256_loadu_ps(kr + t * HKV * HD));
#pragma GCC unroll 8
          for (int c = 1; c < 8; ++c) {
            const __m256 qc = _mm256_loadu_ps(qp + g * HD + 8 * c);
#pragma GCC unroll 8
            for (int t = 0; t < 8; ++t) a[t] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(kr + t * HKV * HD + 8 * c), a[t]);
          }
          _mm256_storeu_ps(sp + g * n + b * BS + t0_, kvserve::vhsum(a));
        }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
// (b): kt [nblocks][HKV][HD][BS] (keys in lanes), head 0; two blocks at a time
double run_b(torch::Tensor q, torch::Tensor kt, torch::Tensor scores, int64_t reps) {
  const float* qp = q.data_ptr<float>(); const float* kp = kt.data_ptr<float>(); float* sp = scores.data_ptr<float>();
  const int64_t nb = kt.size(0), n = nb * BS;
  auto t0 = std::chrono::steady_clock::now();
  for (int64_t r = 0; r < reps; ++r)
    for (int64_t b = 0; b + 1 < nb; b += 2) {
      const float* k0 = kp + b * HKV * HD * BS;
      const float* k1 = kp + (b + 1) * HKV * HD * BS;
      __m256 acc[G][4];
#pragma GCC unroll 3
      for (int g = 0; g < G; ++g)
        for (int v = 0; v < 4; ++v) acc[g][v] = _mm256_setzero_ps();
#pragma GCC unroll 4
      for (int d = 0; d < HD; ++d) {
        const __m256 x0 = _mm256_loadu_ps(k0 + d * BS), x1 = _mm256_loadu_ps(k0 + d * BS + 8);
        const __m256 x2 = _mm256_loadu_ps(k1 + d * BS), x3 = _mm256_loadu_ps(k1 + d * BS + 8);
#pragma GCC unroll 3
        for (int g = 0; g < G; ++g) {
          const __m256 qb = _mm256_broadcast_ss(qp + g * HD + d);
          acc[g][0] = _mm256_fmadd_ps(qb, x0, acc[g][0]);
          acc[g][1] = _mm256_fmadd_ps(qb, x1, acc[g][1]);
          acc[g][2] = _mm256_fmadd_ps(qb, x2, acc[g][2]);
          acc[g][3] = _mm256_fmadd_ps(qb, x3, acc[g][3]);
        }
      }
#pragma GCC unroll 3
      for (int g = 0; g < G; ++g)
        for (int v = 0; v < 4; ++v) _mm256_storeu_ps(sp + g * n + b * BS + 8 * v, acc[g][v]);
    }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
"""
m = load_inline(
    "kvserve_qk_layouts",
    src,
    functions=["run_a", "run_b"],
    extra_cflags=["-O3", *kernel_compile_flags("avx2"), "-mtune=native"],
    extra_include_paths=[str(Path(__file__).resolve().parents[1] / "kvserve" / "kernels" / "csrc")],
    verbose=False,
)
torch.set_num_threads(1)
nb = int(os.environ.get("NB", 4))
if nb < 2 or nb % 2:
    sys.exit("qk_layouts.py: NB must be even (loop b takes two blocks at a time)")
q = torch.randn(3, 64)
k = torch.randn(nb, 16, 3, 64)
kt = k[:, :, 0, :].permute(0, 2, 1).contiguous()  # [nb][64][16] for head 0
kt = torch.stack([kt, kt, kt], 1).contiguous()  # [nb][3][64][16]
sa, sb = torch.empty(3, nb * 16), torch.empty(3, nb * 16)
m.run_a(q, k, sa, 10)
m.run_b(q, kt, sb, 10)
ref = q @ k[:, :, 0, :].reshape(-1, 64).T
print("max err a", (sa - ref).abs().max().item(), "b", (sb - ref).abs().max().item())
reps = int(os.environ.get("REPS", 20000))
ta, tb = [], []
for _ in range(15):
    ta.append(m.run_a(q, k, sa, reps))
    tb.append(m.run_b(q, kt, sb, reps))
keys = nb * 16 * reps
for name, t in (("a today's loop", ta), ("b keys in lanes", tb)):
    med, best = statistics.median(t) * 3e9 / keys, min(t) * 3e9 / keys
    print(f"{name}: {med:.1f} cycles a key and kv head (median of 15; min {best:.1f})")
