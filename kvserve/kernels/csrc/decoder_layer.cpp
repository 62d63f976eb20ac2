// One Llama-family decoder layer in a single call, for steps whose every query row goes through the paged
// attention kernel (decodes and small prefill chunks) with weights in a panel layout (float: linear.cpp, bf16 pairs:
// linear_bf16.cpp, int8: int8_linear.cpp).
//
// It runs the same kernels, on the same inputs, in the same order as the Python modules of models/llama.py
// (LlamaDecoderLayer.forward), so its results are bitwise those of the module path; what it removes is the
// ~60-70 us per layer of Python and dispatch between them (about 2 ms of a ~20 ms batch-1 step on a 30-layer model).

#include "decoder_layer.h"

#include <ATen/ATen.h>

#include <optional>
#include <tuple>
#include <vector>

void rms_norm_(at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor weight, double eps);
void rotary_(at::Tensor qk, at::Tensor positions, at::Tensor cos, at::Tensor sin, int64_t num_heads, int64_t head_dim);
at::Tensor silu_and_mul(at::Tensor x);
void write_kv(at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slot_mapping,
              bool packed);
at::Tensor linear_packed(at::Tensor x, at::Tensor wp, int64_t n, c10::optional<at::Tensor> bias);
at::Tensor linear_bf16_pairs(at::Tensor x, at::Tensor wp, int64_t n, c10::optional<at::Tensor> bias);
at::Tensor int8_linear(at::Tensor x, at::Tensor panels, at::Tensor scale, at::Tensor colsum, int64_t n,
                       c10::optional<at::Tensor> signs, c10::optional<at::Tensor> bias, at::ScalarType out_dtype);
at::Tensor int4_linear(at::Tensor x, at::Tensor packed, int64_t n, c10::optional<at::Tensor> bias,
                       at::ScalarType out_dtype);
at::Tensor paged_attention_decode(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_table,
                                  at::Tensor seq_lens, double scale, int64_t window,
                                  c10::optional<at::Tensor> alibi_slopes, c10::optional<at::Tensor> hidden_keys,
                                  c10::optional<at::Tensor> chunks);
at::Tensor paged_attention_packed(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_table,
                                  at::Tensor seq_lens, double scale, int64_t window,
                                  c10::optional<at::Tensor> alibi_slopes, c10::optional<at::Tensor> hidden_keys);

namespace {

// One linear layer as the module path runs it: [panels] (float panels [P, K, width], linear.cpp; bf16 pair panels
// [P, K / 2, width, 2], linear_bf16.cpp) or [panels, scale, colsum] / [panels, scale, colsum, signs] (int8,
// int8_linear.cpp; signs when the codes are rotated) or [packed] uint8 (4-bit blocks, int4_linear.cpp). Output in
// x's dtype.
at::Tensor apply_linear(const at::Tensor& x, const std::vector<at::Tensor>& w, int64_t n,
                        c10::optional<at::Tensor> bias) {
  if (w.size() == 1 && w[0].scalar_type() == at::kByte) return int4_linear(x, w[0], n, bias, x.scalar_type());
  if (w.size() == 1) return w[0].dim() == 4 ? linear_bf16_pairs(x, w[0], n, bias) : linear_packed(x, w[0], n, bias);
  TORCH_CHECK(w.size() == 3 || w.size() == 4, "llama_decoder_layer: a linear is [panels] or int8 [panels, scale, "
              "colsum(, signs)]");
  return int8_linear(x, w[0], w[1], w[2], n, w.size() == 4 ? c10::optional<at::Tensor>(w[3]) : c10::nullopt, bias,
                     x.scalar_type());
}

}  // namespace

// x [T, hidden]: the layer's input (before its input norm); residual: the residual stream, none for layer 0.
// norms: input norm, post-attention norm; an empty input norm means none (an EAGLE-1 head's layer, whose input is
// its fc output, taken as it is: then no residual either). linears: qkv, o, gate_up, down, each as apply_linear
// takes it.
// sizes: qkv, o, gate_up and down output features, query heads, kv heads, head dim.
// k_offset: [kv heads * head dim], subtracted from the keys after RoPE (fp8 caches), or none. hidden_keys, chunks:
// as paged_attention_decode takes them (chunks: the standard layout only).
// Returns (MLP output, residual), as LlamaDecoderLayer.forward does; x and residual are updated in place.
std::tuple<at::Tensor, at::Tensor> llama_decoder_layer(
    const at::Tensor& x_in, const c10::optional<at::Tensor>& residual, const std::vector<at::Tensor>& norms,
    const std::vector<std::vector<at::Tensor>>& linears, const c10::optional<at::Tensor>& qkv_bias,
    const std::vector<int64_t>& sizes, double eps, const at::Tensor& positions, const at::Tensor& cos,
    const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slot_mapping,
    const at::Tensor& block_table, const at::Tensor& seq_lens, double scale, bool packed, int64_t window,
    const c10::optional<at::Tensor>& k_offset, const c10::optional<at::Tensor>& hidden_keys,
    const c10::optional<at::Tensor>& chunks) {
  TORCH_CHECK(norms.size() == 2 && linears.size() == 4 && sizes.size() == 7,
              "llama_decoder_layer: 2 norms, 4 linears, 7 sizes");
  at::Tensor x = x_in;
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "llama_decoder_layer: contiguous x [T, hidden]");
  const int64_t qkv_n = sizes[0], o_n = sizes[1], gate_up_n = sizes[2], down_n = sizes[3];
  const int64_t num_heads = sizes[4], num_kv_heads = sizes[5], head_dim = sizes[6];
  const int64_t t = x.size(0), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const bool input_norm = norms[0].numel() > 0;
  TORCH_CHECK(input_norm || !(residual.has_value() && residual->defined()),
              "llama_decoder_layer: a layer without an input norm takes no residual");
  if (t == 1 && input_norm) {
    auto row = llama_decoder_layer_row(x, residual, norms, linears, qkv_bias, sizes, eps, positions, cos, sin, k_cache,
                                       v_cache, slot_mapping, block_table, seq_lens, scale, packed, window, k_offset,
                                       hidden_keys);
    if (row.has_value()) return *row;
  }
  at::Tensor res;
  if (residual.has_value() && residual->defined()) {
    res = *residual;
    rms_norm_(x, res, norms[0], eps);  // x = norm(x + res), res = x + res
  } else if (input_norm) {
    res = x;
    x = x.clone();
    rms_norm_(x, c10::nullopt, norms[0], eps);
  } else {
    res = x;  // read by the q/k/v projection before the post-attention norm adds into it
  }
  at::Tensor qkv = apply_linear(x, linears[0], qkv_n, qkv_bias);
  rotary_(qkv.narrow(1, 0, q_size + kv_size), positions, cos, sin, num_heads + num_kv_heads, head_dim);
  // An fp8 cache's key offset (attention/key_centering.py): subtracted before the write, as the module path does.
  if (k_offset.has_value() && k_offset->defined()) qkv.narrow(1, q_size, kv_size).sub_(*k_offset);
  write_kv(qkv.narrow(1, q_size, kv_size), qkv.narrow(1, q_size + kv_size, kv_size), k_cache, v_cache, slot_mapping,
           packed);
  at::Tensor q = qkv.narrow(1, 0, q_size).view({t, num_heads, head_dim}).contiguous();
  // NOTE: no ALiBi here: the Llama layer has RoPE (an ALiBi model runs its own layers, kvserve/models/bloom.py).
  at::Tensor attn =
      packed ? paged_attention_packed(q, k_cache, v_cache, block_table, seq_lens, scale, window, c10::nullopt,
                                      hidden_keys)
             : paged_attention_decode(q, k_cache, v_cache, block_table, seq_lens, scale, window, c10::nullopt,
                                      hidden_keys, chunks);
  at::Tensor h = apply_linear(attn.view({t, q_size}), linears[1], o_n, c10::nullopt);
  rms_norm_(h, res, norms[1], eps);  // h = norm(h + res), res = h + res
  at::Tensor out = apply_linear(silu_and_mul(apply_linear(h, linears[2], gate_up_n, c10::nullopt)), linears[3],
                                down_n, c10::nullopt);
  return {out, res};
}

void LlamaLayerStack::add_layer(std::vector<at::Tensor> norms, std::vector<std::vector<at::Tensor>> linears,
                                c10::optional<at::Tensor> qkv_bias, std::vector<int64_t> sizes, double eps,
                                at::Tensor cos, at::Tensor sin, double scale, int64_t window) {
  layers_.push_back({std::move(norms), std::move(linears), std::move(qkv_bias), std::move(sizes), eps, std::move(cos),
                     std::move(sin), scale, window});
}

std::tuple<at::Tensor, at::Tensor> LlamaLayerStack::forward(
    at::Tensor x, at::Tensor positions, const std::vector<std::tuple<at::Tensor, at::Tensor>>& kv_caches,
    at::Tensor slot_mapping, at::Tensor block_table, at::Tensor seq_lens, bool packed,
    c10::optional<at::Tensor> hidden_keys, c10::optional<at::Tensor> chunks) const {
  TORCH_CHECK(kv_caches.size() == layers_.size(), "LlamaLayerStack: one (k, v) cache per layer");
  c10::optional<at::Tensor> residual;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const Layer& l = layers_[i];
    auto [out, res] = llama_decoder_layer(x, residual, l.norms, l.linears, l.qkv_bias, l.sizes, l.eps, positions,
                                          l.cos, l.sin, std::get<0>(kv_caches[i]), std::get<1>(kv_caches[i]),
                                          slot_mapping, block_table, seq_lens, l.scale, packed, l.window,
                                          c10::nullopt, hidden_keys, chunks);
    x = std::move(out);
    residual = std::move(res);
  }
  return {x, residual.has_value() ? *residual : x};
}
