// Causal prefill attention over a paged KV pool on CPU, flash-style: one chunk of query tokens against its whole
// context (the cached prefix and the chunk itself), an online softmax over blocks of keys, so no [queries, keys]
// score matrix and no contiguous copy of the context in the queries' dtype is ever made.
//
// Why not torch's SDPA over gathered pages: its CPU flash kernel runs ~120-150 GFLOP/s on 2 Zen 5 cores at
// head_dim 64 in bf16 and float32 alike (its small-K GEMMs and scalar-ish softmax), where the tiles below reach
// several times that; attention was over half of a 1,500-token bf16 prefill of SmolLM2 there.
//
// Two steps per layer call:
// 1. Pack: the context's keys and values are read once from their pages (float32, bfloat16 or FP8 e4m3 with a
//    scale per KV head) into the tile layouts the math wants, in the compute dtype (the queries'):
//    - bf16 (AVX512-BF16 `vdpbf16ps`, which multiplies pairs): keys as [kv_head][16-key block][dim/2][16][2], so
//      one 64-byte load holds one dim pair of 16 keys; values as [kv_head][key pair][dim][2];
//    - float32 (AVX-512 FMA): keys as [kv_head][16-key block][dim][16]; values as [kv_head][key][dim].
//    Packing is O(context x dim), against O(queries x context x dim) for the math.
// 2. Attend: work items are (query head, block of kBlockQ query rows), spread over the threads; each walks the key
//    blocks its rows can see (causal, and a sliding window when given): S = Q K^T in a register tile, masked where
//    the block crosses the diagonal or the window's edge, the running max / sum / output rescaled, P (bf16 in the
//    bf16 path, rounded as torch's flash kernel rounds it) times V added into a float32 output tile.
// Numerics: float32 accumulation everywhere; the bf16 path rounds P to bf16 before P V (as SDPA's bf16 kernel
// does), the float32 path rounds nothing.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "bf16_bits.h"
#include "fp8_e4m3.h"
#include "vector_exp.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlockQ = 32;  // query rows of a work item
constexpr int64_t kBlockK = 64;  // keys per online-softmax step: a multiple of the 64-key register tile (128: 0.85x at 400 tokens, 1.04x at 4,500)
constexpr int64_t kRows = 4;     // query rows of a register tile
constexpr int64_t kMaxDim = 1024;  // MLA's latent + rotary keys are 576 wide

using hearth::bf16_to_float;
using hearth::float_to_bf16;

// One pool element as float: the pool's dtype, times the KV head's scale for FP8.
struct PoolReader {
  const void* data;
  at::ScalarType dtype;
  const float* scales;  // [kv_heads] for FP8, else null
  int64_t kv_heads, dim;
  float at(int64_t slot, int64_t kv_head, int64_t d) const {
    const int64_t i = (slot * kv_heads + kv_head) * dim + d;
    switch (dtype) {
      case at::kFloat:
        return static_cast<const float*>(data)[i];
      case at::kBFloat16:
        return bf16_to_float(static_cast<const uint16_t*>(data)[i]);
      default:
        return hearth::fp8_e4m3_to_float(static_cast<const uint8_t*>(data)[i]) * scales[kv_head];
    }
  }
};

#if defined(__AVX512F__)

// The per-row state of a work item's online softmax, and the scores / probabilities of one key block.
// `o` is [kBlockQ][dim], float32.
template <typename P>
struct Tile {
  alignas(64) float s[kBlockQ][kBlockK];
  alignas(64) P p[kBlockQ][kBlockK];
  float max[kBlockQ];
  float sum[kBlockQ];
  std::vector<float> o;
  float* o_row(int64_t r, int64_t dim) { return o.data() + r * dim; }
};

// Softmax step for row r over the key block's raw dot products in t.s[r]: keys outside [first_key, pos] (key j of
// the block is key_base + j) are masked first when `needs_mask`; the scores are the products times `scale` (folded
// into the exponential's argument, one FMA, rather than a pass of its own). Rescales the row's output and sum and
// leaves the block's probabilities in t.p[r] (`store` converts). All keys masked: nothing to add.
template <typename P, typename Store>
inline void softmax_row(Tile<P>& t, int64_t r, int64_t dim, float scale, int64_t key_base, int64_t pos,
                        int64_t first_key, bool needs_mask, const Store& store) {
  float* s = t.s[r];
  const float neg_inf = -std::numeric_limits<float>::infinity();
  if (needs_mask) {
    const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i last = _mm512_set1_epi32(static_cast<int32_t>(pos));
    const __m512i first = _mm512_set1_epi32(static_cast<int32_t>(first_key));
    for (int64_t j = 0; j < kBlockK; j += 16) {
      const __m512i keys = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(key_base + j)), lanes);
      const __mmask16 outside = _mm512_cmpgt_epi32_mask(keys, last) | _mm512_cmplt_epi32_mask(keys, first);
      _mm512_mask_storeu_ps(s + j, outside, _mm512_set1_ps(neg_inf));
    }
  }
  __m512 mx = _mm512_loadu_ps(s);
  for (int64_t j = 16; j < kBlockK; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + j));
  const float block_max = _mm512_reduce_max_ps(mx);
  const float new_max = std::max(t.max[r], block_max == neg_inf ? neg_inf : block_max * scale);
  if (new_max == neg_inf) {
    for (int64_t j = 0; j < kBlockK; j += 16) store(&t.p[r][j], _mm512_setzero_ps());
    return;
  }
  const float alpha = std::exp(t.max[r] - new_max);  // 0 for the first block (max was -inf)
  const __m512 shift = _mm512_set1_ps(new_max), vscale = _mm512_set1_ps(scale);
  __m512 total = _mm512_setzero_ps();
  for (int64_t j = 0; j < kBlockK; j += 16) {
    const __m512 e = exp_nonpositive(_mm512_fmsub_ps(_mm512_loadu_ps(s + j), vscale, shift));
    total = _mm512_add_ps(total, e);
    store(&t.p[r][j], e);
  }
  t.sum[r] = t.sum[r] * alpha + _mm512_reduce_add_ps(total);
  t.max[r] = new_max;
  if (alpha != 1.0f) {
    const __m512 a = _mm512_set1_ps(alpha);
    float* o = t.o_row(r, dim);
    for (int64_t d = 0; d < dim; d += 16) _mm512_storeu_ps(o + d, _mm512_mul_ps(a, _mm512_loadu_ps(o + d)));
  }
}

#if defined(__AVX512BF16__)
// ---- bf16 tiles: vdpbf16ps multiplies bf16 pairs and accumulates in float32. ----

inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }
inline __m512bh pair_of(const uint16_t* p) {  // p[0], p[1] broadcast to every lane pair
  int32_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return as_bh(_mm512_set1_epi32(bits));
}

// S[kRows][kBlockK] = Q[rows] . K[block]^T; q rows hold `dim` bf16 each; kp: the block's 4 x [dim/2][16][2].
inline void qk_tile_bf16(const uint16_t* q, int64_t q_stride, const uint16_t* kp, int64_t dim, float* s,
                         int64_t s_stride) {
  __m512 acc[kRows][4];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  const int64_t pairs = dim / 2, sub_block = pairs * 32;  // bf16 values per 16-key sub-block
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh kv[4];
    for (int c = 0; c < 4; ++c) kv[c] = as_bh(_mm512_loadu_si512(kp + c * sub_block + p * 32));
    for (int r = 0; r < kRows; ++r) {
      const __m512bh qv = pair_of(q + r * q_stride + 2 * p);
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], qv, kv[c]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(s + r * s_stride + c * 16, acc[r][c]);
}

// O[rows][d0, d0 + 16 N) += P[rows] . V[block]; vp: the block's [kBlockK / 2][dim][2].
template <int N>
inline void pv_tile_bf16(const uint16_t* p, int64_t p_stride, const uint16_t* vp, int64_t dim, int64_t d0, float* o,
                         int64_t o_stride) {
  __m512 acc[kRows][N];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < N; ++c) acc[r][c] = _mm512_loadu_ps(o + r * o_stride + d0 + c * 16);
  for (int64_t kp = 0; kp < kBlockK / 2; ++kp) {
    __m512bh vv[N];
    for (int c = 0; c < N; ++c) vv[c] = as_bh(_mm512_loadu_si512(vp + (kp * dim + d0 + c * 16) * 2));
    for (int r = 0; r < kRows; ++r) {
      const __m512bh pv = pair_of(p + r * p_stride + 2 * kp);
      for (int c = 0; c < N; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pv, vv[c]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < N; ++c) _mm512_storeu_ps(o + r * o_stride + d0 + c * 16, acc[r][c]);
}

struct Bf16Math {
  using Elem = uint16_t;  // packed K/V and Q rows
  using Prob = uint16_t;
  static void pack(const PoolReader& k, const PoolReader& v, const int64_t* slots, int64_t keys, int64_t padded,
                   int64_t kv_head, uint16_t* kp, uint16_t* vp, int64_t key0, int64_t key1) {
    const int64_t dim = k.dim;
    for (int64_t key = key0; key < key1; ++key) {
      const bool real = key < keys;
      const int64_t slot = real ? slots[key] : 0;
      uint16_t* kdst = kp + (kv_head * (padded / 16) + key / 16) * 16 * dim + (key % 16) * 2;
      uint16_t* vdst = vp + (kv_head * (padded / 2) + key / 2) * dim * 2 + (key % 2);
      for (int64_t d = 0; d < dim; ++d) {
        kdst[(d / 2) * 32 + (d % 2)] = real ? float_to_bf16(k.at(slot, kv_head, d)) : 0;
        vdst[d * 2] = real ? float_to_bf16(v.at(slot, kv_head, d)) : 0;
      }
    }
  }
  static void qk(const uint16_t* q, int64_t q_stride, const uint16_t* kp_block, int64_t dim, float* s) {
    for (int64_t k0 = 0; k0 < kBlockK; k0 += 64) qk_tile_bf16(q, q_stride, kp_block + k0 * dim, dim, s + k0, kBlockK);
  }
  static void store_p(uint16_t* dst, __m512 e) { hearth::store_bf16x16(dst, e); }
  static void pv(const uint16_t* p, const uint16_t* vp_block, int64_t dim, float* o) {
    int64_t d0 = 0;
    for (; d0 + 64 <= dim; d0 += 64) pv_tile_bf16<4>(p, kBlockK, vp_block, dim, d0, o, dim);
    switch ((dim - d0) / 16) {
      case 3: pv_tile_bf16<3>(p, kBlockK, vp_block, dim, d0, o, dim); break;
      case 2: pv_tile_bf16<2>(p, kBlockK, vp_block, dim, d0, o, dim); break;
      case 1: pv_tile_bf16<1>(p, kBlockK, vp_block, dim, d0, o, dim); break;
      default: break;
    }
  }
  static const uint16_t* v_block(const uint16_t* vp, int64_t kv_head, int64_t padded, int64_t key, int64_t dim) {
    return vp + (kv_head * (padded / 2) + key / 2) * dim * 2;
  }
};
#define HEARTH_PREFILL_BF16 1
#endif  // __AVX512BF16__

// ---- float32 tiles: AVX-512 FMA. ----

inline void qk_tile_f32(const float* q, int64_t q_stride, const float* kp, int64_t dim, float* s, int64_t s_stride) {
  __m512 acc[kRows][4];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  const int64_t sub_block = dim * 16;
  for (int64_t d = 0; d < dim; ++d) {
    __m512 kv[4];
    for (int c = 0; c < 4; ++c) kv[c] = _mm512_loadu_ps(kp + c * sub_block + d * 16);
    for (int r = 0; r < kRows; ++r) {
      const __m512 qv = _mm512_set1_ps(q[r * q_stride + d]);
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_fmadd_ps(qv, kv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(s + r * s_stride + c * 16, acc[r][c]);
}

template <int N>
inline void pv_tile_f32(const float* p, int64_t p_stride, const float* vp, int64_t dim, int64_t d0, float* o,
                        int64_t o_stride) {
  __m512 acc[kRows][N];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < N; ++c) acc[r][c] = _mm512_loadu_ps(o + r * o_stride + d0 + c * 16);
  for (int64_t k = 0; k < kBlockK; ++k) {
    __m512 vv[N];
    for (int c = 0; c < N; ++c) vv[c] = _mm512_loadu_ps(vp + k * dim + d0 + c * 16);
    for (int r = 0; r < kRows; ++r) {
      const __m512 pv = _mm512_set1_ps(p[r * p_stride + k]);
      for (int c = 0; c < N; ++c) acc[r][c] = _mm512_fmadd_ps(pv, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < N; ++c) _mm512_storeu_ps(o + r * o_stride + d0 + c * 16, acc[r][c]);
}

struct F32Math {
  using Elem = float;
  using Prob = float;
  static void pack(const PoolReader& k, const PoolReader& v, const int64_t* slots, int64_t keys, int64_t padded,
                   int64_t kv_head, float* kp, float* vp, int64_t key0, int64_t key1) {
    const int64_t dim = k.dim;
    for (int64_t key = key0; key < key1; ++key) {
      const bool real = key < keys;
      const int64_t slot = real ? slots[key] : 0;
      float* kdst = kp + (kv_head * (padded / 16) + key / 16) * 16 * dim + (key % 16);
      float* vdst = vp + (kv_head * padded + key) * dim;
      for (int64_t d = 0; d < dim; ++d) {
        kdst[d * 16] = real ? k.at(slot, kv_head, d) : 0.0f;
        vdst[d] = real ? v.at(slot, kv_head, d) : 0.0f;
      }
    }
  }
  static void qk(const float* q, int64_t q_stride, const float* kp_block, int64_t dim, float* s) {
    for (int64_t k0 = 0; k0 < kBlockK; k0 += 64) qk_tile_f32(q, q_stride, kp_block + k0 * dim, dim, s + k0, kBlockK);
  }
  static void store_p(float* dst, __m512 e) { _mm512_storeu_ps(dst, e); }
  static void pv(const float* p, const float* vp_block, int64_t dim, float* o) {
    int64_t d0 = 0;
    for (; d0 + 64 <= dim; d0 += 64) pv_tile_f32<4>(p, kBlockK, vp_block, dim, d0, o, dim);
    switch ((dim - d0) / 16) {
      case 3: pv_tile_f32<3>(p, kBlockK, vp_block, dim, d0, o, dim); break;
      case 2: pv_tile_f32<2>(p, kBlockK, vp_block, dim, d0, o, dim); break;
      case 1: pv_tile_f32<1>(p, kBlockK, vp_block, dim, d0, o, dim); break;
      default: break;
    }
  }
  static const float* v_block(const float* vp, int64_t kv_head, int64_t padded, int64_t key, int64_t dim) {
    return vp + (kv_head * padded + key) * dim;
  }
};

// Query elements of the compute dtype: bf16 bits or float32, read from q's own rows.
template <typename Elem>
inline void load_q_rows(const at::Tensor& q, int64_t row0, int64_t rows, int64_t head, int64_t dim, Elem* dst) {
  const int64_t s0 = q.stride(0), s1 = q.stride(1);
  const Elem* src = static_cast<const Elem*>(q.data_ptr());
  for (int64_t r = 0; r < kBlockQ; ++r) {
    if (r < rows) {
      std::memcpy(dst + r * dim, src + (row0 + r) * s0 + head * s1, dim * sizeof(Elem));
    } else {
      std::memset(dst + r * dim, 0, dim * sizeof(Elem));
    }
  }
}

template <typename Math>
void attend(const at::Tensor& q, at::Tensor& out, const PoolReader& k_reader, const PoolReader& v_reader,
            const int64_t* slots, int64_t context_len, int64_t window, double scale) {
  using Elem = typename Math::Elem;
  using Prob = typename Math::Prob;
  const int64_t queries = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_reader.kv_heads, group = heads / kv_heads;
  const int64_t padded = (context_len + kBlockK - 1) / kBlockK * kBlockK;
  const int64_t start = context_len - queries;  // position of the chunk's first query
  std::vector<Elem> kp(kv_heads * padded * dim), vp(kv_heads * padded * dim);
  const int64_t pack_blocks = padded / 16;
  at::parallel_for(0, kv_heads * pack_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t kv_head = i / pack_blocks, key0 = (i % pack_blocks) * 16;
      Math::pack(k_reader, v_reader, slots, context_len, padded, kv_head, kp.data(), vp.data(), key0, key0 + 16);
    }
  });
  const int64_t q_blocks = (queries + kBlockQ - 1) / kBlockQ;
  const float fscale = static_cast<float>(scale);
  const bool out_bf16 = out.scalar_type() == at::kBFloat16;
  at::parallel_for(0, heads * q_blocks, 1, [&](int64_t begin, int64_t end) {
    auto tile = std::make_unique<Tile<Prob>>();
    tile->o.resize(kBlockQ * dim);
    std::vector<Elem> qrows(kBlockQ * dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t head = item / q_blocks, row0 = (item % q_blocks) * kBlockQ;
      const int64_t rows = std::min(kBlockQ, queries - row0), kv_head = head / group;
      load_q_rows(q, row0, rows, head, dim, qrows.data());
      for (int64_t r = 0; r < kBlockQ; ++r) {
        tile->max[r] = -std::numeric_limits<float>::infinity();
        tile->sum[r] = 0.0f;
        std::memset(tile->o_row(r, dim), 0, dim * sizeof(float));
        if (r >= rows) std::memset(tile->p[r], 0, sizeof(tile->p[r]));
      }
      const int64_t first_pos = start + row0, last_pos = start + row0 + rows - 1;
      // The first key any row of the item sees, and the first the earliest row sees (below it: no window mask).
      const int64_t lowest_key = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
      const int64_t unmasked_from = window > 0 ? std::max<int64_t>(0, last_pos - window + 1) : 0;
      for (int64_t key0 = lowest_key / kBlockK * kBlockK; key0 <= last_pos; key0 += kBlockK) {
        const Elem* kp_block = kp.data() + (kv_head * (padded / 16) + key0 / 16) * 16 * dim;
        for (int64_t r = 0; r < rows; r += kRows) Math::qk(qrows.data() + r * dim, dim, kp_block, dim, tile->s[r]);
        const bool needs_mask = key0 + kBlockK - 1 > first_pos || key0 < unmasked_from;
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t pos = first_pos + r;
          softmax_row(*tile, r, dim, fscale, key0, pos, window > 0 ? pos - window + 1 : 0, needs_mask,
                      [](Prob* dst, __m512 e) { Math::store_p(dst, e); });
        }
        const Elem* vp_block = Math::v_block(vp.data(), kv_head, padded, key0, dim);
        for (int64_t r = 0; r < rows; r += kRows) Math::pv(&tile->p[r][0], vp_block, dim, tile->o_row(r, dim));
      }
      for (int64_t r = 0; r < rows; ++r) {
        const float inv = 1.0f / tile->sum[r];
        const int64_t o_off = ((row0 + r) * heads + head) * dim;
        if (out_bf16) {
          uint16_t* dst = static_cast<uint16_t*>(out.data_ptr()) + o_off;
          for (int64_t d = 0; d < dim; ++d) dst[d] = float_to_bf16(tile->o_row(r, dim)[d] * inv);
        } else {
          float* dst = out.data_ptr<float>() + o_off;
          for (int64_t d = 0; d < dim; ++d) dst[d] = tile->o_row(r, dim)[d] * inv;
        }
      }
    }
  });
}

#endif  // __AVX512F__

}  // namespace

// Which math this build has for `dtype` queries: "avx512_bf16", "avx512", or "" (callers use the torch path).
std::string prefill_attention_isa(at::ScalarType dtype) {
#if defined(__AVX512F__)
  if (dtype == at::kFloat) return "avx512";
#if defined(HEARTH_PREFILL_BF16)
  if (dtype == at::kBFloat16) return "avx512_bf16";
#endif
#endif
  (void)dtype;
  return "";
}

at::Tensor prefill_attention(at::Tensor q,         // [queries, heads, dim], bf16 or float32, stride(2) == 1
                             at::Tensor k_pool,    // [num_slots, kv_heads, dim] float32, bf16 or FP8 e4m3
                             at::Tensor v_pool,    // same
                             std::optional<at::Tensor> k_scale,  // [kv_heads] float32 for FP8 pools
                             std::optional<at::Tensor> v_scale,
                             at::Tensor page_ids,  // [pages] int64: the context's pages in position order
                             int64_t context_len, int64_t page_size, int64_t window, double scale) {
  TORCH_CHECK(!prefill_attention_isa(q.scalar_type()).empty(), "prefill_attention: no tile math for ",
              q.scalar_type(), " queries in this build");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "prefill_attention: q is [queries, heads, dim] with dim contiguous");
  TORCH_CHECK(k_pool.dim() == 3 && k_pool.is_contiguous() && v_pool.is_contiguous() &&
                  k_pool.sizes() == v_pool.sizes() && k_pool.scalar_type() == v_pool.scalar_type(),
              "prefill_attention: k and v pools are alike, contiguous [slots, kv_heads, dim]");
  const int64_t queries = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k_pool.size(1);
  TORCH_CHECK(k_pool.size(2) == dim && dim % 16 == 0 && dim <= kMaxDim,
              "prefill_attention: head dim a multiple of 16, at most ", kMaxDim);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "prefill_attention: query heads a multiple of kv heads");
  TORCH_CHECK(queries >= 1 && context_len >= queries, "prefill_attention: 1 <= queries <= context_len");
  TORCH_CHECK(page_ids.scalar_type() == at::kLong && page_ids.is_contiguous() &&
                  page_ids.numel() * page_size >= context_len,
              "prefill_attention: int64 page ids covering the context");
  const at::ScalarType pool_dtype = k_pool.scalar_type();
  const bool fp8 = pool_dtype == at::kFloat8_e4m3fn || pool_dtype == at::kByte;
  TORCH_CHECK(pool_dtype == at::kFloat || pool_dtype == at::kBFloat16 || fp8,
              "prefill_attention: float32, bfloat16 or FP8 e4m3 pools");
  TORCH_CHECK(!fp8 || (k_scale && v_scale && k_scale->numel() == kv_heads && v_scale->numel() == kv_heads &&
                       k_scale->scalar_type() == at::kFloat && v_scale->scalar_type() == at::kFloat),
              "prefill_attention: FP8 pools need float32 scales per KV head");
  at::Tensor ks = fp8 ? k_scale->contiguous() : at::Tensor(), vs = fp8 ? v_scale->contiguous() : at::Tensor();
  const int64_t num_slots = k_pool.size(0);
  const int64_t* pages = page_ids.data_ptr<int64_t>();
  std::vector<int64_t> slots(context_len);
  for (int64_t key = 0; key < context_len; ++key) {
    slots[key] = pages[key / page_size] * page_size + key % page_size;
    TORCH_CHECK(slots[key] >= 0 && slots[key] < num_slots, "prefill_attention: page id outside the pool");
  }
  const PoolReader k_reader{k_pool.data_ptr(), fp8 ? at::kByte : pool_dtype, fp8 ? ks.data_ptr<float>() : nullptr,
                            kv_heads, dim};
  const PoolReader v_reader{v_pool.data_ptr(), fp8 ? at::kByte : pool_dtype, fp8 ? vs.data_ptr<float>() : nullptr,
                            kv_heads, dim};
  at::Tensor out = at::empty({queries, heads, dim}, q.options());
#if defined(__AVX512F__)
#if defined(HEARTH_PREFILL_BF16)
  if (q.scalar_type() == at::kBFloat16) {
    attend<Bf16Math>(q, out, k_reader, v_reader, slots.data(), context_len, window, scale);
    return out;
  }
#endif
  attend<F32Math>(q, out, k_reader, v_reader, slots.data(), context_len, window, scale);
#endif
  return out;
}
