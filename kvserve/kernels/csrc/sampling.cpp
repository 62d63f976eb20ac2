// Categorical sampling by the Gumbel-max trick: token = argmax_i(logit_i + G_i), G_i = -log(-log(U_i)).
//
// U_i comes from a counter-based hash of (row key, i), so a row's draw depends only on its key and its logits: a
// seeded request keyed by (seed, position) samples the same token whatever else is in the batch. Unlike an
// inverse CDF, whose every threshold moves when the mass of the truncated tail does, the argmax only changes if
// two perturbed values are within the numerical noise of each other, which keeps seeded sampling reproducible
// across batch compositions (whose matmuls round differently). One fused pass per row, vectorised and threaded.
//
// Also the top-k of the logprobs a request asks for, with ties broken by token id, so that they too depend on the
// row alone.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <tuple>
#include <utility>
#include <vector>

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

// A running argmax per vector lane (the first of each lane's largest values; NaNs never win), and its reduction
// across the lanes to the row's first largest value and index. draw_row and argmax_row share it.
struct LaneArgmax {
  vf best = vset(-std::numeric_limits<float>::infinity());
  vi arg = viset(0);
  void update(vf v, vi idx) {
    const vm better = vgt(v, best);
    best = vselect(better, best, v);
    arg = vselect(better, arg, idx);
  }
  // (value, index); every lane at -inf gives (-inf, 0).
  std::pair<float, int64_t> reduce() const {
    alignas(64) float bv[kW];
    alignas(64) int32_t ba[kW];
    vstore(bv, best);
    vistore(ba, arg);
    float value = -std::numeric_limits<float>::infinity();
    int64_t index = 0;
    for (int j = 0; j < kW; ++j)
      if (bv[j] > value || (bv[j] == value && ba[j] < index)) {
        value = bv[j];
        index = ba[j];
      }
    return {value, index};
  }
};

int64_t draw_row(const float* x, int64_t n, uint64_t key) {
  int64_t i = 0;
  const vi lo = viset(static_cast<int32_t>(static_cast<uint32_t>(key)));
  const vi hi = viset(static_cast<int32_t>(static_cast<uint32_t>(key >> 32)));
  LaneArgmax lanes;
  for (; i + kW <= n; i += kW) {
    const vi idx = viadd(viset(static_cast<int32_t>(i)), viota());
    const vi h = mix32_v(vixor(mix32_v(vixor(idx, lo)), hi));
    // h >> 9 < 2^23: exact as a signed conversion.
    const vf u = vmul(vadd(vitof(visrl<9>(h)), vset(0.5f)), vset(1.0f / 8388608.0f));
    const vf g = vsub(vzero(), vlog(vsub(vzero(), vlog(u))));
    lanes.update(vadd(vload(x + i), g), idx);
  }
  auto [best, arg] = lanes.reduce();
  for (; i < n; ++i) {
    const float v = x[i] + gumbel(key, static_cast<uint32_t>(i));
    if (v > best) {
      best = v;
      arg = i;
    }
  }
  return arg;  // all -inf (or NaN): token 0, still a valid id
}

// torch.argmax's pick on one row: the first of the largest values, or the first NaN if there is one. The vector
// pass ignores NaNs (comparisons with them are false); its running sum is NaN only where a NaN (or both infinities)
// is in the row, and then the scalar loop decides exactly.
int64_t argmax_row(const float* x, int64_t n) {
  vf vtotal = vzero();
  LaneArgmax lanes;
  int64_t i = 0;
  for (; i + kW <= n; i += kW) {
    const vf v = vload(x + i);
    vtotal = vadd(vtotal, v);
    lanes.update(v, viadd(viset(static_cast<int32_t>(i)), viota()));
  }
  auto [best, arg] = lanes.reduce();  // a row of -inf: its first entry, as torch
  float total = vsum(vtotal);
  for (; i < n; ++i) {
    total += x[i];
    if (x[i] > best) {
      best = x[i];
      arg = i;
    }
  }
  if (!std::isnan(total)) return arg;
  arg = 0;
  best = x[0];
  for (int64_t j = 0; j < n; ++j) {
    if (std::isnan(x[j])) return j;
    if (x[j] > best) {
      best = x[j];
      arg = j;
    }
  }
  return arg;
}

struct Entry {
  float value;
  int64_t index;
};

// Whether a ranks before b: the larger value first, NaN above every number (as in torch.topk), then the lower index.
inline bool ranks_before(const Entry& a, const Entry& b) {
  const bool a_nan = std::isnan(a.value), b_nan = std::isnan(b.value);
  if (a_nan != b_nan) return a_nan;
  if (!a_nan && a.value != b.value) return a.value > b.value;
  return a.index < b.index;
}

// The k best entries of x[0..n) in rank order, into top[0..k).
void top_of_row(const float* x, int64_t n, int64_t k, Entry* top) {
  for (int64_t i = 0; i < k; ++i) {  // the first k, insertion-sorted
    Entry e{x[i], i};
    int64_t j = i;
    for (; j > 0 && ranks_before(e, top[j - 1]); --j) top[j] = top[j - 1];
    top[j] = e;
  }
  for (int64_t i = k; i < n; ++i) {
    // A later index loses every tie, so only a larger value (or a NaN over a number) gets in.
    const float last = top[k - 1].value;
    if (!(x[i] > last) && !(std::isnan(x[i]) && !std::isnan(last))) continue;
    Entry e{x[i], i};
    int64_t j = k - 1;
    for (; j > 0 && ranks_before(e, top[j - 1]); --j) top[j] = top[j - 1];
    top[j] = e;
  }
}

// The log-sum-exp of x[0..n): its largest value plus the log of the sum of exp(x - that value).
float log_sum_exp(const float* x, int64_t n) {
  const float m = max_of(x, n);
  const vf vmax_ = vset(m);
  vf vs = vzero();
  int64_t i = 0;
  for (; i + kW <= n; i += kW) vs = vadd(vs, vexp(vsub(vload(x + i), vmax_)));
  float sum = vsum(vs);
  for (; i < n; ++i) sum += std::exp(x[i] - m);
  return m + std::log(sum);
}

// topk_rows, with each row's log-sum-exp taken off its values where `log_probs`.
std::tuple<at::Tensor, at::Tensor> top_of_rows(const at::Tensor& x, int64_t k, bool log_probs, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous [B, V] float32");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(k >= 1 && k <= n, name, ": need 1 <= k <= V");
  auto values = at::empty({rows, k}, x.options());
  auto indices = at::empty({rows, k}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  int64_t* ip = indices.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<Entry> top(k);
    for (int64_t r = begin; r < end; ++r) {
      top_of_row(xp + r * n, n, k, top.data());
      const float shift = log_probs ? log_sum_exp(xp + r * n, n) : 0.0f;
      for (int64_t j = 0; j < k; ++j) {
        vp[r * k + j] = top[j].value - shift;
        ip[r * k + j] = top[j].index;
      }
    }
  });
  return {values, indices};
}

}  // namespace

// x [B, V] fp32, 1 <= k <= V. Returns (values [B, k] fp32, indices [B, k] int64): each row's k largest entries,
// largest first, ties going to the lower index. A function of the row alone: torch.topk leaves the order of equal
// values (frequent among bf16 logits) to the algorithm it picks for k, and a batch's k is its largest `logprobs`.
std::tuple<at::Tensor, at::Tensor> topk_rows(at::Tensor x, int64_t k) { return top_of_rows(x, k, false, "topk_rows"); }

// The same entries as log-probs: each minus its row's log-sum-exp, i.e. the top of log_softmax(x) without writing
// the row out (a draft tree's expansion wants 4 of 8-16k per node). Each row should hold a finite value.
std::tuple<at::Tensor, at::Tensor> topk_log_softmax_rows(at::Tensor x, int64_t k) {
  return top_of_rows(x, k, true, "topk_log_softmax_rows");
}

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

// logits [B, V] fp32 -> [B] int64: each row's argmax as torch.argmax(dim=-1) gives it (first maximum; a NaN wins),
// in one threaded pass (torch's CPU argmax takes ~70 us for a 49k row, 2 ms for 64 of them).
at::Tensor argmax_rows(at::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "logits: contiguous [B, V] float32");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(vocab > 0 && vocab < (int64_t{1} << 31), "argmax_rows: 0 < V < 2^31");
  auto out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) o[r] = argmax_row(x + r * vocab, vocab);
  });
  return out;
}
