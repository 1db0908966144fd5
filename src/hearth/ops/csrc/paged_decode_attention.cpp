// Decode attention over a paged KV pool on CPU: one query token per sequence, keys and values
// read in place from their pages (no gather into contiguous tensors). Float32 queries; float32 pools,
// or FP8 e4m3 pools with per-KV-head scales (dequantized per key slot as they are read).
// ATen headers only: torch/extension.h (pybind, autograd) triples the compile time; bindings.cpp has it.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "fp8_e4m3.h"

namespace {

// Keys and values come through `load(slot, which) -> const float*`: the float32 pool's row in place,
// or an FP8 row dequantized into a scratch buffer (per-head scales applied).
template <typename LoadRow>
void decode_rows(const float* q_ptr, float* o_ptr, const int64_t* table, const int64_t* lens, const int64_t* firsts,
                 int64_t n, int64_t heads, int64_t kv_heads, int64_t dim, int64_t max_pages, int64_t page_size,
                 float fscale, const LoadRow& make_loader) {
  const int64_t group = heads / kv_heads;
  // One sequence per work item: each key slot's heads are contiguous, so reading all of them
  // together walks memory in order instead of striding through it once per head.
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    auto load = make_loader();
    std::vector<float> scores;
    std::vector<float> acc(heads * dim);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t first = firsts[b];
      const int64_t num_keys = lens[b] - first;
      scores.resize(heads * num_keys);
      const float* qb = q_ptr + b * heads * dim;
      const int64_t* pages = table + b * max_pages;
      for (int64_t i = 0; i < num_keys; ++i) {
        const int64_t pos = first + i;
        const float* key = load(pages[pos / page_size] * page_size + pos % page_size, 0);
        for (int64_t head = 0; head < heads; ++head) {
          const float* qh = qb + head * dim;
          const float* kh = key + (head / group) * dim;
          float dot = 0.0f;
          for (int64_t d = 0; d < dim; ++d) dot += qh[d] * kh[d];
          scores[head * num_keys + i] = dot * fscale;
        }
      }
      for (int64_t head = 0; head < heads; ++head) {
        float* s = scores.data() + head * num_keys;
        float max_score = s[0];
        for (int64_t i = 1; i < num_keys; ++i) max_score = std::max(max_score, s[i]);
        float total = 0.0f;
        for (int64_t i = 0; i < num_keys; ++i) {
          s[i] = std::exp(s[i] - max_score);
          total += s[i];
        }
        const float inv_total = 1.0f / total;
        for (int64_t i = 0; i < num_keys; ++i) s[i] *= inv_total;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t i = 0; i < num_keys; ++i) {
        const int64_t pos = first + i;
        const float* value = load(pages[pos / page_size] * page_size + pos % page_size, 1);
        for (int64_t head = 0; head < heads; ++head) {
          const float w = scores[head * num_keys + i];
          const float* vh = value + (head / group) * dim;
          float* a = acc.data() + head * dim;
          for (int64_t d = 0; d < dim; ++d) a[d] += w * vh[d];
        }
      }
      std::copy(acc.begin(), acc.end(), o_ptr + b * heads * dim);
    }
  });
}

void check_common(const at::Tensor& q, const at::Tensor& page_table, const at::Tensor& k_pool,
                  const at::Tensor& v_pool) {
  TORCH_CHECK(q.scalar_type() == at::kFloat, "paged_decode_attention: float32 queries only");
  TORCH_CHECK(q.is_contiguous() && k_pool.is_contiguous() && v_pool.is_contiguous() && page_table.is_contiguous(),
              "paged_decode_attention: contiguous inputs only");
}

}  // namespace

at::Tensor paged_decode_attention(
    at::Tensor q,            // [n, heads, dim]
    at::Tensor k_pool,       // [num_slots, kv_heads, dim]
    at::Tensor v_pool,       // [num_slots, kv_heads, dim]
    at::Tensor page_table,   // [n, max_pages] int64
    at::Tensor context_lens, // [n] int64
    at::Tensor first_positions, // [n] int64: first key position each row attends to (sliding window)
    int64_t page_size,
    double scale) {
  TORCH_CHECK(k_pool.scalar_type() == at::kFloat && v_pool.scalar_type() == at::kFloat,
              "paged_decode_attention: float32 pools only (FP8: paged_decode_attention_fp8)");
  check_common(q, page_table, k_pool, v_pool);
  const int64_t kv_heads = k_pool.size(1), dim = q.size(2);
  auto out = at::empty_like(q);
  const float* k_ptr = k_pool.data_ptr<float>();
  const float* v_ptr = v_pool.data_ptr<float>();
  const int64_t row = kv_heads * dim;
  auto make_loader = [&]() {
    return [=](int64_t slot, int which) { return (which == 0 ? k_ptr : v_ptr) + slot * row; };
  };
  decode_rows(q.data_ptr<float>(), out.data_ptr<float>(), page_table.data_ptr<int64_t>(),
              context_lens.data_ptr<int64_t>(), first_positions.data_ptr<int64_t>(), q.size(0), q.size(1), kv_heads,
              dim, page_table.size(1), page_size, static_cast<float>(scale), make_loader);
  return out;
}

at::Tensor paged_decode_attention_fp8(
    at::Tensor q,            // [n, heads, dim] float32
    at::Tensor k_pool,       // [num_slots, kv_heads, dim] float8_e4m3fn
    at::Tensor v_pool,       // [num_slots, kv_heads, dim] float8_e4m3fn
    at::Tensor k_scale,      // [kv_heads] float32: stored keys times this are the keys
    at::Tensor v_scale,      // [kv_heads] float32
    at::Tensor page_table,   // [n, max_pages] int64
    at::Tensor context_lens, // [n] int64
    at::Tensor first_positions, // [n] int64
    int64_t page_size,
    double scale) {
  TORCH_CHECK(k_pool.scalar_type() == at::kFloat8_e4m3fn && v_pool.scalar_type() == at::kFloat8_e4m3fn,
              "paged_decode_attention_fp8: float8_e4m3fn pools only");
  check_common(q, page_table, k_pool, v_pool);
  const int64_t kv_heads = k_pool.size(1), dim = q.size(2);
  TORCH_CHECK(k_scale.scalar_type() == at::kFloat && v_scale.scalar_type() == at::kFloat &&
                  k_scale.numel() == kv_heads && v_scale.numel() == kv_heads && k_scale.is_contiguous() &&
                  v_scale.is_contiguous(),
              "paged_decode_attention_fp8: float32 [kv_heads] scales");
  auto out = at::empty_like(q);
  const uint8_t* k_ptr = reinterpret_cast<const uint8_t*>(k_pool.data_ptr());
  const uint8_t* v_ptr = reinterpret_cast<const uint8_t*>(v_pool.data_ptr());
  const float* ks = k_scale.data_ptr<float>();
  const float* vs = v_scale.data_ptr<float>();
  const int64_t row = kv_heads * dim;
  // Each work item dequantizes one slot's row (all KV heads) into its own buffer before using it: the
  // pool is read once, at half the bytes of bf16, and the float loops stay as they are.
  auto make_loader = [&]() {
    return [=, buffer = std::vector<float>(row)](int64_t slot, int which) mutable -> const float* {
      const uint8_t* src = (which == 0 ? k_ptr : v_ptr) + slot * row;
      const float* scales = which == 0 ? ks : vs;
      float* dst = buffer.data();
      for (int64_t h = 0; h < kv_heads; ++h) {
        const float s = scales[h];
        for (int64_t d = 0; d < dim; ++d) dst[h * dim + d] = hearth::fp8_e4m3_to_float(src[h * dim + d]) * s;
      }
      return dst;
    };
  };
  decode_rows(q.data_ptr<float>(), out.data_ptr<float>(), page_table.data_ptr<int64_t>(),
              context_lens.data_ptr<int64_t>(), first_positions.data_ptr<int64_t>(), q.size(0), q.size(1), kv_heads,
              dim, page_table.size(1), page_size, static_cast<float>(scale), make_loader);
  return out;
}

// bf16 pools (a bf16 model on a CPU with bf16 math, issue 11): each slot's row is widened to float32
// into the work item's buffer as it is read (a bf16 value is the top half of a float32), so the pool
// is read in place at half the bytes of float32 and the float loops stay as they are. Queries and the
// output are float32 (the caller widens the bf16 queries, [n, heads, dim], which costs nothing next to the pool).
at::Tensor paged_decode_attention_bf16(
    at::Tensor q,            // [n, heads, dim] float32
    at::Tensor k_pool,       // [num_slots, kv_heads, dim] bfloat16
    at::Tensor v_pool,       // [num_slots, kv_heads, dim] bfloat16
    at::Tensor page_table,   // [n, max_pages] int64
    at::Tensor context_lens, // [n] int64
    at::Tensor first_positions, // [n] int64
    int64_t page_size,
    double scale) {
  TORCH_CHECK(k_pool.scalar_type() == at::kBFloat16 && v_pool.scalar_type() == at::kBFloat16,
              "paged_decode_attention_bf16: bfloat16 pools only");
  check_common(q, page_table, k_pool, v_pool);
  const int64_t kv_heads = k_pool.size(1), dim = q.size(2);
  auto out = at::empty_like(q);
  const uint16_t* k_ptr = reinterpret_cast<const uint16_t*>(k_pool.data_ptr());
  const uint16_t* v_ptr = reinterpret_cast<const uint16_t*>(v_pool.data_ptr());
  const int64_t row = kv_heads * dim;
  auto make_loader = [&]() {
    return [=, buffer = std::vector<float>(row)](int64_t slot, int which) mutable -> const float* {
      const uint16_t* src = (which == 0 ? k_ptr : v_ptr) + slot * row;
      float* dst = buffer.data();
      for (int64_t i = 0; i < row; ++i) {
        const uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
        std::memcpy(dst + i, &bits, sizeof(float));
      }
      return dst;
    };
  };
  decode_rows(q.data_ptr<float>(), out.data_ptr<float>(), page_table.data_ptr<int64_t>(),
              context_lens.data_ptr<int64_t>(), first_positions.data_ptr<int64_t>(), q.size(0), q.size(1), kv_heads,
              dim, page_table.size(1), page_size, static_cast<float>(scale), make_loader);
  return out;
}
