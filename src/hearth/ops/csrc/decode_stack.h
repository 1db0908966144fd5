// The decode stack's layer description (decode_stack.cpp has the why); bindings.cpp exposes it to Python.
#pragma once

#include <ATen/core/Tensor.h>

#include "skinny_linear.h"

#include <optional>
#include <tuple>
#include <vector>

// One projection `x @ w^T (+ bias)` on one of the skinny kernels, over views of the layer's own weights.
struct DecodeLinear {
  enum Kind : int64_t { kInt4 = 0, kInt8 = 1, kBf16 = 2 };
  int64_t kind = kInt4;
  at::Tensor a, b, c;  // int4: packed, scales, zero_scaled; int8: q, scales; bf16: weight
  int64_t group_size = 0;
  bool int8_activations = false;  // W4A8, for up to `int8_activations_max_rows` rows (float activations above)
  int64_t int8_activations_max_rows = 0;
  std::optional<at::Tensor> bias;

  // Pointers into the tensors above for `run_range` (set by `DecodeStack::add_layer`, after the checks).
  void bind();
  // Outputs [begin, end) of `x`'s projection (m rows, contiguous) into `y` (row stride y_stride).
  void run_range(const float* x, int64_t m, float* y, int64_t y_stride, int64_t begin, int64_t end) const;
  int64_t out_features() const { return a.size(0); }
  int64_t in_features() const;

 private:
  hearth::Int4WeightView int4_{};
  hearth::Int8WeightView int8_{};
  hearth::Bf16WeightView bf16_{};
};

// A pre-norm Llama-family decoder layer: RMSNorm, fused q/k/v, full-width rotate-half RoPE, paged attention,
// o, RMSNorm, fused gate/up, SiLU x up, down.
struct DecodeLayer {
  at::Tensor input_norm, post_norm;  // float32 [hidden]
  double eps = 1e-6;
  DecodeLinear qkv, o, gate_up, down;
  at::Tensor k_pool, v_pool;  // [slots, kv_heads, head_dim]: float32, or FP8 with the scales below
  std::optional<at::Tensor> k_scale, v_scale;  // float32 [kv_heads]
  int64_t num_heads = 0, num_kv_heads = 0, head_dim = 0;
  double scale = 1.0;  // attention's softmax scale
};

class DecodeStack {
 public:
  void add_layer(DecodeLayer layer);
  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  // Every layer for `rows` decode tokens: (the last layer's output, the residual stream before it), as the
  // Python layers return them; `residual` is the stream entering the first layer's norm (none: `hidden` is it).
  std::tuple<at::Tensor, at::Tensor> forward(at::Tensor hidden, std::optional<at::Tensor> residual,
                                             const at::Tensor& cos, const at::Tensor& sin,
                                             const at::Tensor& slot_mapping, const at::Tensor& page_table,
                                             const at::Tensor& seq_lens, const at::Tensor& first_positions,
                                             int64_t page_size) const;

 private:
  std::vector<DecodeLayer> layers_;
};
