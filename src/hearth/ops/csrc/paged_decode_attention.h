// Decode attention over work items, for a caller that splits one step's attention among its own threads
// (decode_stack.cpp): `decode_attention_split` says how many items each sequence is cut into, the caller runs
// `decode_attention_items` over its share of them and, when the keys were cut into chunks, has every item done
// before `decode_attention_merge` combines the chunks.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace hearth {

// A sequence's items: its KV heads cut into `kv_parts` and each part's keys into `key_chunks`
// (paged_decode_attention.cpp says when and why).
struct DecodeAttentionSplit {
  int64_t kv_parts;
  int64_t key_chunks;
  int64_t items() const { return kv_parts * key_chunks; }
  // Floats of the chunks' partial results for `num_seqs` sequences ([num_seqs, heads, key_chunks, dim + 2]).
  int64_t partial_floats(int64_t num_seqs, int64_t heads, int64_t dim) const {
    return key_chunks > 1 ? num_seqs * heads * key_chunks * (dim + 2) : 0;
  }
};

// The split of a step's sequences (their lengths and first attended positions) for `threads` threads.
DecodeAttentionSplit decode_attention_split(const at::Tensor& context_lens, const at::Tensor& first_positions,
                                            int64_t kv_heads, int threads);

// Items [begin, end) of `num_seqs * split.items()` into `out` [n, heads, dim] (allocated by the caller), or, with
// key chunks, into `partials` (`split.partial_floats` of them). Float32 pools, or FP8 ones with both scales
// given; the inputs as `paged_decode_attention` takes them, already checked by the caller.
void decode_attention_items(const at::Tensor& q, at::Tensor& out, float* partials, const at::Tensor& k_pool,
                            const at::Tensor& v_pool, const at::Tensor* k_scale, const at::Tensor* v_scale,
                            const at::Tensor& page_table, const at::Tensor& context_lens,
                            const at::Tensor& first_positions, int64_t page_size, double scale,
                            DecodeAttentionSplit split, int64_t begin, int64_t end);

// Query-head rows [begin, end) of `num_seqs * heads`: their chunks combined into `out`, once every item is done.
void decode_attention_merge(const float* partials, at::Tensor& out, DecodeAttentionSplit split, int64_t begin,
                            int64_t end);

}  // namespace hearth
