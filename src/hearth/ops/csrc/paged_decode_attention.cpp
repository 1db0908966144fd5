// Decode attention over a paged KV pool on CPU: one query token per sequence, keys and values
// read in place from their pages (no gather into contiguous tensors). Float32 only.
// ATen headers only: torch/extension.h (pybind, autograd) triples the compile time; bindings.cpp has it.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

at::Tensor paged_decode_attention(
    at::Tensor q,            // [n, heads, dim]
    at::Tensor k_pool,       // [num_slots, kv_heads, dim]
    at::Tensor v_pool,       // [num_slots, kv_heads, dim]
    at::Tensor page_table,   // [n, max_pages] int64
    at::Tensor context_lens, // [n] int64
    at::Tensor first_positions, // [n] int64: first key position each row attends to (sliding window)
    int64_t page_size,
    double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_pool.scalar_type() == at::kFloat &&
              v_pool.scalar_type() == at::kFloat, "paged_decode_attention: float32 only");
  TORCH_CHECK(q.is_contiguous() && k_pool.is_contiguous() && v_pool.is_contiguous() &&
              page_table.is_contiguous(), "paged_decode_attention: contiguous inputs only");
  const int64_t n = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_pool.size(1);
  const int64_t group = heads / kv_heads;
  const int64_t max_pages = page_table.size(1);
  auto out = at::empty_like(q);
  const float* q_ptr = q.data_ptr<float>();
  const float* k_ptr = k_pool.data_ptr<float>();
  const float* v_ptr = v_pool.data_ptr<float>();
  const int64_t* table = page_table.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t* firsts = first_positions.data_ptr<int64_t>();
  float* o_ptr = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);

  // One sequence per work item: each key slot's heads are contiguous, so reading all of them
  // together walks memory in order instead of striding through it once per head.
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
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
        const float* key = k_ptr + (pages[pos / page_size] * page_size + pos % page_size) * kv_heads * dim;
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
        const float* value = v_ptr + (pages[pos / page_size] * page_size + pos % page_size) * kv_heads * dim;
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
  return out;
}
