// decoder_layer.cpp's layer for a single query row (batch-1 decode) with 4-bit weights, in one parallel region.
//
// decoder_layer.cpp calls one kernel after another: four GEMVs, each a fork and join of the threads, with the
// norms, RoPE, the KV write, SiLU and each GEMV's activation quantization between them on the calling thread alone,
// reading the halves of their inputs that the other threads just wrote. At batch 1 on a 2-core AVX2 machine that
// was ~60 us a layer beside ~85 us of GEMVs. Here the threads stay in one region for the whole layer and meet at
// four barriers:
//   A  each thread normalises the whole input row and quantizes it itself (a 576-wide row: less than a barrier);
//   B  qkv by whole heads, then each thread rotates, and writes to the cache, the heads it computed;  | barrier
//   C  attention, each thread its share of the attention kernel's tasks (paged_attention.cpp, or for the
//      pair-packed bf16 cache packed_decode.h or the AMX tile path);                                     | barrier
//   D  o;                                                                                              | barrier
//   E  the post-attention norm (each thread, whole row), gate and up over the same columns, so that each thread's
//      SiLU-and-mul reads only what it computed;                                                       | barrier
//   F  down.
// The residual stream is written back in parts after the barrier that follows its last read.
//
// Every value is computed by the same code as the module path's (elementwise.h's row bodies, int4_linear.cpp's
// tiles, the attention kernels' tasks), so the results are bitwise decoder_layer.cpp's.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "attention_common.h"
#include "decoder_layer.h"
#include "elementwise.h"
#include "kv_layout.h"
#include "region.h"

namespace kvserve {

// int4_linear.cpp
void int4_quantize_row(const float* x, int64_t kb, int8_t* q, float* dx, float* mx);
void int4_quantize_row(const at::BFloat16* x, int64_t kb, int8_t* q, float* dx, float* mx);
void int4_gemv_panels(const int8_t* q, const float* dx, const float* mx, int64_t kb, const uint8_t* wp,
                      const float* bias, float* y, int64_t n, int64_t p_begin, int64_t p_end);
void int4_gemv_panels(const int8_t* q, const float* dx, const float* mx, int64_t kb, const uint8_t* wp,
                      const float* bias, at::BFloat16* y, int64_t n, int64_t p_begin, int64_t p_end);
// paged_attention.cpp
PagedShape paged_attention_decode_check(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                        const at::Tensor& block_table, const at::Tensor& seq_lens);
void paged_attention_decode_run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& block_table, const at::Tensor& seq_lens, at::Tensor& out,
                                const PagedShape& p, float scale, int64_t window, const float* alibi,
                                const int64_t* hidden);

}  // namespace kvserve

// paged_attention_packed.cpp (the pair-packed bf16 cache)
void paged_attention_packed_run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& block_table, const at::Tensor& seq_lens, at::Tensor& out,
                                const kvserve::PagedShape& p, float scale, int64_t window, const float* alibi,
                                const int64_t* hidden);

namespace {

using namespace kvserve;

constexpr int kNP = 16;  // output channels per int4 panel (int4_linear.cpp)
constexpr int kQB = 32;  // features per int4 block
constexpr int kMaxHeadDim = 256;  // the packed cache write's scratch row

static_assert(kNP % kW == 0, "a thread's panels must start and end on whole vectors (silu_and_mul_span)");

// One thread's scratch (kept across calls): its copy of the normalised row, the residual sum it computed, and a
// quantized input row.
template <typename T>
struct Scratch {
  std::vector<T> xn, sum;
  std::vector<int8_t> q;
  std::vector<float> dx, mx;
  void resize(int64_t hidden, int64_t k_max) {
    xn.resize(hidden), sum.resize(hidden), q.resize(k_max), dx.resize(k_max / kQB), mx.resize(k_max / kQB);
  }
  void quantize(const T* x, int64_t k) { int4_quantize_row(x, k / kQB, q.data(), dx.data(), mx.data()); }
  void gemv(const uint8_t* w, const float* bias, T* y, int64_t k, int64_t n, int64_t p0, int64_t p1) const {
    int4_gemv_panels(q.data(), dx.data(), mx.data(), k / kQB, w, bias, y, n, p0, p1);
  }
};

struct RowLayer {
  int64_t hidden, qkv_n, inter, num_heads, num_kv_heads, head_dim;
  const uint8_t *w_qkv, *w_o, *w_gate_up, *w_down;
  const float* qkv_bias;  // padded to whole panels, or nullptr
  float eps, scale;
  int64_t window, position, slot;
  bool packed;  // the cache holds the pair-packed layout (kv_layout.h), bf16
  int64_t block_size;
};

// One kv head's K or V row into the cache at L.slot: the standard layout, or the pair-packed one (sanitised in a
// copy, then scattered, as elementwise.cpp's write_kv_rows_packed does).
template <typename T>
void write_kv_head(const RowLayer& L, const T* head, T* cache, int64_t h, bool is_k) {
  const int64_t hd = L.head_dim;
  if (!L.packed) return write_kv_span(head, cache + L.slot * L.num_kv_heads * hd + h * hd, hd);
  T row[kMaxHeadDim];
  std::memcpy(row, head, hd * sizeof(T));
  sanitise(row, hd);
  const int64_t block = L.slot / L.block_size, t = L.slot % L.block_size;
  T* b = cache + block * L.block_size * L.num_kv_heads * hd;
  for (int64_t d = 0; d < hd; ++d)
    b[is_k ? packed_k_offset(t, h, d, L.block_size, hd) : packed_v_offset(t, h, d, L.block_size, hd)] = row[d];
}

// res: the residual stream, updated in place; without `add` (layer 0) it is the input row x itself, as in
// decoder_layer.cpp.
template <typename T>
void run_row_layer(const RowLayer& L, const T* x, T* res, bool add, const T* norm_in, const T* norm_post,
                   const T* cos, const T* sin, T* k_cache, T* v_cache, const at::Tensor& q_view,
                   const at::Tensor& k_cache_t, const at::Tensor& v_cache_t, const at::Tensor& block_table,
                   const at::Tensor& seq_lens, at::Tensor& attn, const PagedShape& shape, const int64_t* hidden_keys,
                   T* qkv, T* h, T* gate_up, T* act, T* out) {
  const int64_t hd = L.head_dim, half = hd / 2, q_size = L.num_heads * hd;
  const int64_t head_panels = hd / kNP, inter_panels = L.inter / kNP;
  const T* c = cos + L.position * half;
  const T* s = sin + L.position * half;
  const T* attn_p = attn.data_ptr<T>();
#pragma omp parallel num_threads(at::get_num_threads())
  {
    thread_local Scratch<T> sc;
    sc.resize(L.hidden, std::max({L.hidden, q_size, L.inter}));
    // A: the input norm, whole row, in every thread.
    rms_norm_row(x, add ? res : nullptr, add ? sc.sum.data() : nullptr, norm_in, sc.xn.data(), L.hidden, L.eps);
    sc.quantize(sc.xn.data(), L.hidden);
    // B: qkv by whole heads; RoPE and the cache write on the heads this thread computed.
    const RegionShare heads = region_share(L.num_heads + 2 * L.num_kv_heads);
    sc.gemv(L.w_qkv, L.qkv_bias, qkv, L.hidden, L.qkv_n, heads.begin * head_panels, heads.end * head_panels);
    for (int64_t u = heads.begin; u < heads.end; ++u) {
      T* head = qkv + u * hd;
      if (u < L.num_heads + L.num_kv_heads) rotary_head(head, c, s, hd);
      if (u >= L.num_heads + L.num_kv_heads)
        write_kv_head(L, head, v_cache, u - L.num_heads - L.num_kv_heads, false);
      else if (u >= L.num_heads)
        write_kv_head(L, head, k_cache, u - L.num_heads, true);
    }
#pragma omp barrier
    const RegionShare cols = region_share(L.hidden, kW);
    if (add) std::copy(sc.sum.begin() + cols.begin, sc.sum.begin() + cols.end, res + cols.begin);
    // C: attention, this thread's share of the kernel's tasks (parallel_over_tasks).
    if (L.packed)
      paged_attention_packed_run(q_view, k_cache_t, v_cache_t, block_table, seq_lens, attn, shape, L.scale, L.window,
                                 nullptr, hidden_keys);
    else
      paged_attention_decode_run(q_view, k_cache_t, v_cache_t, block_table, seq_lens, attn, shape, L.scale,
                                 L.window, nullptr, hidden_keys);
#pragma omp barrier
    // D: o.
    sc.quantize(attn_p, q_size);
    const RegionShare o_panels = region_share(L.hidden / kNP);
    sc.gemv(L.w_o, nullptr, h, q_size, L.hidden, o_panels.begin, o_panels.end);
#pragma omp barrier
    // E: the post-attention norm, whole row; gate and up of the same columns, then their SiLU-and-mul.
    rms_norm_row(h, res, sc.sum.data(), norm_post, sc.xn.data(), L.hidden, L.eps);
    sc.quantize(sc.xn.data(), L.hidden);
    const RegionShare mlp = region_share(inter_panels);
    sc.gemv(L.w_gate_up, nullptr, gate_up, L.hidden, 2 * L.inter, mlp.begin, mlp.end);
    sc.gemv(L.w_gate_up, nullptr, gate_up, L.hidden, 2 * L.inter, inter_panels + mlp.begin, inter_panels + mlp.end);
    silu_and_mul_span(gate_up + mlp.begin * kNP, gate_up + L.inter + mlp.begin * kNP, act + mlp.begin * kNP,
                      (mlp.end - mlp.begin) * kNP);
#pragma omp barrier
    std::copy(sc.sum.begin() + cols.begin, sc.sum.begin() + cols.end, res + cols.begin);
    // F: down.
    sc.quantize(act, L.inter);
    const RegionShare down_panels = region_share(L.hidden / kNP);
    sc.gemv(L.w_down, nullptr, out, L.inter, L.hidden, down_panels.begin, down_panels.end);
  }
}

std::atomic<bool> row_layer_enabled{true};

}  // namespace

// Tests and benchmarks compare with decoder_layer.cpp's kernel-by-kernel path; returns the previous setting.
bool decoder_layer_row_set_enabled(bool on) { return row_layer_enabled.exchange(on); }

// decoder_layer.cpp's llama_decoder_layer for one query row where every linear is int4 and the cache is the
// standard layout of the model's dtype or the pair-packed bf16 one (no fp8); nullopt where it does not apply.
std::optional<std::tuple<at::Tensor, at::Tensor>> llama_decoder_layer_row(
    const at::Tensor& x, const c10::optional<at::Tensor>& residual, const std::vector<at::Tensor>& norms,
    const std::vector<std::vector<at::Tensor>>& linears, const c10::optional<at::Tensor>& qkv_bias,
    const std::vector<int64_t>& sizes, double eps, const at::Tensor& positions, const at::Tensor& cos,
    const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slot_mapping,
    const at::Tensor& block_table, const at::Tensor& seq_lens, double scale, bool packed, int64_t window,
    const c10::optional<at::Tensor>& k_offset, const c10::optional<at::Tensor>& hidden_keys) {
  const int64_t qkv_n = sizes[0], o_n = sizes[1], gate_up_n = sizes[2], down_n = sizes[3];
  const int64_t num_heads = sizes[4], num_kv_heads = sizes[5], hd = sizes[6], hidden = x.size(1);
  const auto int4 = [](const std::vector<at::Tensor>& w) { return w.size() == 1 && w[0].scalar_type() == at::kByte; };
  const at::ScalarType dt = x.scalar_type();
  if (!row_layer_enabled.load(std::memory_order_relaxed) || x.size(0) != 1 ||
      (packed && (dt != at::kBFloat16 || hd > kMaxHeadDim)) || (k_offset.has_value() && k_offset->defined()) ||
      !std::all_of(linears.begin(), linears.end(), int4) || k_cache.scalar_type() != dt ||
      (dt != at::kFloat && dt != at::kBFloat16) || hd % kNP != 0 || gate_up_n % (2 * kNP) != 0 ||
      hidden % kQB != 0 || (num_heads * hd) % kQB != 0 || (gate_up_n / 2) % kQB != 0 ||
      qkv_n != (num_heads + 2 * num_kv_heads) * hd || o_n != hidden || down_n != hidden || hidden % kNP != 0)
    return std::nullopt;
  for (const at::Tensor* t : {&positions, &slot_mapping}) TORCH_CHECK(t->scalar_type() == at::kLong, "int64 ids");
  TORCH_CHECK(x.is_contiguous() && cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == dt &&
                  norms[0].scalar_type() == dt && norms[1].scalar_type() == dt && norms[0].is_contiguous() &&
                  norms[1].is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.scalar_type() == dt && k_cache.size(2) == num_kv_heads && k_cache.size(3) == hd,
              "llama_decoder_layer: bad inputs");
  const bool add = residual.has_value() && residual->defined();
  if (add) TORCH_CHECK(residual->is_contiguous() && residual->sizes() == x.sizes() && residual->scalar_type() == dt);
  const auto opts = x.options();
  // One allocation for the layer's intermediates (a few us each at batch 1): qkv, attention, o, gate_up, SiLU.
  const int64_t q_size = num_heads * hd, inter = gate_up_n / 2;
  at::Tensor ws = at::empty({qkv_n + q_size + hidden + gate_up_n + inter}, opts);
  at::Tensor out = at::empty({1, hidden}, opts);
  at::Tensor q_view = ws.as_strided({1, num_heads, hd}, {q_size, hd, 1}, 0);  // qkv's first q_size values
  at::Tensor attn = ws.as_strided({1, num_heads, hd}, {q_size, hd, 1}, qkv_n);
  const PagedShape shape = packed ? check_paged_inputs(q_view, k_cache, v_cache, block_table, seq_lens)
                                  : paged_attention_decode_check(q_view, k_cache, v_cache, block_table, seq_lens);
  const int64_t* hidden_bits = hidden_keys_ptr(hidden_keys, shape.num_seqs);
  at::Tensor bias_padded;
  if (qkv_bias.has_value() && qkv_bias->defined()) {
    const int64_t panels = (qkv_n + kNP - 1) / kNP;
    TORCH_CHECK(qkv_bias->numel() == qkv_n, "qkv bias [n]");
    bias_padded = at::zeros({panels * kNP}, opts.dtype(at::kFloat));
    bias_padded.narrow(0, 0, qkv_n).copy_(qkv_bias->reshape({qkv_n}));
  }
  const RowLayer L{hidden,
                   qkv_n,
                   inter,
                   num_heads,
                   num_kv_heads,
                   hd,
                   linears[0][0].data_ptr<uint8_t>(),
                   linears[1][0].data_ptr<uint8_t>(),
                   linears[2][0].data_ptr<uint8_t>(),
                   linears[3][0].data_ptr<uint8_t>(),
                   bias_padded.defined() ? bias_padded.data_ptr<float>() : nullptr,
                   static_cast<float>(eps),
                   static_cast<float>(scale),
                   window,
                   positions.data_ptr<int64_t>()[0],
                   slot_mapping.data_ptr<int64_t>()[0],
                   packed,
                   k_cache.size(1)};
  dispatch_float(x, [&](auto tag) {
    using T = decltype(tag);
    T* ws_p = ws.data_ptr<T>();
    run_row_layer<T>(L, x.data_ptr<T>(), add ? residual->data_ptr<T>() : x.data_ptr<T>(), add, norms[0].data_ptr<T>(),
                     norms[1].data_ptr<T>(), cos.data_ptr<T>(), sin.data_ptr<T>(), k_cache.data_ptr<T>(),
                     v_cache.data_ptr<T>(), q_view, k_cache, v_cache, block_table, seq_lens, attn, shape,
                     hidden_bits, ws_p, ws_p + qkv_n + q_size, ws_p + qkv_n + q_size + hidden,
                     ws_p + qkv_n + q_size + hidden + gate_up_n, out.data_ptr<T>());
  });
  return std::make_tuple(out, add ? *residual : x);
}
