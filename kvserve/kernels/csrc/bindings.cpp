// Python bindings of the CPU kernels (the only translation unit that includes the heavy torch/extension.h).

#include <torch/extension.h>

at::Tensor paged_attention_decode(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_table,
                                  at::Tensor seq_lens, double scale);
at::Tensor sample_gumbel(at::Tensor logits, at::Tensor keys);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention_decode", &paged_attention_decode, "paged attention for single-token queries (CPU)");
  m.def("sample_gumbel", &sample_gumbel, "one categorical draw per row of logits (Gumbel-max, hashed noise)");
}
