// A decode step through every layer of a dense Llama-family model in one call (float32 activations, CPU).
//
// A decode layer is ~10 small kernels (two norms, four projections, RoPE + KV write, attention, SiLU x up). Run
// from Python each costs a module call, argument checks and a dispatch: on a 30-layer model at batch 1 that
// was ~4 ms of an 11 ms step. Here the same kernels (the very functions the Python path calls) are chained in
// C++, so a layer's cost is the bytes its weights and KV pages take to read. The numerics are the Python
// path's exactly: the same kernels in the same order; SiLU x up is ATen's own silu and mul.
//
// The stack holds each layer's weights (views of the model's own tensors, nothing copied) and its KV pool
// tensors; `hearth.model.fused_decode` builds it, decides per step whether the step qualifies (decode rows
// only, one rank, this layer shape) and runs the rest of the model (embedding, final norm, head) itself.
#include "decode_stack.h"

#include <ATen/ops/mul.h>
#include <ATen/ops/silu.h>

at::Tensor bf16_skinny_linear(at::Tensor x, at::Tensor weight, std::optional<at::Tensor> bias);
at::Tensor int4_skinny_linear(at::Tensor x, at::Tensor packed, at::Tensor scales, at::Tensor zero_scaled,
                              int64_t group_size, std::optional<at::Tensor> bias, bool int8_activations);
at::Tensor int8_skinny_linear(at::Tensor x, at::Tensor q, at::Tensor scales, int64_t group_size,
                              std::optional<at::Tensor> bias);
std::tuple<at::Tensor, at::Tensor> rms_norm(at::Tensor x, at::Tensor weight, double eps,
                                            std::optional<at::Tensor> residual);
at::Tensor rotary_write_kv(at::Tensor qkv, at::Tensor cos, at::Tensor sin, int64_t heads, at::Tensor k_pool,
                           at::Tensor v_pool, at::Tensor slot_mapping);
at::Tensor rotary_write_kv_fp8(at::Tensor qkv, at::Tensor cos, at::Tensor sin, int64_t heads, at::Tensor k_pool,
                               at::Tensor v_pool, at::Tensor slot_mapping, at::Tensor k_scale, at::Tensor v_scale);
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_pool, at::Tensor v_pool, at::Tensor page_table,
                                  at::Tensor context_lens, at::Tensor first_positions, int64_t page_size,
                                  double scale);
at::Tensor paged_decode_attention_fp8(at::Tensor q, at::Tensor k_pool, at::Tensor v_pool, at::Tensor k_scale,
                                      at::Tensor v_scale, at::Tensor page_table, at::Tensor context_lens,
                                      at::Tensor first_positions, int64_t page_size, double scale);

at::Tensor DecodeLinear::operator()(const at::Tensor& x) const {
  switch (kind) {
    case kInt4:
      // As `hearth.ops.int4.int4_linear` chooses, so both paths compute alike.
      return int4_skinny_linear(x, a, b, c, group_size, bias,
                                int8_activations && x.size(0) <= int8_activations_max_rows);
    case kInt8:
      return int8_skinny_linear(x, a, b, group_size, bias);
    case kBf16:
      return bf16_skinny_linear(x, a, bias);
    default:
      TORCH_CHECK(false, "decode stack: unknown linear kind ", kind);
  }
}

void DecodeStack::add_layer(DecodeLayer layer) {
  TORCH_CHECK(layer.k_pool.dim() == 3 && layer.k_pool.size(1) == layer.num_kv_heads &&
                  layer.k_pool.size(2) == layer.head_dim,
              "decode stack: the KV pool is not [slots, kv_heads, head_dim]");
  TORCH_CHECK(layer.k_scale.has_value() == layer.v_scale.has_value(), "decode stack: K and V scales go together");
  layers_.push_back(std::move(layer));
}

std::tuple<at::Tensor, at::Tensor> DecodeStack::forward(at::Tensor hidden, std::optional<at::Tensor> residual,
                                                        const at::Tensor& cos, const at::Tensor& sin,
                                                        const at::Tensor& slot_mapping, const at::Tensor& page_table,
                                                        const at::Tensor& seq_lens,
                                                        const at::Tensor& first_positions, int64_t page_size) const {
  const int64_t rows = hidden.size(0);
  at::Tensor stream = residual.has_value() ? *residual : at::Tensor();
  for (const DecodeLayer& layer : layers_) {
    at::Tensor normed;
    if (stream.defined()) {
      std::tie(normed, stream) = rms_norm(hidden, layer.input_norm, layer.eps, stream);
    } else {
      stream = hidden;
      normed = std::get<0>(rms_norm(hidden, layer.input_norm, layer.eps, std::nullopt));
    }
    const at::Tensor qkv = layer.qkv(normed);
    at::Tensor q, attended;
    if (layer.k_scale.has_value()) {
      q = rotary_write_kv_fp8(qkv, cos, sin, layer.num_heads, layer.k_pool, layer.v_pool, slot_mapping,
                              *layer.k_scale, *layer.v_scale);
      attended = paged_decode_attention_fp8(q, layer.k_pool, layer.v_pool, *layer.k_scale, *layer.v_scale,
                                            page_table, seq_lens, first_positions, page_size, layer.scale);
    } else {
      q = rotary_write_kv(qkv, cos, sin, layer.num_heads, layer.k_pool, layer.v_pool, slot_mapping);
      attended = paged_decode_attention(q, layer.k_pool, layer.v_pool, page_table, seq_lens, first_positions,
                                        page_size, layer.scale);
    }
    const at::Tensor projected = layer.o(attended.reshape({rows, layer.num_heads * layer.head_dim}));
    std::tie(normed, stream) = rms_norm(projected, layer.post_norm, layer.eps, stream);
    const at::Tensor gate_up = layer.gate_up(normed);
    const int64_t intermediate = gate_up.size(1) / 2;
    // As the Python MLP: silu into a fresh tensor, times up in place.
    at::Tensor activated = at::silu(gate_up.narrow(1, 0, intermediate));
    activated.mul_(gate_up.narrow(1, intermediate, intermediate));
    hidden = layer.down(activated);
  }
  return {hidden, stream};
}
