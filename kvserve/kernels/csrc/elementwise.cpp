// Fused elementwise kernels for the decoder layer, one pass each instead of 5-10 small torch ops (each of which
// pays dispatch and thread start-up: at batch 128 the unfused RMSNorm alone cost ~190 us per call).
// The row bodies (and how they round) are in elementwise.h.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "elementwise.h"
#include "kv_layout.h"
#include "simd.h"

namespace {

using namespace kvserve;

template <typename T>
void add_rms_norm_rows(T* x, T* residual, const T* weight, int64_t rows, int64_t dim, float eps, bool add) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row)
      rms_norm_row(x + row * dim, add ? residual + row * dim : nullptr, add ? residual + row * dim : nullptr,
                   weight, x + row * dim, dim, eps);
  });
}

template <typename T>
void rotary_rows(T* qk, int64_t row_stride, const int64_t* positions, const T* cos, const T* sin, int64_t rows,
                 int64_t num_heads, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row)
      for (int64_t h = 0; h < num_heads; ++h)
        rotary_head(qk + row * row_stride + h * head_dim, cos + positions[row] * half, sin + positions[row] * half,
                    head_dim);
  });
}

template <typename T>
void silu_and_mul_rows(const T* x, T* out, int64_t rows, int64_t dim) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row)
      silu_and_mul_span(x + row * 2 * dim, x + row * 2 * dim + dim, out + row * dim, dim);
  });
}

template <typename T>
void write_kv_rows(const T* k, const T* v, int64_t k_stride, int64_t v_stride, T* k_cache, T* v_cache,
                   const int64_t* slots, int64_t rows, int64_t width) {
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      write_kv_span(k + row * k_stride, k_cache + slots[row] * width, width);
      write_kv_span(v + row * v_stride, v_cache + slots[row] * width, width);
    }
  });
}

// x as an fp8 cache stores it (to_fp8, simd.h). A bf16 x has only 2^16 values: their codes are tabulated once
// (64 KiB a format, by to_fp8 itself, so byte-identical), and a store is one lookup instead of c10's float -> fp8
// conversion (~7x faster for the pair-packed prefill writes).
template <typename F8, typename T>
inline F8 fp8_code(T x) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    static const std::array<uint8_t, 65536> table = [] {
      std::array<uint8_t, 65536> t{};
      for (uint32_t b = 0; b < 65536; ++b)
        t[b] = to_fp8<F8>(static_cast<float>(at::BFloat16(static_cast<uint16_t>(b), at::BFloat16::from_bits()))).x;
      return t;
    }();
    return F8(table[x.x], F8::from_bits());
  } else {
    return to_fp8<F8>(to_f(x));
  }
}

// The same into an fp8 cache (standard layout): each element converted on store by fp8_code, which also replaces
// NaN and saturates.
template <typename T, typename F8>
void write_kv_rows_fp8(const T* k, const T* v, int64_t k_stride, int64_t v_stride, F8* k_cache, F8* v_cache,
                       const int64_t* slots, int64_t rows, int64_t width) {
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      F8* kd = k_cache + slots[row] * width;
      F8* vd = v_cache + slots[row] * width;
      const T* ks = k + row * k_stride;
      const T* vs = v + row * v_stride;
      if constexpr (std::is_same_v<T, float>) {
        store_fp8_row(ks, kd, width);
        store_fp8_row(vs, vd, width);
      } else {
        for (int64_t i = 0; i < width; ++i) {
          kd[i] = fp8_code<F8>(ks[i]);
          vd[i] = fp8_code<F8>(vs[i]);
        }
      }
    }
  });
}

// The same into the pair-packed layout (kv_layout.h): each row is sanitised in a scratch copy, then scattered; into
// an fp8 cache (C), each value converted by fp8_code on the way, to the fp8 tiles' offsets.
template <typename T, typename C>
void write_kv_rows_packed(const T* k, const T* v, int64_t k_stride, int64_t v_stride, C* k_cache, C* v_cache,
                          const int64_t* slots, int64_t rows, int64_t num_kv_heads, int64_t head_dim,
                          int64_t block_size) {
  const int64_t width = num_kv_heads * head_dim;
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    std::vector<T> ks(width), vs(width);
    for (int64_t row = begin; row < end; ++row) {
      std::memcpy(ks.data(), k + row * k_stride, width * sizeof(T));
      std::memcpy(vs.data(), v + row * v_stride, width * sizeof(T));
      const int64_t block = slots[row] / block_size, t = slots[row] % block_size;
      C* kb = k_cache + block * block_size * width;
      C* vb = v_cache + block * block_size * width;
      if constexpr (kIsFp8<C>) {
        // kv_layout.h's fp8 offsets walked in their own order (tests check them against packed_*_offset_fp8): a
        // K chunk takes dims 4g .. 4g + 3 of token t at bytes base + {0, 1, 8, 9}, the next group bpc chunks on;
        // a V chunk takes 32 dims of the token pair, dim 32j + 16u + 4a + b at byte 16a + 8u + 2b + t % 2.
        const int64_t bpc = block_size / 16, w0 = (t % 16) * 2, kbase = (t / 16) * 64 + (w0 / 8) * 16 + w0 % 8;
        const int64_t vbase = (t / 2) * (head_dim / 32) * 64 + t % 2;
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          const T* kr = ks.data() + h * head_dim;
          const T* vr = vs.data() + h * head_dim;
          C* kh = kb + h * head_dim * block_size + kbase;
          for (int64_t g = 0; g < head_dim / 4; ++g) {
            C* c = kh + g * bpc * 64;
            c[0] = fp8_code<C>(kr[4 * g]);
            c[1] = fp8_code<C>(kr[4 * g + 1]);
            c[8] = fp8_code<C>(kr[4 * g + 2]);
            c[9] = fp8_code<C>(kr[4 * g + 3]);
          }
          C* vh = vb + h * head_dim * block_size + vbase;
          for (int64_t j = 0; j < head_dim / 32; ++j)
            for (int u = 0; u < 2; ++u)
              for (int a = 0; a < 4; ++a)
                for (int b = 0; b < 4; ++b) vh[j * 64 + 16 * a + 8 * u + 2 * b] = fp8_code<C>(vr[32 * j + 16 * u + 4 * a + b]);
        }
      } else {
        sanitise(ks.data(), width);
        sanitise(vs.data(), width);
        for (int64_t h = 0; h < num_kv_heads; ++h)
          for (int64_t d = 0; d < head_dim; ++d) {
            kb[packed_k_offset(t, h, d, block_size, head_dim)] = ks[h * head_dim + d];
            vb[packed_v_offset(t, h, d, block_size, head_dim)] = vs[h * head_dim + d];
          }
      }
    }
  });
}

}  // namespace

// x [T, D], residual [T, D] (or undefined), weight [D]: with a residual, residual <- x + residual and
// x <- rmsnorm(residual) * weight; without, x <- rmsnorm(x) * weight. In place.
void rms_norm_(at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && x.scalar_type() == weight.scalar_type(), "rms_norm_");
  const bool add = residual.has_value() && residual->defined();
  if (add) TORCH_CHECK(residual->is_contiguous() && residual->sizes() == x.sizes(), "residual");
  const int64_t dim = x.size(-1), rows = x.numel() / dim;
  dispatch_float(x, [&](auto tag) {
    using T = decltype(tag);
    add_rms_norm_rows<T>(x.data_ptr<T>(), add ? residual->data_ptr<T>() : nullptr, weight.data_ptr<T>(), rows, dim,
                         static_cast<float>(eps), add);
  });
}

// qk: [T, >= num_heads * head_dim] rows (a view into the fused qkv output; row stride arbitrary, unit column
// stride); rotates the first num_heads heads in place with the cos/sin tables [max_pos, head_dim / 2].
void rotary_(at::Tensor qk, at::Tensor positions, at::Tensor cos, at::Tensor sin, int64_t num_heads, int64_t head_dim) {
  TORCH_CHECK(qk.dim() == 2 && qk.stride(1) == 1 && positions.scalar_type() == at::kLong, "rotary_");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == qk.scalar_type(), "rotary_ tables");
  auto pos = positions.contiguous();
  dispatch_float(qk, [&](auto tag) {
    using T = decltype(tag);
    rotary_rows<T>(qk.data_ptr<T>(), qk.stride(0), pos.data_ptr<int64_t>(), cos.data_ptr<T>(), sin.data_ptr<T>(),
                   qk.size(0), num_heads, head_dim);
  });
}

// x [T, 2I] = [gate | up] -> silu(gate) * up [T, I].
at::Tensor silu_and_mul(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0, "silu_and_mul");
  auto out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  dispatch_float(x, [&](auto tag) {
    using T = decltype(tag);
    silu_and_mul_rows<T>(x.data_ptr<T>(), out.data_ptr<T>(), x.size(0), x.size(1) / 2);
  });
  return out;
}

// k, v [T, Hkv * D] row views (unit column stride); caches [num_blocks, block_size, Hkv, D]; slot_mapping [T].
// Writes each token's K and V into its slot, in the standard layout or, with `packed`, the pair-packed one
// (kv_layout.h); NaN becomes 0 and +-inf the largest finite value, so the cache never holds a non-finite number.
// An fp8 cache (float8_e4m3fn / float8_e5m2; packed: kv_layout.h's fp8 tiles) gets each value converted by to_fp8.
void write_kv(at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slot_mapping,
              bool packed) {
  TORCH_CHECK(k.dim() == 2 && v.dim() == 2 && k.stride(1) == 1 && v.stride(1) == 1, "write_kv: 2-D row views");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && slot_mapping.scalar_type() == at::kLong, "write_kv");
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2), head_dim = k_cache.size(3);
  const int64_t width = num_kv_heads * head_dim;
  TORCH_CHECK(k.size(1) == width && v.size(1) == width, "write_kv: width");
  TORCH_CHECK(!packed || (head_dim % 2 == 0 && block_size % 2 == 0), "write_kv: packed needs even sizes");
  auto slots = slot_mapping.contiguous();
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "write_kv: k and v cache dtypes differ");
  TORCH_CHECK(!packed || !is_fp8(k_cache.scalar_type()) || (head_dim % 32 == 0 && block_size % 16 == 0),
              "write_kv: a packed fp8 cache needs head_dim % 32 == 0 and block_size % 16 == 0");
  dispatch_float(k, [&](auto tag) {
    using T = decltype(tag);
    if (is_fp8(k_cache.scalar_type())) {
      dispatch_kv_cache(k_cache, tag, [&](auto cache_tag) {
        using C = decltype(cache_tag);
        if constexpr (kIsFp8<C>) {
          if (packed) {
            write_kv_rows_packed<T, C>(k.data_ptr<T>(), v.data_ptr<T>(), k.stride(0), v.stride(0),
                                       static_cast<C*>(k_cache.data_ptr()), static_cast<C*>(v_cache.data_ptr()),
                                       slots.data_ptr<int64_t>(), k.size(0), num_kv_heads, head_dim, block_size);
          } else {
            write_kv_rows_fp8<T, C>(k.data_ptr<T>(), v.data_ptr<T>(), k.stride(0), v.stride(0),
                                    static_cast<C*>(k_cache.data_ptr()), static_cast<C*>(v_cache.data_ptr()),
                                    slots.data_ptr<int64_t>(), k.size(0), width);
          }
        }
      });
      return;
    }
    TORCH_CHECK(k_cache.scalar_type() == k.scalar_type(), "write_kv: the cache holds k's dtype or fp8");
    if (packed) {
      write_kv_rows_packed<T, T>(k.data_ptr<T>(), v.data_ptr<T>(), k.stride(0), v.stride(0), k_cache.data_ptr<T>(),
                              v_cache.data_ptr<T>(), slots.data_ptr<int64_t>(), k.size(0), num_kv_heads, head_dim,
                              block_size);
    } else {
      write_kv_rows<T>(k.data_ptr<T>(), v.data_ptr<T>(), k.stride(0), v.stride(0), k_cache.data_ptr<T>(),
                       v_cache.data_ptr<T>(), slots.data_ptr<int64_t>(), k.size(0), width);
    }
  });
}
