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

inline vi mix32_v(vi h) {
  h = vixor(h, visrl<16>(h));
  h = vimul(h, viset(0x7feb352d));
  h = vixor(h, visrl<15>(h));
  h = vimul(h, viset(static_cast<int32_t>(0x846ca68bu)));
  return vixor(h, visrl<16>(h));
}

int64_t draw_row(const float* x, int64_t n, uint64_t key) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t arg = 0;
  int64_t i = 0;
  const vi lo = viset(static_cast<int32_t>(static_cast<uint32_t>(key)));
  const vi hi = viset(static_cast<int32_t>(static_cast<uint32_t>(key >> 32)));
  vf vbest = vset(-std::numeric_limits<float>::infinity());
  vi varg = viset(0);
  for (; i + kW <= n; i += kW) {
    const vi idx = viadd(viset(static_cast<int32_t>(i)), viota());
    const vi h = mix32_v(vixor(mix32_v(vixor(idx, lo)), hi));
    // h >> 9 < 2^23: exact as a signed conversion.
    const vf u = vmul(vadd(vitof(visrl<9>(h)), vset(0.5f)), vset(1.0f / 8388608.0f));
    const vf g = vsub(vzero(), vlog(vsub(vzero(), vlog(u))));
    const vf v = vadd(vload(x + i), g);
    const vm better = vgt(v, vbest);
    vbest = vselect(better, vbest, v);
    varg = vselect(better, varg, idx);
  }
  alignas(64) float bv[kW];
  alignas(64) int32_t ba[kW];
  vstore(bv, vbest);
  vistore(ba, varg);
  for (int j = 0; j < kW; ++j)
    if (bv[j] > best || (bv[j] == best && ba[j] < arg)) {
      best = bv[j];
      arg = ba[j];
    }
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
