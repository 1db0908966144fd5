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
#include "paged_decode_attention.h"

namespace {

// Keys and values come through `load(slot, which, kv_begin, kv_count) -> const float*`: those KV heads' values
// of the slot, the float32 pool's in place, or FP8/bf16 ones widened into a scratch buffer (FP8: scales applied).
// Work items [begin, end) of `n * split`: item i is sequence i / split's KV heads [(i % split) * kv_heads / split,
// ...) and the query heads that share them.
template <typename LoadRow>
void decode_items(const float* q_ptr, float* o_ptr, const int64_t* table, const int64_t* lens, const int64_t* firsts,
                  int64_t heads, int64_t kv_heads, int64_t dim, int64_t max_pages, int64_t page_size, float fscale,
                  const LoadRow& make_loader, int64_t split, int64_t begin, int64_t end) {
  const int64_t group = heads / kv_heads;
  const int64_t per_item = kv_heads / split;
  {
    auto load = make_loader();
    std::vector<float> scores;
    std::vector<float> acc(per_item * group * dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / split, kv_begin = (item % split) * per_item;
      const int64_t item_heads = per_item * group;
      const int64_t first = firsts[b];
      const int64_t num_keys = lens[b] - first;
      scores.resize(item_heads * num_keys);
      const float* qb = q_ptr + (b * heads + kv_begin * group) * dim;  // the query heads of these KV heads
      const int64_t* pages = table + b * max_pages;
      // Slots walked page by page: a division per key (two, with the values) cost more than its dot products.
      int64_t page = first / page_size, offset = first % page_size;
      for (int64_t i = 0; i < num_keys; ++i) {
        const float* key = load(pages[page] * page_size + offset, 0, kv_begin, per_item);
        if (++offset == page_size) offset = 0, ++page;
        for (int64_t h = 0; h < item_heads; ++h) {
          const float* qh = qb + h * dim;
          const float* kh = key + (h / group) * dim;
          float dot = 0.0f;
          for (int64_t d = 0; d < dim; ++d) dot += qh[d] * kh[d];
          scores[h * num_keys + i] = dot * fscale;
        }
      }
      for (int64_t h = 0; h < item_heads; ++h) {
        float* s = scores.data() + h * num_keys;
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
      page = first / page_size, offset = first % page_size;
      for (int64_t i = 0; i < num_keys; ++i) {
        const float* value = load(pages[page] * page_size + offset, 1, kv_begin, per_item);
        if (++offset == page_size) offset = 0, ++page;
        for (int64_t h = 0; h < item_heads; ++h) {
          const float w = scores[h * num_keys + i];
          const float* vh = value + (h / group) * dim;
          float* a = acc.data() + h * dim;
          for (int64_t d = 0; d < dim; ++d) a[d] += w * vh[d];
        }
      }
      std::copy(acc.begin(), acc.end(), o_ptr + (b * heads + kv_begin * group) * dim);
    }
  }
}

// A work item is a sequence's KV heads: all of them when there are enough sequences for every thread (a key
// slot's heads are contiguous, so reading them together walks memory in order), one each when there are fewer
// (at batch 1 a whole sequence would keep one core busy and the others idle).
int64_t kv_split(int64_t n, int64_t kv_heads, int threads) { return n < threads ? kv_heads : 1; }

template <typename LoadRow>
void decode_rows(const float* q_ptr, float* o_ptr, const int64_t* table, const int64_t* lens, const int64_t* firsts,
                 int64_t n, int64_t heads, int64_t kv_heads, int64_t dim, int64_t max_pages, int64_t page_size,
                 float fscale, const LoadRow& make_loader) {
  const int64_t split = kv_split(n, kv_heads, at::get_num_threads());
  at::parallel_for(0, n * split, 1, [&](int64_t begin, int64_t end) {
    decode_items(q_ptr, o_ptr, table, lens, firsts, heads, kv_heads, dim, max_pages, page_size, fscale, make_loader,
                 split, begin, end);
  });
}

void check_common(const at::Tensor& q, const at::Tensor& page_table, const at::Tensor& k_pool,
                  const at::Tensor& v_pool) {
  TORCH_CHECK(q.scalar_type() == at::kFloat, "paged_decode_attention: float32 queries only");
  TORCH_CHECK(q.is_contiguous() && k_pool.is_contiguous() && v_pool.is_contiguous() && page_table.is_contiguous(),
              "paged_decode_attention: contiguous inputs only");
}

// Calls `fn(make_loader)` with the loader of these pools: float32 read in place, or FP8 (scales given).
template <typename Fn>
void with_loader(const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor* k_scale,
                 const at::Tensor* v_scale, int64_t dim, Fn&& fn) {
  const int64_t kv_heads = k_pool.size(1);
  const int64_t row = kv_heads * dim;
  if (k_scale == nullptr) {
    const float* k_ptr = k_pool.data_ptr<float>();
    const float* v_ptr = v_pool.data_ptr<float>();
    auto make_loader = [=]() {
      return [=](int64_t slot, int which, int64_t kv_begin, int64_t) {
        return (which == 0 ? k_ptr : v_ptr) + slot * row + kv_begin * dim;
      };
    };
    fn(make_loader);
    return;
  }
  const uint8_t* k_ptr = reinterpret_cast<const uint8_t*>(k_pool.data_ptr());
  const uint8_t* v_ptr = reinterpret_cast<const uint8_t*>(v_pool.data_ptr());
  const float* ks = k_scale->data_ptr<float>();
  const float* vs = v_scale->data_ptr<float>();
  // Each work item dequantizes its KV heads of a slot into its own buffer before using them: the pool is read
  // once, at half the bytes of bf16, and the float loops stay as they are.
  auto make_loader = [=]() {
    return [=, buffer = std::vector<float>(row)](int64_t slot, int which, int64_t kv_begin,
                                                 int64_t kv_count) mutable -> const float* {
      const uint8_t* src = (which == 0 ? k_ptr : v_ptr) + slot * row;
      const float* scales = which == 0 ? ks : vs;
      float* dst = buffer.data();
      for (int64_t h = kv_begin; h < kv_begin + kv_count; ++h) {
        const float s = scales[h];
        for (int64_t d = 0; d < dim; ++d) dst[(h - kv_begin) * dim + d] = hearth::fp8_e4m3_to_float(src[h * dim + d]) * s;
      }
      return dst;
    };
  };
  fn(make_loader);
}

void check_fp8(const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& k_scale,
               const at::Tensor& v_scale) {
  TORCH_CHECK(k_pool.scalar_type() == at::kFloat8_e4m3fn && v_pool.scalar_type() == at::kFloat8_e4m3fn,
              "paged_decode_attention_fp8: float8_e4m3fn pools only");
  const int64_t kv_heads = k_pool.size(1);
  TORCH_CHECK(k_scale.scalar_type() == at::kFloat && v_scale.scalar_type() == at::kFloat &&
                  k_scale.numel() == kv_heads && v_scale.numel() == kv_heads && k_scale.is_contiguous() &&
                  v_scale.is_contiguous(),
              "paged_decode_attention_fp8: float32 [kv_heads] scales");
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
  auto out = at::empty_like(q);
  with_loader(k_pool, v_pool, nullptr, nullptr, q.size(2), [&](const auto& make_loader) {
    decode_rows(q.data_ptr<float>(), out.data_ptr<float>(), page_table.data_ptr<int64_t>(),
                context_lens.data_ptr<int64_t>(), first_positions.data_ptr<int64_t>(), q.size(0), q.size(1),
                k_pool.size(1), q.size(2), page_table.size(1), page_size, static_cast<float>(scale), make_loader);
  });
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
  check_fp8(k_pool, v_pool, k_scale, v_scale);
  check_common(q, page_table, k_pool, v_pool);
  auto out = at::empty_like(q);
  with_loader(k_pool, v_pool, &k_scale, &v_scale, q.size(2), [&](const auto& make_loader) {
    decode_rows(q.data_ptr<float>(), out.data_ptr<float>(), page_table.data_ptr<int64_t>(),
                context_lens.data_ptr<int64_t>(), first_positions.data_ptr<int64_t>(), q.size(0), q.size(1),
                k_pool.size(1), q.size(2), page_table.size(1), page_size, static_cast<float>(scale), make_loader);
  });
  return out;
}

int64_t hearth::decode_attention_split(int64_t num_seqs, int64_t kv_heads, int threads) {
  return kv_split(num_seqs, kv_heads, threads);
}

void hearth::decode_attention_items(const at::Tensor& q, at::Tensor& out, const at::Tensor& k_pool,
                                    const at::Tensor& v_pool, const at::Tensor* k_scale, const at::Tensor* v_scale,
                                    const at::Tensor& page_table, const at::Tensor& context_lens,
                                    const at::Tensor& first_positions, int64_t page_size, double scale,
                                    int64_t split, int64_t begin, int64_t end) {
  if (end <= begin) return;
  with_loader(k_pool, v_pool, k_scale, v_scale, q.size(2), [&](const auto& make_loader) {
    decode_items(q.data_ptr<float>(), out.data_ptr<float>(), page_table.data_ptr<int64_t>(),
                 context_lens.data_ptr<int64_t>(), first_positions.data_ptr<int64_t>(), q.size(1), k_pool.size(1),
                 q.size(2), page_table.size(1), page_size, static_cast<float>(scale), make_loader, split, begin, end);
  });
}

// bf16 pools (a bf16 model on a CPU with bf16 math, issue 11): each slot's row is widened to float32
// (the work item's KV heads) into its buffer as it is read (a bf16 value is the top half of a float32), so the pool
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
    return [=, buffer = std::vector<float>(row)](int64_t slot, int which, int64_t kv_begin,
                                                 int64_t kv_count) mutable -> const float* {
      const uint16_t* src = (which == 0 ? k_ptr : v_ptr) + slot * row + kv_begin * dim;
      float* dst = buffer.data();
      for (int64_t i = 0; i < kv_count * dim; ++i) {
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
