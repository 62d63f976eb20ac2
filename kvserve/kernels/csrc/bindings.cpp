// Python bindings of the CPU kernels (the only translation unit that includes the heavy torch/extension.h).

#include <torch/extension.h>

#include "decoder_layer.h"
#include "vec.h"

at::Tensor paged_attention_decode(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_table,
                                  at::Tensor seq_lens, double scale, int64_t window,
                                  c10::optional<at::Tensor> alibi_slopes, c10::optional<at::Tensor> hidden_keys,
                                  c10::optional<at::Tensor> chunks);
at::Tensor sample_gumbel(at::Tensor logits, at::Tensor keys);
at::Tensor argmax_rows(at::Tensor logits);
std::tuple<at::Tensor, at::Tensor> topk_rows(at::Tensor x, int64_t k);
std::tuple<at::Tensor, at::Tensor> topk_log_softmax_rows(at::Tensor x, int64_t k);
void rms_norm_(at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor weight, double eps);
void rotary_(at::Tensor qk, at::Tensor positions, at::Tensor cos, at::Tensor sin, int64_t num_heads, int64_t head_dim);
at::Tensor silu_and_mul(at::Tensor x);
void write_kv(at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slot_mapping,
              bool packed);
bool packed_kv_supported(int64_t head_dim, int64_t group, int64_t block_size, bool fp8);
int64_t linear_panel_width();
at::Tensor pack_linear_weight(at::Tensor w);
at::Tensor linear_packed(at::Tensor x, at::Tensor wp, int64_t n, c10::optional<at::Tensor> bias);
bool linear_bf16_pairs_supported();
bool linear_bf16_amx_active();
bool int8_linear_amx_active();
bool linear_amx_set_enabled(bool on);
bool attention_amx_active();
bool attention_amx_set_enabled(bool on);
at::Tensor pack_linear_weight_bf16_pairs(at::Tensor w);
at::Tensor linear_bf16_pairs(at::Tensor x, at::Tensor wp, int64_t n, c10::optional<at::Tensor> bias);
at::Tensor paged_attention_packed(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_table,
                                  at::Tensor seq_lens, double scale, int64_t window,
                                  c10::optional<at::Tensor> alibi_slopes, c10::optional<at::Tensor> hidden_keys);
std::tuple<at::Tensor, at::Tensor> int8_quantize_rows(at::Tensor x, c10::optional<at::Tensor> signs);
int64_t int8_panel_width();
std::tuple<at::Tensor, at::Tensor> pack_int8_weight(at::Tensor codes);
at::Tensor unpack_int8_weight(at::Tensor panels, int64_t n, int64_t k);
at::Tensor int8_linear(at::Tensor x, at::Tensor panels, at::Tensor scale, at::Tensor colsum, int64_t n,
                       c10::optional<at::Tensor> signs, c10::optional<at::Tensor> bias, at::ScalarType out_dtype);
std::tuple<at::Tensor, at::Tensor, at::Tensor> int4_quantize_rows(at::Tensor x);
at::Tensor int4_linear(at::Tensor x, at::Tensor packed, int64_t n, c10::optional<at::Tensor> bias,
                       at::ScalarType out_dtype);
bool decoder_layer_row_set_enabled(bool on);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("vector_isa", [] { return std::string(kvserve::kVecIsa); }, "the vector helpers this library was built with");
  m.def("paged_attention_decode", &paged_attention_decode, "paged attention for single-token queries (CPU)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_table"), py::arg("seq_lens"),
        py::arg("scale"), py::arg("window") = 0, py::arg("alibi_slopes") = py::none(),
        py::arg("hidden_keys") = py::none(), py::arg("chunks") = py::none());
  m.def("rms_norm_", &rms_norm_, "in-place (residual add +) RMSNorm");
  m.def("rotary_", &rotary_, "in-place rotate-half RoPE on the first heads of each row");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up");
  m.def("write_kv", &write_kv, "write K/V rows into their cache slots (non-finite values sanitised)", py::arg("k"),
        py::arg("v"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slot_mapping"), py::arg("packed") = false);
  m.def("packed_kv_supported", &packed_kv_supported,
        "whether the packed decode kernel runs these shapes (and, with fp8, an fp8 cache) here", py::arg("head_dim"),
        py::arg("group"), py::arg("block_size"), py::arg("fp8") = false);
  m.def("paged_attention_packed", &paged_attention_packed, "paged attention over the pair-packed bf16 or fp8 cache (CPU)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_table"), py::arg("seq_lens"),
        py::arg("scale"), py::arg("window") = 0, py::arg("alibi_slopes") = py::none(),
        py::arg("hidden_keys") = py::none());
  m.def("linear_panel_width", &linear_panel_width, "weight rows per panel of pack_linear_weight's layout");
  m.def("pack_linear_weight", &pack_linear_weight, "w [N, K] -> kvserve's panel layout [P, K, panel width]");
  m.def("linear_packed", &linear_packed, "x @ w.T (+ bias) with w in the panel layout", py::arg("x"), py::arg("wp"),
        py::arg("n"), py::arg("bias") = py::none());
  m.def("linear_bf16_pairs_supported", &linear_bf16_pairs_supported, "whether the bf16 pair-panel linear runs here");
  m.def("linear_bf16_amx_active", &linear_bf16_amx_active, "whether the bf16 pair panels run on AMX tiles");
  m.def("int8_linear_amx_active", &int8_linear_amx_active, "whether batched int8 rows run on AMX tiles");
  m.def("linear_amx_set_enabled", &linear_amx_set_enabled, "turn the AMX tile paths (bf16, int8) on or off",
        py::arg("on"));
  m.def("attention_amx_active", &attention_amx_active, "whether the pair-packed bf16 attention runs on AMX tiles");
  m.def("attention_amx_set_enabled", &attention_amx_set_enabled,
        "turn attention's AMX tile path on or off (before the first call of a process: the bits differ)",
        py::arg("on"));
  m.def("pack_linear_weight_bf16_pairs", &pack_linear_weight_bf16_pairs,
        "w [N, K] bf16 -> pair panels [P, K / 2, panel width, 2]");
  m.def("linear_bf16_pairs", &linear_bf16_pairs, "x @ w.T (+ bias) with w in pair panels (AVX512-BF16)", py::arg("x"),
        py::arg("wp"), py::arg("n"), py::arg("bias") = py::none());
  m.def("int8_quantize_rows", &int8_quantize_rows, "int8 linear input: rows (rotated per 64-block) to int8 codes",
        py::arg("x"), py::arg("signs") = py::none());
  m.def("int8_panel_width", &int8_panel_width, "output channels per panel of pack_int8_weight's layout");
  m.def("pack_int8_weight", &pack_int8_weight, "int8 codes [N, K] -> (panels, column sums)");
  m.def("unpack_int8_weight", &unpack_int8_weight, "panels -> int8 codes [n, k]");
  m.def("int8_linear", &int8_linear, "W8A8 linear: rows quantized per token, int8 panels, rescaled output",
        py::arg("x"), py::arg("panels"), py::arg("scale"), py::arg("colsum"), py::arg("n"),
        py::arg("signs") = py::none(), py::arg("bias") = py::none(), py::arg("out_dtype") = at::kFloat);
  m.def("int4_quantize_rows", &int4_quantize_rows, "int4 linear input: rows to int8 per block of 32 (q, dx, mx)");
  m.def("int4_linear", &int4_linear, "4-bit block linear: Q4 panels, rows quantized per block of 32", py::arg("x"),
        py::arg("packed"), py::arg("n"), py::arg("bias") = py::none(), py::arg("out_dtype") = at::kFloat);
  m.def("llama_decoder_layer", &llama_decoder_layer, "a whole Llama decoder layer over kernel-attention rows",
        py::arg("x"), py::arg("residual"), py::arg("norms"), py::arg("linears"), py::arg("qkv_bias"), py::arg("sizes"),
        py::arg("eps"), py::arg("positions"), py::arg("cos"), py::arg("sin"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("slot_mapping"), py::arg("block_table"), py::arg("seq_lens"), py::arg("scale"), py::arg("packed"),
        py::arg("window"), py::arg("k_offset"), py::arg("hidden_keys") = py::none(), py::arg("chunks") = py::none());
  py::class_<LlamaLayerStack>(m, "LlamaLayerStack", "every decoder layer of a model in one call (decoder_layer.h)")
      .def(py::init<>())
      .def("add_layer", &LlamaLayerStack::add_layer, py::arg("norms"), py::arg("linears"), py::arg("qkv_bias"),
           py::arg("sizes"), py::arg("eps"), py::arg("cos"), py::arg("sin"), py::arg("scale"), py::arg("window"))
      .def("forward", &LlamaLayerStack::forward, py::arg("x"), py::arg("positions"), py::arg("kv_caches"),
           py::arg("slot_mapping"), py::arg("block_table"), py::arg("seq_lens"), py::arg("packed"),
           py::arg("hidden_keys") = py::none(), py::arg("chunks") = py::none())
      .def_property_readonly("num_layers", &LlamaLayerStack::num_layers);
  m.def("decoder_layer_row_set_enabled", &decoder_layer_row_set_enabled,
        "turn the one-region batch-1 int4 layer (decoder_layer_row.cpp) on or off; returns the previous setting",
        py::arg("on"));
  m.def("sample_gumbel", &sample_gumbel, "one categorical draw per row of logits (Gumbel-max, hashed noise)");
  m.def("argmax_rows", &argmax_rows, "each row's argmax as torch.argmax(dim=-1): first maximum, NaN wins");
  m.def("topk_rows", &topk_rows, "each row's k largest entries, largest first, ties to the lower index");
  m.def("topk_log_softmax_rows", &topk_log_softmax_rows, "topk_rows of each row, as log-probs (minus its logsumexp)");
}
