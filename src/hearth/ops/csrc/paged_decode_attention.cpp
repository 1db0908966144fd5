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
#include "vector_exp.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include "paged_decode_attention.h"

namespace {

// s[i] = e^(s[i] - max) for i < count; returns their sum.
float exp_shifted(float* s, int64_t count, float max_score) {
  float total = 0.0f;
  int64_t i = 0;
#ifdef __AVX512F__
  const __m512 shift = _mm512_set1_ps(max_score);
  __m512 sum = _mm512_setzero_ps();
  for (; i + 16 <= count; i += 16) {
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + i), shift));
    _mm512_storeu_ps(s + i, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (i < count) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (count - i)) - 1);
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + i), shift));
    _mm512_mask_storeu_ps(s + i, tail, e);
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(tail, e));
    i = count;
  }
  total = _mm512_reduce_add_ps(sum);
#endif
  for (; i < count; ++i) {
    s[i] = std::exp(s[i] - max_score);
    total += s[i];
  }
  return total;
}

#ifdef __AVX512F__
// Head dims the vector loops take: whole 16-float vectors, a head's row held in at most 16 registers.
inline bool vector_head_dim(int64_t dim) { return dim % 16 == 0 && dim <= 256; }

// One KV head's row (a key or a value) as dim / 16 vectors.
inline int64_t load_head_row(const float* row, int64_t dim, __m512* vectors) {
  const int64_t chunks = dim / 16;
  for (int64_t c = 0; c < chunks; ++c) vectors[c] = _mm512_loadu_ps(row + 16 * c);
  return chunks;
}
#endif

// scores[h * stride + i] = (q_h . k_i) x fscale for the `heads` query heads of one KV head.
inline void key_dots(const float* q, const float* key, int64_t heads, int64_t dim, float fscale, float* scores,
                     int64_t stride, int64_t i) {
#ifdef __AVX512F__
  if (vector_head_dim(dim)) {
    __m512 k[16];
    const int64_t chunks = load_head_row(key, dim, k);
    for (int64_t h = 0; h < heads; ++h) {
      const float* qh = q + h * dim;
      __m512 dot = _mm512_mul_ps(_mm512_loadu_ps(qh), k[0]);
      for (int64_t c = 1; c < chunks; ++c) dot = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * c), k[c], dot);
      scores[h * stride + i] = _mm512_reduce_add_ps(dot) * fscale;
    }
    return;
  }
#endif
  for (int64_t h = 0; h < heads; ++h) {
    const float* qh = q + h * dim;
    float dot = 0.0f;
    for (int64_t d = 0; d < dim; ++d) dot += qh[d] * key[d];
    scores[h * stride + i] = dot * fscale;
  }
}

// acc_h += w_h,i x v_i for the `heads` query heads of one KV head.
inline void value_axpys(const float* value, int64_t heads, int64_t dim, const float* weights, int64_t stride,
                        int64_t i, float* acc) {
#ifdef __AVX512F__
  if (vector_head_dim(dim)) {
    __m512 v[16];
    const int64_t chunks = load_head_row(value, dim, v);
    for (int64_t h = 0; h < heads; ++h) {
      const __m512 w = _mm512_set1_ps(weights[h * stride + i]);
      float* a = acc + h * dim;
      for (int64_t c = 0; c < chunks; ++c)
        _mm512_storeu_ps(a + 16 * c, _mm512_fmadd_ps(w, v[c], _mm512_loadu_ps(a + 16 * c)));
    }
    return;
  }
#endif
  for (int64_t h = 0; h < heads; ++h) {
    const float w = weights[h * stride + i];
    float* a = acc + h * dim;
    for (int64_t d = 0; d < dim; ++d) a[d] += w * value[d];
  }
}

// Keys and values come through `load(slot, which, kv_begin, kv_count) -> const float*`: those KV heads' values
// of the slot, the float32 pool's in place, or FP8/bf16 ones widened into a scratch buffer (FP8: scales applied).
// Work items [begin, end) of `n * split.items()`: item i is sequence i / items's KV heads
// [part * kv_heads / kv_parts, ...) and the query heads that share them, over its key chunk [chunk * keys /
// key_chunks, ...) (part, chunk: i % items as part * key_chunks + chunk). One chunk a sequence: the
// normalized result goes to `o_ptr`. More: each chunk's max score, sum of exponentials and unnormalized values
// go to `partials` ([n, heads, key_chunks, dim + 2]) for `merge_chunks`.
template <typename LoadRow>
void decode_items(const float* q_ptr, float* o_ptr, float* partials, const int64_t* table, const int64_t* lens,
                  const int64_t* firsts, int64_t heads, int64_t kv_heads, int64_t dim, int64_t max_pages,
                  int64_t page_size, float fscale, const LoadRow& make_loader, hearth::DecodeAttentionSplit split,
                  int64_t begin, int64_t end) {
  const int64_t group = heads / kv_heads;
  const int64_t per_item = kv_heads / split.kv_parts;
  const int64_t items = split.items();
  auto load = make_loader();
  std::vector<float> scores;
  std::vector<float> acc(per_item * group * dim);
  std::vector<float> max_scores(per_item * group), totals(per_item * group);
  for (int64_t item = begin; item < end; ++item) {
    const int64_t b = item / items, part = (item % items) / split.key_chunks, chunk = item % split.key_chunks;
    const int64_t kv_begin = part * per_item;
    const int64_t item_heads = per_item * group;
    const int64_t num_keys = lens[b] - firsts[b];
    const int64_t key_begin = num_keys * chunk / split.key_chunks;
    const int64_t chunk_keys = num_keys * (chunk + 1) / split.key_chunks - key_begin;
    const int64_t first = firsts[b] + key_begin;
    scores.resize(item_heads * chunk_keys);
    const float* qb = q_ptr + (b * heads + kv_begin * group) * dim;  // the query heads of these KV heads
    const int64_t* pages = table + b * max_pages;
    // Slots walked page by page: a division per key (two, with the values) cost more than its dot products.
    int64_t page = first / page_size, offset = first % page_size;
    for (int64_t i = 0; i < chunk_keys; ++i) {
      const float* key = load(pages[page] * page_size + offset, 0, kv_begin, per_item);
      if (++offset == page_size) offset = 0, ++page;
      for (int64_t kh = 0; kh < per_item; ++kh)
        key_dots(qb + kh * group * dim, key + kh * dim, group, dim, fscale, scores.data() + kh * group * chunk_keys,
                 chunk_keys, i);
    }
    for (int64_t h = 0; h < item_heads; ++h) {
      float* s = scores.data() + h * chunk_keys;
      float max_score = -INFINITY;
      for (int64_t i = 0; i < chunk_keys; ++i) max_score = std::max(max_score, s[i]);
      max_scores[h] = max_score;
      totals[h] = chunk_keys > 0 ? exp_shifted(s, chunk_keys, max_score) : 0.0f;
    }
    std::fill(acc.begin(), acc.end(), 0.0f);
    page = first / page_size, offset = first % page_size;
    for (int64_t i = 0; i < chunk_keys; ++i) {
      const float* value = load(pages[page] * page_size + offset, 1, kv_begin, per_item);
      if (++offset == page_size) offset = 0, ++page;
      for (int64_t kh = 0; kh < per_item; ++kh)
        value_axpys(value + kh * dim, group, dim, scores.data() + kh * group * chunk_keys, chunk_keys, i,
                    acc.data() + kh * group * dim);
    }
    const int64_t head0 = b * heads + kv_begin * group;
    for (int64_t h = 0; h < item_heads; ++h) {
      const float* a = acc.data() + h * dim;
      if (split.key_chunks == 1) {
        const float inv_total = 1.0f / totals[h];
        float* o = o_ptr + (head0 + h) * dim;
        for (int64_t d = 0; d < dim; ++d) o[d] = a[d] * inv_total;
      } else {
        float* p = partials + ((head0 + h) * split.key_chunks + chunk) * (dim + 2);
        p[0] = max_scores[h];
        p[1] = totals[h];
        std::copy(a, a + dim, p + 2);
      }
    }
  }
}

// Rows [begin, end) of the [n * heads] query heads: their key chunks' partial results combined, normalized.
void merge_chunks(const float* partials, float* out, int64_t dim, int64_t key_chunks, int64_t begin, int64_t end) {
  for (int64_t row = begin; row < end; ++row) {
    const float* p = partials + row * key_chunks * (dim + 2);
    float max_score = -INFINITY;
    for (int64_t c = 0; c < key_chunks; ++c) max_score = std::max(max_score, p[c * (dim + 2)]);
    float* o = out + row * dim;
    std::fill(o, o + dim, 0.0f);
    float total = 0.0f;
    for (int64_t c = 0; c < key_chunks; ++c) {
      const float* chunk = p + c * (dim + 2);
      if (chunk[1] == 0.0f) continue;  // a chunk with no keys
      const float weight = std::exp(chunk[0] - max_score);
      total += chunk[1] * weight;
      for (int64_t d = 0; d < dim; ++d) o[d] += chunk[2 + d] * weight;
    }
    const float inv_total = 1.0f / total;
    for (int64_t d = 0; d < dim; ++d) o[d] *= inv_total;
  }
}

// A work item is a sequence's KV heads: all of them when there are enough sequences for every thread (a key
// slot's heads are contiguous, so reading them together walks memory in order), one each when there are fewer
// (at batch 1 a whole sequence would keep one core busy and the others idle). When those items still do not
// share evenly among the threads (3 KV heads on 2 threads: one thread did twice the other's work, ~1/3 of the
// attention's time lost at batch 1) and every sequence has enough keys, each item's keys are cut into one
// chunk a thread, merged after.
constexpr int64_t kMinChunkKeys = 128;

hearth::DecodeAttentionSplit plan_split(int64_t n, int64_t kv_heads, int64_t min_keys, int threads) {
  if (n >= threads) return {1, 1};
  if ((n * kv_heads) % threads == 0 || min_keys < kMinChunkKeys * threads) return {kv_heads, 1};
  return {kv_heads, threads};
}

int64_t min_keys_of(const at::Tensor& context_lens, const at::Tensor& first_positions) {
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t* firsts = first_positions.data_ptr<int64_t>();
  int64_t least = INT64_MAX;
  for (int64_t b = 0; b < context_lens.numel(); ++b) least = std::min(least, lens[b] - firsts[b]);
  return least;
}

template <typename LoadRow>
void decode_rows(const float* q_ptr, float* o_ptr, const int64_t* table, const int64_t* lens, const int64_t* firsts,
                 int64_t n, int64_t heads, int64_t kv_heads, int64_t dim, int64_t max_pages, int64_t page_size,
                 float fscale, const LoadRow& make_loader, int64_t min_keys) {
  const hearth::DecodeAttentionSplit split = plan_split(n, kv_heads, min_keys, at::get_num_threads());
  std::vector<float> partials(split.key_chunks > 1 ? n * heads * split.key_chunks * (dim + 2) : 0);
  at::parallel_for(0, n * split.items(), 1, [&](int64_t begin, int64_t end) {
    decode_items(q_ptr, o_ptr, partials.data(), table, lens, firsts, heads, kv_heads, dim, max_pages, page_size,
                 fscale, make_loader, split, begin, end);
  });
  if (split.key_chunks > 1) merge_chunks(partials.data(), o_ptr, dim, split.key_chunks, 0, n * heads);
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
                k_pool.size(1), q.size(2), page_table.size(1), page_size, static_cast<float>(scale), make_loader,
                min_keys_of(context_lens, first_positions));
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
                k_pool.size(1), q.size(2), page_table.size(1), page_size, static_cast<float>(scale), make_loader,
                min_keys_of(context_lens, first_positions));
  });
  return out;
}

hearth::DecodeAttentionSplit hearth::decode_attention_split(const at::Tensor& context_lens,
                                                            const at::Tensor& first_positions, int64_t kv_heads,
                                                            int threads) {
  return plan_split(context_lens.numel(), kv_heads, min_keys_of(context_lens, first_positions), threads);
}

void hearth::decode_attention_items(const at::Tensor& q, at::Tensor& out, float* partials, const at::Tensor& k_pool,
                                    const at::Tensor& v_pool, const at::Tensor* k_scale, const at::Tensor* v_scale,
                                    const at::Tensor& page_table, const at::Tensor& context_lens,
                                    const at::Tensor& first_positions, int64_t page_size, double scale,
                                    DecodeAttentionSplit split, int64_t begin, int64_t end) {
  if (end <= begin) return;
  with_loader(k_pool, v_pool, k_scale, v_scale, q.size(2), [&](const auto& make_loader) {
    decode_items(q.data_ptr<float>(), out.data_ptr<float>(), partials, page_table.data_ptr<int64_t>(),
                 context_lens.data_ptr<int64_t>(), first_positions.data_ptr<int64_t>(), q.size(1), k_pool.size(1),
                 q.size(2), page_table.size(1), page_size, static_cast<float>(scale), make_loader, split, begin, end);
  });
}

void hearth::decode_attention_merge(const float* partials, at::Tensor& out, DecodeAttentionSplit split, int64_t begin,
                                    int64_t end) {
  merge_chunks(partials, out.data_ptr<float>(), out.size(2), split.key_chunks, begin, end);
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
              dim, page_table.size(1), page_size, static_cast<float>(scale), make_loader,
              min_keys_of(context_lens, first_positions));
  return out;
}
