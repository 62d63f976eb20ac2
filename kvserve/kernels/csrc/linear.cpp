// Linear layers for a few rows (batch-1 decode): y [M, N] = x [M, K] @ w [N, K]^T (+ bias [N]).
//
// At one row a linear layer is a matrix-vector product, bound by how fast the weights stream from memory. oneDNN's
// packed GEMV reads them at about half the rate a plain read reaches on the development machines
// (docs/benchmarks.md), so this kernel streams the plain row-major weights itself: one weight row at a time, front
// to back, so each thread reads one sequential stream, which the hardware prefetcher follows; four accumulators
// hide the FMA latency. For each weight row the M input
// rows are taken in turn while it is in L1, so it is meant for M <= 4.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>

#include "simd.h"

namespace {

using namespace kvserve;

template <typename T>
inline float dot_row(const T* w, const float* x, int64_t K) {
  vf a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
  int64_t k = 0;
  for (; k + 4 * kW <= K; k += 4 * kW) {
    a0 = vfma(vload(w + k), vload(x + k), a0);
    a1 = vfma(vload(w + k + kW), vload(x + k + kW), a1);
    a2 = vfma(vload(w + k + 2 * kW), vload(x + k + 2 * kW), a2);
    a3 = vfma(vload(w + k + 3 * kW), vload(x + k + 3 * kW), a3);
  }
  for (; k + kW <= K; k += kW) a0 = vfma(vload(w + k), vload(x + k), a0);
  float s = vsum(vadd(vadd(a0, a1), vadd(a2, a3)));
  for (; k < K; ++k) s += to_f(w[k]) * x[k];
  return s;
}

template <typename T>
void linear_rows(const float* x, const T* w, const T* bias, T* y, int64_t M, int64_t N, int64_t K) {
  // ~64 KiB of weights per task: enough work to amortise the task, small enough to balance two threads.
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / (K * static_cast<int64_t>(sizeof(T))));
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t m = 0; m < M; ++m) {
        const float s = dot_row(w + n * K, x + m * K, K);
        y[m * N + n] = static_cast<T>(bias != nullptr ? s + to_f(bias[n]) : s);
      }
  });
}

}  // namespace

// x [M, K] (contiguous rows), w [N, K] contiguous, bias [N] or undefined; all fp32, or all bf16 (products and
// sums in fp32, the result rounded once). Returns [M, N] in x's dtype.
at::Tensor linear_small(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "linear_small: x [M, K], w [N, K]");
  TORCH_CHECK(w.is_contiguous() && x.scalar_type() == w.scalar_type(), "linear_small: contiguous w, same dtype");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) TORCH_CHECK(bias->is_contiguous() && bias->numel() == w.size(0), "linear_small: bias [N]");
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  auto xf = x.to(at::kFloat).contiguous();
  auto y = at::empty({M, N}, x.options());
  dispatch_float(w, [&](auto tag) {
    using T = decltype(tag);
    linear_rows<T>(xf.data_ptr<float>(), w.data_ptr<T>(), has_bias ? bias->data_ptr<T>() : nullptr,
                   y.data_ptr<T>(), M, N, K);
  });
  return y;
}
