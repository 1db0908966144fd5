// One extension module for every CPU kernel, so they build (and are cached) together.
#include <torch/extension.h>

#include "decode_stack.h"

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
                                std::optional<torch::Tensor> bias, bool int8_activations);
torch::Tensor bf16_skinny_linear(torch::Tensor x, torch::Tensor weight, std::optional<torch::Tensor> bias);
torch::Tensor rotary_write_kv(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t heads,
                              torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor slot_mapping);
std::tuple<torch::Tensor, torch::Tensor> rms_norm(torch::Tensor x, torch::Tensor weight, double eps,
                                                  std::optional<torch::Tensor> residual);
at::Tensor prefill_attention(at::Tensor q, at::Tensor k_pool, at::Tensor v_pool, std::optional<at::Tensor> k_scale,
                             std::optional<at::Tensor> v_scale, at::Tensor page_ids, int64_t context_len,
                             int64_t page_size, int64_t window, double scale);
std::string prefill_attention_isa(at::ScalarType dtype);
at::Tensor rotary_write_kv_bf16(at::Tensor qkv, at::Tensor cos, at::Tensor sin, int64_t heads, at::Tensor k_pool,
                                at::Tensor v_pool, at::Tensor slot_mapping);
at::Tensor silu_and_mul_bf16(at::Tensor gate_up);
at::Tensor int4_dequantize_bf16(at::Tensor packed, at::Tensor scales, at::Tensor zero_scaled, int64_t group_size);
at::Tensor int8_dequantize_bf16(at::Tensor q, at::Tensor scales, int64_t group_size);
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
        pybind11::arg("bias") = pybind11::none(), pybind11::arg("int8_activations") = false);
  m.def("prefill_attention", &prefill_attention,
        "causal flash-style attention of a prompt chunk over its paged context (CPU tiles: AVX512-BF16 or AVX-512)",
        pybind11::arg("q"), pybind11::arg("k_pool"), pybind11::arg("v_pool"), pybind11::arg("k_scale"),
        pybind11::arg("v_scale"), pybind11::arg("page_ids"), pybind11::arg("context_len"), pybind11::arg("page_size"),
        pybind11::arg("window"), pybind11::arg("scale"));
  m.def("prefill_attention_isa", &prefill_attention_isa,
        "the tile math this build has for queries of a dtype: avx512_bf16, avx512, or '' (none)");
  m.def("rotary_write_kv_bf16", &rotary_write_kv_bf16,
        "rotary_write_kv for a bf16 model: bf16 qkv, cos/sin and pools, rounded as the torch path rounds");
  m.def("silu_and_mul_bf16", &silu_and_mul_bf16, "SiLU(gate) x up of a bf16 [rows, 2 * intermediate] in one pass");
  m.def("int4_dequantize_bf16", &int4_dequantize_bf16,
        "an INT4 weight (int4_skinny_linear's packed layout) as a dense bfloat16 [out, in]");
  m.def("int8_dequantize_bf16", &int8_dequantize_bf16, "an INT8 weight with group scales as a dense bfloat16 [out, in]");
  m.def("rms_norm", &rms_norm, "RMSNorm of float32 rows, optionally after adding a residual: (out, x + residual)",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("eps"), pybind11::arg("residual") = pybind11::none());
  pybind11::class_<DecodeLinear>(m, "DecodeLinear")
      .def(pybind11::init([](int64_t kind, torch::Tensor a, std::optional<torch::Tensor> b,
                             std::optional<torch::Tensor> c, int64_t group_size, bool int8_activations,
                             int64_t int8_activations_max_rows, std::optional<torch::Tensor> bias) {
             TORCH_CHECK(kind >= DecodeLinear::kInt4 && kind <= DecodeLinear::kBf16, "DecodeLinear: unknown kind");
             DecodeLinear linear;
             linear.kind = kind;
             linear.a = a;
             linear.b = b.value_or(torch::Tensor());
             linear.c = c.value_or(torch::Tensor());
             linear.group_size = group_size;
             linear.int8_activations = int8_activations;
             linear.int8_activations_max_rows = int8_activations_max_rows;
             linear.bias = bias;
             return linear;
           }),
           pybind11::arg("kind"), pybind11::arg("a"), pybind11::arg("b") = pybind11::none(),
           pybind11::arg("c") = pybind11::none(), pybind11::arg("group_size") = 0,
           pybind11::arg("int8_activations") = false, pybind11::arg("int8_activations_max_rows") = 0,
           pybind11::arg("bias") = pybind11::none());
  pybind11::class_<DecodeStack>(m, "DecodeStack")
      .def(pybind11::init<>())
      .def(
          "add_layer",
          [](DecodeStack& stack, torch::Tensor input_norm, torch::Tensor post_norm, double eps, DecodeLinear qkv,
             DecodeLinear o, DecodeLinear gate_up, DecodeLinear down, torch::Tensor k_pool, torch::Tensor v_pool,
             std::optional<torch::Tensor> k_scale, std::optional<torch::Tensor> v_scale, int64_t num_heads,
             int64_t num_kv_heads, int64_t head_dim, double scale) {
            stack.add_layer(DecodeLayer{input_norm, post_norm, eps, qkv, o, gate_up, down, k_pool, v_pool, k_scale,
                                        v_scale, num_heads, num_kv_heads, head_dim, scale});
          },
          pybind11::arg("input_norm"), pybind11::arg("post_norm"), pybind11::arg("eps"), pybind11::arg("qkv"),
          pybind11::arg("o"), pybind11::arg("gate_up"), pybind11::arg("down"), pybind11::arg("k_pool"),
          pybind11::arg("v_pool"), pybind11::arg("k_scale"), pybind11::arg("v_scale"), pybind11::arg("num_heads"),
          pybind11::arg("num_kv_heads"), pybind11::arg("head_dim"), pybind11::arg("scale"))
      .def_property_readonly("num_layers", &DecodeStack::num_layers)
      .def("forward", &DecodeStack::forward, pybind11::arg("hidden"), pybind11::arg("residual"), pybind11::arg("cos"),
           pybind11::arg("sin"), pybind11::arg("slot_mapping"), pybind11::arg("page_table"), pybind11::arg("seq_lens"),
           pybind11::arg("first_positions"), pybind11::arg("page_size"),
           pybind11::call_guard<pybind11::gil_scoped_release>());
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
