// The integer dot of the W4A8 and W8A8 kernels on AVX-512 VNNI: one vpdpbusd per 64 weights and activation row.
//
// A block of 64 weights arrives as 64 unsigned bytes in the activations' order; vpdpbusd multiplies them by the
// row's int8 activations and sums them in fours into 16 int32 lanes: lanes 0..7 hold the block's first 32
// weights, 8..15 the next 32. Each half's int32 sum is scaled as its group ends by the group's weight scale
// times the row's activation scale (groups of 32: the halves are two groups; groups that are multiples of 64
// sum in int32 to their end). What the weights' encoding adds (a zero point, a sign flip) is the caller's.
#pragma once

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>

#include <cstdint>

#include "activations_int8.h"

#define HEARTH_VNNI 1

namespace {

inline __m512 vnni_pair_scales(const float* p) {  // lanes 0..7: p[0], 8..15: p[1]
  return _mm512_insertf32x8(_mm512_set1_ps(p[0]), _mm256_set1_ps(p[1]), 1);
}

// Whether `vnni_tile` takes this layout: blocks of 64 inputs whose groups are 32 or a multiple of 64.
inline bool vnni_groups(int64_t k, int64_t group_size) {
  return k % 64 == 0 && (group_size == 32 || group_size % 64 == 0);
}

// Output rows [o, o + R) x activation rows [m0, m0 + M) of `xq`: `block(r, b)` gives output o + r's block b as
// 64 unsigned bytes; `scales` is [outputs, groups]. Returns each (row, output)'s scaled dot in `dots`.
template <int M, int R, typename Block>
inline void vnni_tile(const QuantizedRows& xq, const float* scales, int64_t k, int64_t groups, int64_t group_size,
                      int64_t m0, int64_t o, const Block& block, float (&dots)[M][R]) {
  const bool paired = group_size == 32;  // a block holds two groups
  const int64_t blocks_per_group = paired ? 1 : group_size / 64;
  __m512 total[M][R];
#pragma GCC unroll 16
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) total[m][r] = _mm512_setzero_ps();
  for (int64_t b0 = 0; b0 < k / 64; b0 += blocks_per_group) {
    __m512i acc[M][R];
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_si512();
    for (int64_t b = b0; b < b0 + blocks_per_group; ++b) {
      __m512i wv[R];
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) wv[r] = block(r, b);
#pragma GCC unroll 16
      for (int m = 0; m < M; ++m) {
        const __m512i xv = _mm512_loadu_si512(xq.q.data() + (m0 + m) * k + b * 64);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbusd_epi32(acc[m][r], wv[r], xv);
      }
    }
    const int64_t g = paired ? b0 * 2 : b0 / blocks_per_group;
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) {
      const float* sx = xq.scale.data() + (m0 + m) * groups + g;
      const __m512 x_scale = paired ? vnni_pair_scales(sx) : _mm512_set1_ps(sx[0]);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const float* sw = scales + (o + r) * groups + g;
        const __m512 scale = _mm512_mul_ps(paired ? vnni_pair_scales(sw) : _mm512_set1_ps(sw[0]), x_scale);
        total[m][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m][r]), scale, total[m][r]);
      }
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) dots[m][r] = _mm512_reduce_add_ps(total[m][r]);
}

// y[row m0 + m, output o + r] = dots[m][r] - offset_scale x sum_g offsets[o + r][g] x xq.sum[m0 + m][g] + bias[o + r]:
// the tile's dots with what the weights' unsigned encoding added per group taken off (INT4: zero x scale; INT8:
// 128 x scale, the flipped sign bit). `offsets` is [outputs, groups]; `bias` [outputs] or null.
template <int M, int R>
inline void store_vnni_tile(const float (&dots)[M][R], const QuantizedRows& xq, const float* offsets,
                            float offset_scale, int64_t groups, const float* bias, int64_t m0, int64_t o, float* y,
                            int64_t y_stride) {
#pragma GCC unroll 16
  for (int m = 0; m < M; ++m) {
    const float* xsum = xq.sum.data() + (m0 + m) * groups;
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const float* row = offsets + (o + r) * groups;
      float offset = 0.f;
      for (int64_t g = 0; g < groups; ++g) offset += row[g] * xsum[g];
      y[(m0 + m) * y_stride + o + r] = dots[m][r] - offset_scale * offset + (bias ? bias[o + r] : 0.f);
    }
  }
}

}  // namespace
#endif
