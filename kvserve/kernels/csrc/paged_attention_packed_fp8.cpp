// The pair-packed decode kernel (packed_decode.h) over fp8 caches. This file alone compiles it with AVX512-VBMI
// (`vpermt2b`, the fp8 -> bf16 byte tables): its callers check the CPU for it at run time (packed_kv_supported), and
// the header's copy here has internal linkage, so no VBMI code reaches the bf16 path. The shared headers come
// before the target pragma, so their inline functions keep the build's own flags.

#include <ATen/ATen.h>

#include "attention_common.h"
#include "kv_layout.h"
#include "simd.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__)
#pragma GCC push_options
#pragma GCC target("avx512vbmi")
#include "packed_decode.h"
#endif

void paged_attention_packed_fp8(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& block_table, const at::Tensor& seq_lens, at::Tensor& out,
                                const kvserve::PagedShape& p, float scale, int64_t window, const float* alibi,
                                const int64_t* hidden) {
#if defined(__AVX512BF16__)
  kvserve::dispatch_kv_cache(k_cache, at::BFloat16{}, [&](auto cache_tag) {
    using C = decltype(cache_tag);
    if constexpr (kvserve::kIsFp8<C>) {
      run_packed_decode(q, static_cast<const C*>(k_cache.data_ptr()), static_cast<const C*>(v_cache.data_ptr()),
                        block_table, seq_lens, out, p, scale, window, alibi, hidden);
    }
  });
#else
  (void)q, (void)k_cache, (void)v_cache, (void)block_table, (void)seq_lens, (void)out, (void)p, (void)scale,
      (void)window, (void)alibi, (void)hidden;
  TORCH_CHECK(false, "the fp8 packed kernel needs AVX512-BF16");
#endif
}

#if defined(__AVX512BF16__)
#pragma GCC pop_options
#endif
