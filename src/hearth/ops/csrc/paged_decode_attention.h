// Decode attention over work items, for a caller that splits one step's attention among its own threads
// (decode_stack.cpp). Item i of `num_seqs * split` is sequence i / split's share of the KV heads.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace hearth {

// How many items a sequence is cut into for `threads` threads (paged_decode_attention.cpp says why).
int64_t decode_attention_split(int64_t num_seqs, int64_t kv_heads, int threads);

// Items [begin, end) into `out` [n, heads, dim] (allocated by the caller). Float32 pools, or FP8 ones with
// both scales given; the inputs as `paged_decode_attention` takes them, already checked by the caller.
void decode_attention_items(const at::Tensor& q, at::Tensor& out, const at::Tensor& k_pool, const at::Tensor& v_pool,
                            const at::Tensor* k_scale, const at::Tensor* v_scale, const at::Tensor& page_table,
                            const at::Tensor& context_lens, const at::Tensor& first_positions, int64_t page_size,
                            double scale, int64_t split, int64_t begin, int64_t end);

}  // namespace hearth
