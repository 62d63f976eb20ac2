// Categorical sampling by the Gumbel-max trick: token = argmax_i(logit_i + G_i), G_i = -log(-log(U_i)).
//
// U_i comes from a counter-based hash of (row key, i), so a row's draw depends only on its key and its logits: a
// seeded request keyed by (seed, position) samples the same token whatever else is in the batch. Unlike an
// inverse CDF, whose every threshold moves when the mass of the truncated tail does, the argmax only changes if
// two perturbed values are within the numerical noise of each other, which keeps seeded sampling reproducible
// across batch compositions (whose matmuls round differently). One fused pass per row, vectorised and threaded.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "simd.h"

namespace {

using namespace kvserve;

// Chris Wellons' lowbias32 integer hash.
inline uint32_t mix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x7feb352du;
  h ^= h >> 15;
  h *= 0x846ca68bu;
  h ^= h >> 16;
  return h;
}

inline float gumbel(uint64_t key, uint32_t i) {
  const uint32_t h = mix32(mix32(i ^ static_cast<uint32_t>(key)) ^ static_cast<uint32_t>(key >> 32));
  // 23 bits keep (k + 0.5) / 2^23 exact in fp32, so u stays inside (0, 1) and G finite (24 bits can round to 1).
  const float u = (static_cast<float>(h >> 9) + 0.5f) * (1.0f / 8388608.0f);
  return -std::log(-std::log(u));
}

#if defined(__AVX512F__)
inline __m512i mix32_v(__m512i h) {
  h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
  h = _mm512_mullo_epi32(h, _mm512_set1_epi32(0x7feb352d));
  h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 15));
  h = _mm512_mullo_epi32(h, _mm512_set1_epi32(static_cast<int>(0x846ca68bu)));
  return _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
}
#endif

int64_t draw_row(const float* x, int64_t n, uint64_t key) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t arg = 0;
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512i lo = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(key)));
  const __m512i hi = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(key >> 32)));
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 vbest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512i varg = _mm512_setzero_si512();
  for (; i + 16 <= n; i += 16) {
    const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(i)), lane);
    const __m512i h = mix32_v(_mm512_xor_si512(mix32_v(_mm512_xor_si512(idx, lo)), hi));
    const __m512 u = _mm512_mul_ps(_mm512_add_ps(_mm512_cvtepu32_ps(_mm512_srli_epi32(h, 9)), _mm512_set1_ps(0.5f)),
                                   _mm512_set1_ps(1.0f / 8388608.0f));
    const __m512 g = _mm512_sub_ps(_mm512_setzero_ps(),
                                   log_ps(_mm512_sub_ps(_mm512_setzero_ps(), log_ps(u))));
    const __m512 v = _mm512_add_ps(_mm512_loadu_ps(x + i), g);
    const __mmask16 better = _mm512_cmp_ps_mask(v, vbest, _CMP_GT_OQ);
    vbest = _mm512_mask_mov_ps(vbest, better, v);
    varg = _mm512_mask_mov_epi32(varg, better, idx);
  }
  alignas(64) float bv[16];
  alignas(64) int32_t ba[16];
  _mm512_store_ps(bv, vbest);
  _mm512_store_si512(ba, varg);
  for (int j = 0; j < 16; ++j)
    if (bv[j] > best || (bv[j] == best && ba[j] < arg)) {
      best = bv[j];
      arg = ba[j];
    }
#endif
  for (; i < n; ++i) {
    const float v = x[i] + gumbel(key, static_cast<uint32_t>(i));
    if (v > best) {
      best = v;
      arg = i;
    }
  }
  return arg;  // all -inf (or NaN): token 0, still a valid id
}

}  // namespace

// logits [B, V] fp32 (masked entries -inf), keys [B] int64. Returns [B] int64 token ids.
at::Tensor sample_gumbel(at::Tensor logits, at::Tensor keys) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "logits: contiguous [B, V] float32");
  TORCH_CHECK(keys.dim() == 1 && keys.size(0) == logits.size(0) && keys.scalar_type() == at::kLong &&
                  keys.is_contiguous(),
              "keys: contiguous [B] int64");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  auto out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  const int64_t* k = keys.data_ptr<int64_t>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) o[r] = draw_row(x + r * vocab, vocab, static_cast<uint64_t>(k[r]));
  });
  return out;
}
