// Linear layers for a few rows (batch-1 decode): y [M, N] = x [M, K] @ w [N, K]^T (+ bias [N]).
//
// At one row a linear layer is a matrix-vector product, bound by how fast the weights stream from memory. oneDNN's
// packed GEMV reads them at about half the rate a plain read reaches on the development machines
// (docs/benchmarks.md), so this kernel streams the plain row-major weights itself: kW rows at a time, each row's
// dot products accumulated as kW vectors and reduced together by vhsum, the rows split over the threads.
// Every row m < M re-reads the same kW weight rows from L1/L2, so it is meant for M <= 4.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "simd.h"

namespace {

using namespace kvserve;

template <typename T>
void linear_rows(const float* x, const T* w, const T* bias, T* y, int64_t M, int64_t N, int64_t K) {
  const int64_t num_blocks = (N + kW - 1) / kW;
  // ~64 KiB of weights per task: enough work to amortise the task, small enough to balance two threads.
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / (kW * K * static_cast<int64_t>(sizeof(T))));
  at::parallel_for(0, num_blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * kW;
      const int rows = static_cast<int>(std::min<int64_t>(kW, N - n0));
      for (int64_t m = 0; m < M; ++m) {
        const float* xm = x + m * K;
        alignas(64) float out[kW];
        if (rows == kW) {
          vf acc[kW];
          for (int r = 0; r < kW; ++r) acc[r] = vzero();
          int64_t k = 0;
          for (; k + kW <= K; k += kW) {
            const vf xv = vload(xm + k);
            for (int r = 0; r < kW; ++r) acc[r] = vfma(vload(w + (n0 + r) * K + k), xv, acc[r]);
          }
          vstore(out, vhsum(acc));
          for (; k < K; ++k)
            for (int r = 0; r < kW; ++r) out[r] += to_f(w[(n0 + r) * K + k]) * xm[k];
        } else {  // the last, partial block
          for (int r = 0; r < rows; ++r) {
            float s = 0.f;
            for (int64_t k = 0; k < K; ++k) s += to_f(w[(n0 + r) * K + k]) * xm[k];
            out[r] = s;
          }
        }
        for (int r = 0; r < rows; ++r)
          y[m * N + n0 + r] = static_cast<T>(bias != nullptr ? out[r] + to_f(bias[n0 + r]) : out[r]);
      }
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
