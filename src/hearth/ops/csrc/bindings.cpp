// One extension module for every CPU kernel, so they build (and are cached) together.
#include <torch/extension.h>

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool,
                                     torch::Tensor page_table, torch::Tensor context_lens,
                                     torch::Tensor first_positions, int64_t page_size, double scale);
torch::Tensor paged_decode_attention_fp8(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool,
                                         torch::Tensor k_scale, torch::Tensor v_scale, torch::Tensor page_table,
                                         torch::Tensor context_lens, torch::Tensor first_positions,
                                         int64_t page_size, double scale);
torch::Tensor paged_decode_attention_bf16(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool,
                                          torch::Tensor page_table, torch::Tensor context_lens,
                                          torch::Tensor first_positions, int64_t page_size, double scale);
torch::Tensor rotary_write_kv_fp8(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t heads,
                                  torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor slot_mapping,
                                  torch::Tensor k_scale, torch::Tensor v_scale);
torch::Tensor int4_skinny_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales,
                                torch::Tensor zero_scaled, int64_t group_size, std::optional<torch::Tensor> bias,
                                bool int8_activations);
torch::Tensor int8_skinny_linear(torch::Tensor x, torch::Tensor q, torch::Tensor scales, int64_t group_size,
                                std::optional<torch::Tensor> bias);
torch::Tensor bf16_skinny_linear(torch::Tensor x, torch::Tensor weight, std::optional<torch::Tensor> bias);
torch::Tensor rotary_write_kv(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t heads,
                              torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor slot_mapping);
std::tuple<torch::Tensor, torch::Tensor> rms_norm(torch::Tensor x, torch::Tensor weight, double eps,
                                                  std::optional<torch::Tensor> residual);
PyObject* check_page_tags_lists(const at::Tensor& pool_tags, PyObject* page_table, PyObject* expected,
                                int64_t padding_tag);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV pool (CPU, float32)");
  m.def("bf16_skinny_linear", &bf16_skinny_linear, "x @ w^T for a few float32 rows and a bfloat16 weight (CPU)",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("bias") = pybind11::none());
  m.def("rotary_write_kv", &rotary_write_kv,
        "RoPE on a fused qkv row block: returns rotated q, writes rotated k and v into their pool slots (CPU, float32)");
  m.def("paged_decode_attention_fp8", &paged_decode_attention_fp8,
        "decode attention over an FP8 e4m3 paged KV pool with per-KV-head scales (CPU, float32 queries)");
  m.def("paged_decode_attention_bf16", &paged_decode_attention_bf16,
        "decode attention over a bfloat16 paged KV pool, read in place (CPU, float32 queries)");
  m.def("rotary_write_kv_fp8", &rotary_write_kv_fp8,
        "rotary_write_kv into FP8 e4m3 pools, keys and values divided by their head's scale");
  m.def("int4_skinny_linear", &int4_skinny_linear,
        "x @ w^T for a few float32 rows and an INT4 weight with per-group scales and zero points (CPU)",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("scales"), pybind11::arg("zero_scaled"),
        pybind11::arg("group_size"), pybind11::arg("bias") = pybind11::none(),
        pybind11::arg("int8_activations") = false);
  m.def("int8_skinny_linear", &int8_skinny_linear,
        "x @ w^T for a few float32 rows and an INT8 weight with a float32 scale per group (CPU; GGUF Q8_0)",
        pybind11::arg("x"), pybind11::arg("q"), pybind11::arg("scales"), pybind11::arg("group_size"),
        pybind11::arg("bias") = pybind11::none());
  m.def("rms_norm", &rms_norm, "RMSNorm of float32 rows, optionally after adding a residual: (out, x + residual)",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("eps"), pybind11::arg("residual") = pybind11::none());
  m.def(
      "check_page_tags",
      [](const torch::Tensor& pool_tags, const pybind11::list& page_table, const pybind11::list& expected,
         int64_t padding_tag) {
        PyObject* bad = check_page_tags_lists(pool_tags, page_table.ptr(), expected.ptr(), padding_tag);
        if (bad == nullptr) throw pybind11::error_already_set();
        return pybind11::reinterpret_steal<pybind11::list>(bad);
      },
      "KV integrity: flat indices of the page table entries whose page lacks the expected tag (CPU, int lists)");
}
