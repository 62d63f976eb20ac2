// The fused decoder layer's entry points (decoder_layer.cpp), for bindings.cpp.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>
#include <vector>

std::tuple<at::Tensor, at::Tensor> llama_decoder_layer(
    const at::Tensor& x_in, const c10::optional<at::Tensor>& residual, const std::vector<at::Tensor>& norms,
    const std::vector<std::vector<at::Tensor>>& linears, const c10::optional<at::Tensor>& qkv_bias,
    const std::vector<int64_t>& sizes, double eps, const at::Tensor& positions, const at::Tensor& cos,
    const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slot_mapping,
    const at::Tensor& block_table, const at::Tensor& seq_lens, double scale, bool packed, int64_t window,
    const c10::optional<at::Tensor>& k_offset, const c10::optional<at::Tensor>& hidden_keys,
    const c10::optional<at::Tensor>& chunks = c10::nullopt);

// decoder_layer_row.cpp: one query row, int4 linears, in one parallel region (nullopt where it does not apply).
std::optional<std::tuple<at::Tensor, at::Tensor>> llama_decoder_layer_row(
    const at::Tensor& x, const c10::optional<at::Tensor>& residual, const std::vector<at::Tensor>& norms,
    const std::vector<std::vector<at::Tensor>>& linears, const c10::optional<at::Tensor>& qkv_bias,
    const std::vector<int64_t>& sizes, double eps, const at::Tensor& positions, const at::Tensor& cos,
    const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slot_mapping,
    const at::Tensor& block_table, const at::Tensor& seq_lens, double scale, bool packed, int64_t window,
    const c10::optional<at::Tensor>& k_offset, const c10::optional<at::Tensor>& hidden_keys);

// Every layer of a model through llama_decoder_layer in one call from Python. A layer's fixed arguments are given
// once (add_layer); a step passes only its own. At batch 1 the per-layer crossing (argument conversion, the
// Python loop and its attribute reads) was ~5% of a decode step on a 30-layer model.
class LlamaLayerStack {
 public:
  void add_layer(std::vector<at::Tensor> norms, std::vector<std::vector<at::Tensor>> linears,
                 c10::optional<at::Tensor> qkv_bias, std::vector<int64_t> sizes, double eps, at::Tensor cos,
                 at::Tensor sin, double scale, int64_t window);
  // kv_caches: one (k, v) per layer. Returns (last layer's output, residual stream); no key offsets (fp8 caches
  // with centred keys take the per-layer calls).
  std::tuple<at::Tensor, at::Tensor> forward(at::Tensor x, at::Tensor positions,
                                             const std::vector<std::tuple<at::Tensor, at::Tensor>>& kv_caches,
                                             at::Tensor slot_mapping, at::Tensor block_table, at::Tensor seq_lens,
                                             bool packed, c10::optional<at::Tensor> hidden_keys,
                                             c10::optional<at::Tensor> chunks) const;
  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  struct Layer {
    std::vector<at::Tensor> norms;
    std::vector<std::vector<at::Tensor>> linears;
    c10::optional<at::Tensor> qkv_bias;
    std::vector<int64_t> sizes;
    double eps;
    at::Tensor cos, sin;
    double scale;
    int64_t window;
  };
  std::vector<Layer> layers_;
};
