// Rotate-half RoPE on the fused qkv projection, writing keys and values straight into their KV
// pool slots. It replaces ~25 small torch ops per layer (split, views, two rotations of ~11 ops
// each, two casts and two index copies), whose dispatch dominates at decode batch sizes.
// An FP8 variant quantizes keys and values by their head's scale as it writes them; a bf16 one (a bf16 model's
// prompt chunks) rounds where the torch path rounds, so both write the same bytes.
// ATen headers only: torch/extension.h (pybind, autograd) triples the compile time; bindings.cpp has it.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16_bits.h"
#include "fp8_e4m3.h"

namespace {

void check_inputs(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                  const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& slot_mapping) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == at::kFloat && qkv.is_contiguous(),
              "rotary_write_kv: qkv must be a contiguous float32 [tokens, features] tensor");
  TORCH_CHECK(k_pool.scalar_type() == v_pool.scalar_type() && k_pool.is_contiguous() && v_pool.is_contiguous() &&
                  k_pool.dim() == 3 && k_pool.sizes() == v_pool.sizes(),
              "rotary_write_kv: contiguous [slots, kv_heads, dim] pools of one dtype only");
  const int64_t n = qkv.size(0), kv_heads = k_pool.size(1), dim = k_pool.size(2), half = dim / 2;
  TORCH_CHECK(dim % 2 == 0 && qkv.size(1) == (heads + 2 * kv_heads) * dim,
              "rotary_write_kv: qkv has ", qkv.size(1), " features, heads and pools imply ", (heads + 2 * kv_heads) * dim);
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.size(0) == n &&
                  sin.size(0) == n && cos.size(1) == half && sin.size(1) == half && cos.stride(1) == 1 &&
                  sin.stride(1) == 1,
              "rotary_write_kv: cos/sin must be float32 [tokens, dim / 2] with unit inner stride");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.numel() == n,
              "rotary_write_kv: slot_mapping must be int64 [tokens]");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t num_slots = k_pool.size(0);
  for (int64_t t = 0; t < n; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "rotary_write_kv: slot ", slots[t], " out of range");
  }
}

// `put(t, kv_row, which, values)` stores one token's rotated keys (which = 0) or values (1), all KV heads.
template <typename Put>
at::Tensor rotate_and_put(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                          int64_t kv_heads, int64_t dim, const Put& put) {
  const int64_t n = qkv.size(0), half = dim / 2;
  at::Tensor q = at::empty({n, heads, dim}, qkv.options());
  const float* src = qkv.data_ptr<float>();
  const float* cos_ptr = cos.data_ptr<float>();
  const float* sin_ptr = sin.data_ptr<float>();
  const int64_t cos_stride = cos.stride(0), sin_stride = sin.stride(0);
  float* q_ptr = q.data_ptr<float>();
  const int64_t row = (heads + 2 * kv_heads) * dim;
  at::parallel_for(0, n, std::max<int64_t>(1, 4096 / std::max<int64_t>(row, 1)), [&](int64_t begin, int64_t end) {
    std::vector<float> rotated_k(kv_heads * dim);
    for (int64_t t = begin; t < end; ++t) {
      const float* x = src + t * row;
      const float* c = cos_ptr + t * cos_stride;
      const float* s = sin_ptr + t * sin_stride;
      auto rotate = [&](const float* in, float* out) {
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = in[i], x2 = in[i + half];
          out[i] = x1 * c[i] - x2 * s[i];
          out[i + half] = x2 * c[i] + x1 * s[i];
        }
      };
      for (int64_t h = 0; h < heads; ++h) rotate(x + h * dim, q_ptr + (t * heads + h) * dim);
      const float* k_in = x + heads * dim;
      const float* v_in = k_in + kv_heads * dim;
      for (int64_t h = 0; h < kv_heads; ++h) rotate(k_in + h * dim, rotated_k.data() + h * dim);
      put(t, 0, rotated_k.data());
      put(t, 1, v_in);
    }
  });
  return q;
}

}  // namespace

at::Tensor rotary_write_kv(at::Tensor qkv,           // [n, (heads + 2 * kv_heads) * dim], contiguous
                           at::Tensor cos,           // [n, dim / 2], unit inner stride
                           at::Tensor sin,           // [n, dim / 2], unit inner stride
                           int64_t heads, at::Tensor k_pool,  // [num_slots, kv_heads, dim]
                           at::Tensor v_pool,        // [num_slots, kv_heads, dim]
                           at::Tensor slot_mapping)  // [n] int64
{
  check_inputs(qkv, cos, sin, heads, k_pool, v_pool, slot_mapping);
  TORCH_CHECK(k_pool.scalar_type() == at::kFloat, "rotary_write_kv: float32 pools only (FP8: rotary_write_kv_fp8)");
  const int64_t kv_heads = k_pool.size(1), dim = k_pool.size(2), width = kv_heads * dim;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  float* pools[2] = {k_pool.data_ptr<float>(), v_pool.data_ptr<float>()};
  return rotate_and_put(qkv, cos, sin, heads, kv_heads, dim, [&](int64_t t, int which, const float* values) {
    float* out = pools[which] + slots[t] * width;
    for (int64_t i = 0; i < width; ++i) out[i] = values[i];
  });
}

at::Tensor rotary_write_kv_fp8(at::Tensor qkv, at::Tensor cos, at::Tensor sin, int64_t heads,
                               at::Tensor k_pool,        // [num_slots, kv_heads, dim] float8_e4m3fn
                               at::Tensor v_pool,        // [num_slots, kv_heads, dim] float8_e4m3fn
                               at::Tensor slot_mapping,  // [n] int64
                               at::Tensor k_scale,       // [kv_heads] float32: stored = key / scale
                               at::Tensor v_scale)       // [kv_heads] float32
{
  check_inputs(qkv, cos, sin, heads, k_pool, v_pool, slot_mapping);
  TORCH_CHECK(k_pool.scalar_type() == at::kFloat8_e4m3fn, "rotary_write_kv_fp8: float8_e4m3fn pools only");
  const int64_t kv_heads = k_pool.size(1), dim = k_pool.size(2), width = kv_heads * dim;
  TORCH_CHECK(k_scale.scalar_type() == at::kFloat && v_scale.scalar_type() == at::kFloat &&
                  k_scale.numel() == kv_heads && v_scale.numel() == kv_heads && k_scale.is_contiguous() &&
                  v_scale.is_contiguous(),
              "rotary_write_kv_fp8: float32 [kv_heads] scales");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  uint8_t* pools[2] = {reinterpret_cast<uint8_t*>(k_pool.data_ptr()), reinterpret_cast<uint8_t*>(v_pool.data_ptr())};
  const float* scales[2] = {k_scale.data_ptr<float>(), v_scale.data_ptr<float>()};
  return rotate_and_put(qkv, cos, sin, heads, kv_heads, dim, [&](int64_t t, int which, const float* values) {
    uint8_t* out = pools[which] + slots[t] * width;
    for (int64_t h = 0; h < kv_heads; ++h) {
      // A division, as the torch store does, so both paths write the same bytes.
      const float s = scales[which][h];
      for (int64_t d = 0; d < dim; ++d) out[h * dim + d] = hearth::float_to_fp8_e4m3(values[h * dim + d] / s);
    }
  });
}

namespace {

using hearth::bf16_to_float;
using hearth::round_to_bf16;

// out = (x1 c - x2 s, x2 c + x1 s) over one head, each product and sum rounded to bf16 as torch's bf16 ops do.
inline void rotate_bf16(const uint16_t* in, const uint16_t* c, const uint16_t* s, int64_t half, uint16_t* out) {
  int64_t i = 0;
#if defined(HEARTH_BF16_VECTORS)
  using hearth::load_bf16x16;
  using hearth::round_to_bf16x16;
  for (; i + 16 <= half; i += 16) {
    const __m512 x1 = load_bf16x16(in + i), x2 = load_bf16x16(in + i + half);
    const __m512 cv = load_bf16x16(c + i), sv = load_bf16x16(s + i);
    const __m512 a = _mm512_sub_ps(round_to_bf16x16(_mm512_mul_ps(x1, cv)), round_to_bf16x16(_mm512_mul_ps(x2, sv)));
    const __m512 b = _mm512_add_ps(round_to_bf16x16(_mm512_mul_ps(x2, cv)), round_to_bf16x16(_mm512_mul_ps(x1, sv)));
    hearth::store_bf16x16(out + i, a);
    hearth::store_bf16x16(out + i + half, b);
  }
#endif
  for (; i < half; ++i) {
    const float x1 = bf16_to_float(in[i]), x2 = bf16_to_float(in[i + half]);
    const float cv = bf16_to_float(c[i]), sv = bf16_to_float(s[i]);
    out[i] = hearth::float_to_bf16(round_to_bf16(x1 * cv) - round_to_bf16(x2 * sv));
    out[i + half] = hearth::float_to_bf16(round_to_bf16(x2 * cv) + round_to_bf16(x1 * sv));
  }
}

}  // namespace

at::Tensor rotary_write_kv_bf16(at::Tensor qkv,  // [n, (heads + 2 * kv_heads) * dim] bf16, contiguous
                                at::Tensor cos,  // [n, dim / 2] bf16, unit inner stride
                                at::Tensor sin,  // [n, dim / 2] bf16, unit inner stride
                                int64_t heads, at::Tensor k_pool, at::Tensor v_pool,  // bf16 [slots, kv_heads, dim]
                                at::Tensor slot_mapping) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == at::kBFloat16 && qkv.is_contiguous(),
              "rotary_write_kv_bf16: qkv must be a contiguous bf16 [tokens, features] tensor");
  TORCH_CHECK(k_pool.scalar_type() == at::kBFloat16 && v_pool.scalar_type() == at::kBFloat16 && k_pool.dim() == 3 &&
                  k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.sizes() == v_pool.sizes(),
              "rotary_write_kv_bf16: contiguous bf16 [slots, kv_heads, dim] pools");
  const int64_t n = qkv.size(0), kv_heads = k_pool.size(1), dim = k_pool.size(2), half = dim / 2;
  TORCH_CHECK(dim % 2 == 0 && qkv.size(1) == (heads + 2 * kv_heads) * dim, "rotary_write_kv_bf16: qkv has ",
              qkv.size(1), " features, heads and pools imply ", (heads + 2 * kv_heads) * dim);
  TORCH_CHECK(cos.scalar_type() == at::kBFloat16 && sin.scalar_type() == at::kBFloat16 && cos.size(0) == n &&
                  sin.size(0) == n && cos.size(1) == half && sin.size(1) == half && cos.stride(1) == 1 &&
                  sin.stride(1) == 1,
              "rotary_write_kv_bf16: cos/sin must be bf16 [tokens, dim / 2] with unit inner stride");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.numel() == n,
              "rotary_write_kv_bf16: slot_mapping must be int64 [tokens]");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t num_slots = k_pool.size(0);
  for (int64_t t = 0; t < n; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "rotary_write_kv_bf16: slot ", slots[t], " out of range");
  }
  at::Tensor q = at::empty({n, heads, dim}, qkv.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(qkv.data_ptr());
  const uint16_t* cos_ptr = reinterpret_cast<const uint16_t*>(cos.data_ptr());
  const uint16_t* sin_ptr = reinterpret_cast<const uint16_t*>(sin.data_ptr());
  uint16_t* q_ptr = reinterpret_cast<uint16_t*>(q.data_ptr());
  uint16_t* k_ptr = reinterpret_cast<uint16_t*>(k_pool.data_ptr());
  uint16_t* v_ptr = reinterpret_cast<uint16_t*>(v_pool.data_ptr());
  const int64_t row = (heads + 2 * kv_heads) * dim, width = kv_heads * dim;
  const int64_t cos_stride = cos.stride(0), sin_stride = sin.stride(0);
  at::parallel_for(0, n, std::max<int64_t>(1, 4096 / std::max<int64_t>(row, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint16_t* x = src + t * row;
      const uint16_t* c = cos_ptr + t * cos_stride;
      const uint16_t* s = sin_ptr + t * sin_stride;
      for (int64_t h = 0; h < heads; ++h) rotate_bf16(x + h * dim, c, s, half, q_ptr + (t * heads + h) * dim);
      for (int64_t h = 0; h < kv_heads; ++h)
        rotate_bf16(x + (heads + h) * dim, c, s, half, k_ptr + slots[t] * width + h * dim);
      std::memcpy(v_ptr + slots[t] * width, x + (heads + kv_heads) * dim, width * sizeof(uint16_t));
    }
  });
  return q;
}
