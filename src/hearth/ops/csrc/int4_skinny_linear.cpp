// y = x @ w^T for a few rows of float32 activations and an INT4 weight [out, in] with per-group scales
// and zero points, on CPU (AVX2, the float loop AVX-512 where the CPU has it; a scalar path elsewhere).
//
// Decode is bound by reading weights: 4 bits a weight (plus a scale and a zero per group) is ~3.5x fewer
// bytes than bf16, but once the weights sit in cache the cost is the unpacking and the multiply. Per group
// g of output o:
//   sum_i x_i * (q_i - z) * s  =  s * sum_i x_i q_i  -  (z s) * sum_i x_i
// so the inner loop is a plain dot with the unsigned nibbles, and the zero term uses the rows' group sums.
//
// Two inner loops:
// - W4A8 (default, `int8_activations`): each activation row is rounded to int8 per (row, group), scale =
//   the group's |max| / 127 (the weight's group, so one float multiply per group covers both scales). The
//   dot is integer: vpmaddubsw (unsigned nibble x signed int8 -> int16 pairs, 2 x 15 x 127 cannot saturate)
//   summed in int16, then vpmaddwd by ones -> int32 once per group, as llama.cpp's Q4 x Q8 dot on AVX2. 32
//   weights cost ~2 unpack ops shared by the rows and 2 integer ops per row, against 4 FMAs per row (plus
//   the widening) for the float loop.
// - W4A16 (exact weight-only): the nibbles are widened to float32 and FMA'd with the float activations (on
//   AVX-512: looked up in a table of the group's dequantized weights, `row_f32_avx512`).
//
// Packed layout (`hearth.ops.int4.pack_int4`): per output row, blocks of 64 weights in 32 bytes; byte b holds
// weight b in its low nibble and weight b + 32 in its high nibble. One AND gives weights 0..31 as bytes in
// order, a 16-bit shift and an AND weights 32..63: no byte shuffles (the shuffle port is what limits a nibble
// unpack). Groups of 32 are the low or the high half of a block.
//
// Register blocking: a tile of R output rows x M activation rows keeps R x M int32 accumulators (<= 8), so
// each unpacked weight block serves M rows and each activation load serves R outputs.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include "activations_int8.h"
#include "skinny_linear.h"
#include "vnni_tile.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 64;  // weights per packed block (32 bytes)
constexpr int64_t kHalf = 32;   // the unit groups are made of
constexpr int kMaxRows = 8;     // activation rows per pass over a weight tile (float loop)
constexpr int kMaxRowsA8 = 4;   // W4A8: per row an int16 partial sum, an int32 sum and a float total stay in
                                // registers up to 4 rows; 6-8 rows spilled them and ran 3-4x slower per row

inline uint8_t nibble(const uint8_t* w, int64_t i) {
  const uint8_t byte = w[(i / kBlock) * 32 + (i % kHalf)];
  return (i % kBlock) < kHalf ? (byte & 0x0f) : (byte >> 4);
}

struct Weight {
  const uint8_t* packed;      // [n, k / 2]
  const float* scales;        // [n, groups]
  const float* zero_scaled;   // [n, groups]
  const float* bias;          // [n] or null
  int64_t k, groups, group_size;
};

#ifdef __AVX2__
// The per-row/per-output arrays below (accumulators, totals) must live in registers: that needs their loops
// over M/R fully unrolled. GCC's size limits stopped doing so from 3-4 rows, and the arrays went to the
// stack (a load and a store per multiply-add): 4 rows ran ~8x slower than 2.
#define HEARTH_UNROLL _Pragma("GCC unroll 16")

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256i dot_u4_s8(__m256i w, __m256i x, __m256i ones) {  // 32 products summed into 8 int32 lanes
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones);
}

// W4A8: output rows [o, o + R) x activation rows [m0, m0 + M). vpmaddubsw's int16 pair sums (|.| <= 2 x 15 x
// 127 = 3810) are added in int16 for up to 8 products (256 weights, |.| <= 30480) before one widening vpmaddwd:
// per 32 weights and row that is one multiply and one add.
template <int M, int R>
void tile_a8(const Weight& w, const QuantizedRows& xq, int64_t m0, int64_t o, float* y, int64_t y_stride) {
  constexpr int64_t kInt16Span = 256;  // weights whose int16 partial sums cannot overflow
  const __m256i mask = _mm256_set1_epi8(0x0f);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 total[M][R];
  float zero_term[M][R];
  HEARTH_UNROLL
  for (int m = 0; m < M; ++m)
    HEARTH_UNROLL
    for (int r = 0; r < R; ++r) total[m][r] = _mm256_setzero_ps(), zero_term[m][r] = 0.f;
  const int64_t row_bytes = w.k / 2;
  const int64_t span = std::min(w.group_size, kInt16Span);
  for (int64_t g = 0; g < w.groups; ++g) {
    __m256i acc[M][R];
    HEARTH_UNROLL
    for (int m = 0; m < M; ++m)
      HEARTH_UNROLL
      for (int r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_si256();
    const int64_t first = g * w.group_size;
    for (int64_t s0 = first; s0 < first + w.group_size; s0 += span) {
      __m256i part[M][R];
      HEARTH_UNROLL
      for (int m = 0; m < M; ++m)
        HEARTH_UNROLL
        for (int r = 0; r < R; ++r) part[m][r] = _mm256_setzero_si256();
      for (int64_t i = s0; i < s0 + span; i += kHalf) {  // 32 weights: the low or the high nibbles of a block
        const bool high = (i % kBlock) != 0;
        HEARTH_UNROLL
        for (int r = 0; r < R; ++r) {
          __m256i bytes =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.packed + (o + r) * row_bytes + (i / kBlock) * 32));
          if (high) bytes = _mm256_srli_epi16(bytes, 4);
          const __m256i q = _mm256_and_si256(bytes, mask);
          HEARTH_UNROLL
          for (int m = 0; m < M; ++m) {
            const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.q.data() + (m0 + m) * w.k + i));
            part[m][r] = _mm256_add_epi16(part[m][r], _mm256_maddubs_epi16(q, xv));
          }
        }
      }
      HEARTH_UNROLL
      for (int m = 0; m < M; ++m)
        HEARTH_UNROLL
        for (int r = 0; r < R; ++r) acc[m][r] = _mm256_add_epi32(acc[m][r], _mm256_madd_epi16(part[m][r], ones));
    }
    HEARTH_UNROLL
    for (int m = 0; m < M; ++m) {
      const float sx = xq.scale[(m0 + m) * w.groups + g];
      const float xsum = xq.sum[(m0 + m) * w.groups + g];
      HEARTH_UNROLL
      for (int r = 0; r < R; ++r) {
        const int64_t sg = (o + r) * w.groups + g;
        total[m][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m][r]), _mm256_set1_ps(w.scales[sg] * sx), total[m][r]);
        zero_term[m][r] += w.zero_scaled[sg] * xsum;
      }
    }
  }
  HEARTH_UNROLL
  for (int m = 0; m < M; ++m)
    HEARTH_UNROLL
    for (int r = 0; r < R; ++r)
      y[(m0 + m) * y_stride + o + r] = hsum(total[m][r]) - zero_term[m][r] + (w.bias ? w.bias[o + r] : 0.f);
}

// W4A16: one output row x activation rows [m0, m0 + M), float32 FMA; A accumulators per row hide the latency.
template <int M, int A>
void row_f32(const Weight& w, const float* x, int64_t x_stride, const float* xsum, int64_t m0, int64_t o, float* y,
             int64_t y_stride) {
  __m256 total[M];
  float zero_term[M];
  HEARTH_UNROLL
  for (int m = 0; m < M; ++m) total[m] = _mm256_setzero_ps(), zero_term[m] = 0.f;
  const __m256i mask = _mm256_set1_epi32(0x0f);
  const uint8_t* wo = w.packed + o * (w.k / 2);
  for (int64_t g = 0; g < w.groups; ++g) {
    __m256 acc[M][A];
    HEARTH_UNROLL
    for (int m = 0; m < M; ++m)
      HEARTH_UNROLL
      for (int a = 0; a < A; ++a) acc[m][a] = _mm256_setzero_ps();
    for (int64_t i = g * w.group_size; i < (g + 1) * w.group_size; i += kHalf) {
      const uint8_t* bytes = wo + (i / kBlock) * 32;
      const bool high = (i % kBlock) != 0;
      HEARTH_UNROLL
      for (int c = 0; c < 4; ++c) {
        __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + 8 * c)));
        v = high ? _mm256_srli_epi32(v, 4) : _mm256_and_si256(v, mask);
        const __m256 wv = _mm256_cvtepi32_ps(v);
        HEARTH_UNROLL
        for (int m = 0; m < M; ++m)
          acc[m][c % A] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + (m0 + m) * x_stride + i + 8 * c), acc[m][c % A]);
      }
    }
    const __m256 s = _mm256_set1_ps(w.scales[o * w.groups + g]);
    HEARTH_UNROLL
    for (int m = 0; m < M; ++m) {
      total[m] = _mm256_fmadd_ps(s, A == 2 ? _mm256_add_ps(acc[m][0], acc[m][A - 1]) : acc[m][0], total[m]);
      zero_term[m] += w.zero_scaled[o * w.groups + g] * xsum[(m0 + m) * w.groups + g];
    }
  }
  HEARTH_UNROLL
  for (int m = 0; m < M; ++m)
    y[(m0 + m) * y_stride + o] = hsum(total[m]) - zero_term[m] + (w.bias ? w.bias[o] : 0.f);
}

template <int M>
void tiles_a8(const Weight& w, const QuantizedRows& xq, int64_t m0, int64_t begin, int64_t end, float* y, int64_t n) {
  // R x M int16 partial sums and float totals within the 16 vector registers; past 2 rows each unpacked
  // block already serves enough rows.
  constexpr int R = M == 1 ? 4 : M == 2 ? 2 : 1;
  int64_t o = begin;
  for (; o + R <= end; o += R) tile_a8<M, R>(w, xq, m0, o, y, n);
  for (; o < end; ++o) tile_a8<M, 1>(w, xq, m0, o, y, n);
}
#endif

#ifdef HEARTH_VNNI
// W4A8 with AVX-512 VNNI (`vnni_tile.h`): a block's 32 bytes become one 64-byte vector, low nibbles (weights
// 0..31) in the low half and high nibbles (32..63) in the high one, the activations' own order: one vpdpbusd
// per 64 weights and row, against the AVX2 loop's unpack + maddubs + add per 32. The zero term is added per
// group after the dot.
template <int M, int R>
void tile_a8_vnni(const Weight& w, const QuantizedRows& xq, int64_t m0, int64_t o, float* y, int64_t y_stride) {
  const __m512i mask = _mm512_set1_epi8(0x0f);
  const int64_t row_bytes = w.k / 2;
  auto block = [&](int r, int64_t b) {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.packed + (o + r) * row_bytes + b * 32));
    return _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(bytes), _mm256_srli_epi16(bytes, 4), 1), mask);
  };
  float dots[M][R];
  vnni_tile<M, R>(xq, w.scales, w.k, w.groups, w.group_size, m0, o, block, dots);
  store_vnni_tile<M, R>(dots, xq, w.zero_scaled, 1.f, w.groups, w.bias, m0, o, y, y_stride);
}

template <int M>
void tiles_a8_vnni(const Weight& w, const QuantizedRows& xq, int64_t m0, int64_t begin, int64_t end, float* y,
                   int64_t n) {
  constexpr int R = M == 1 ? 4 : 2;
  int64_t o = begin;
  for (; o + R <= end; o += R) tile_a8_vnni<M, R>(w, xq, m0, o, y, n);
  for (; o < end; ++o) tile_a8_vnni<M, 1>(w, xq, m0, o, y, n);
}

inline bool vnni_layout(const Weight& w) { return vnni_groups(w.k, w.group_size); }
#endif

#ifdef __AVX512F__
// W4A16 with 16 lanes: one output row x activation rows [m0, m0 + M). Each 32-weight half-block's group has a
// 16-entry table of its dequantized weights, t[q] = q * scale - zero * scale (one FMA from 0..15), and vpermps
// looks a nibble up in it: vpermps reads only an index's low 4 bits, so the low nibble needs no AND and neither
// needs an int->float conversion, and no zero-point term or group scaling is left after the dot. A block's 32
// bytes widen in two 16-byte halves to 16 int32 lanes each; the low nibbles of bytes 0..15 are weights 0..15 of
// the block, their high nibbles weights 32..47 (bytes 16..31: 16..31 and 48..63). Against widening, converting
// and scaling (the AVX2 loop's way) it is ~1.75x the weights a cycle, and the dot is the dequantized weights'
// (`hearth.ops.int4.dequantize_int4`) up to float32 summation order.
template <int M>
void row_f32_avx512(const Weight& w, const float* x, int64_t x_stride, int64_t m0, int64_t o, float* y,
                    int64_t y_stride) {
  __m512 even[M], odd[M];  // two chains per row
  HEARTH_UNROLL
  for (int m = 0; m < M; ++m) even[m] = _mm512_setzero_ps(), odd[m] = _mm512_setzero_ps();
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const uint8_t* wo = w.packed + o * (w.k / 2);
  const float* scales = w.scales + o * w.groups;
  const float* zero_scaled = w.zero_scaled + o * w.groups;
  for (int64_t i = 0; i < w.k; i += kBlock) {
    const int64_t low_group = i / w.group_size, high_group = (i + kHalf) / w.group_size;
    const __m512 low_table =
        _mm512_fmsub_ps(iota, _mm512_set1_ps(scales[low_group]), _mm512_set1_ps(zero_scaled[low_group]));
    const __m512 high_table =
        _mm512_fmsub_ps(iota, _mm512_set1_ps(scales[high_group]), _mm512_set1_ps(zero_scaled[high_group]));
    const uint8_t* bytes = wo + (i / kBlock) * 32;
    const __m512i v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
    const __m512i v1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 16)));
    const __m512 w0 = _mm512_permutexvar_ps(v0, low_table);  // weights 0..15 of the block
    const __m512 w1 = _mm512_permutexvar_ps(v1, low_table);  // 16..31
    const __m512 w2 = _mm512_permutexvar_ps(_mm512_srli_epi32(v0, 4), high_table);  // 32..47
    const __m512 w3 = _mm512_permutexvar_ps(_mm512_srli_epi32(v1, 4), high_table);  // 48..63
    HEARTH_UNROLL
    for (int m = 0; m < M; ++m) {
      const float* xr = x + (m0 + m) * x_stride + i;
      even[m] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr), even[m]);
      odd[m] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), odd[m]);
      even[m] = _mm512_fmadd_ps(w2, _mm512_loadu_ps(xr + 32), even[m]);
      odd[m] = _mm512_fmadd_ps(w3, _mm512_loadu_ps(xr + 48), odd[m]);
    }
  }
  HEARTH_UNROLL
  for (int m = 0; m < M; ++m)
    y[(m0 + m) * y_stride + o] = _mm512_reduce_add_ps(_mm512_add_ps(even[m], odd[m])) + (w.bias ? w.bias[o] : 0.f);
}
#endif

void scalar_rows(const Weight& w, const float* x, int64_t x_stride, const QuantizedRows* xq, const float* xsum,
                 int64_t m0, int64_t rows, int64_t o, float* y, int64_t y_stride) {
  const uint8_t* wo = w.packed + o * (w.k / 2);
  for (int64_t m = m0; m < m0 + rows; ++m) {
    float total = 0.f;
    for (int64_t g = 0; g < w.groups; ++g) {
      float dot = 0.f;
      for (int64_t i = g * w.group_size; i < (g + 1) * w.group_size; ++i)
        dot += static_cast<float>(nibble(wo, i)) * (xq ? static_cast<float>(xq->q[m * w.k + i]) : x[m * x_stride + i]);
      const float sx = xq ? xq->scale[m * w.groups + g] : 1.f;
      const float s = xq ? xq->sum[m * w.groups + g] : xsum[m * w.groups + g];
      total += w.scales[o * w.groups + g] * sx * dot - w.zero_scaled[o * w.groups + g] * s;
    }
    y[m * y_stride + o] = total + (w.bias ? w.bias[o] : 0.f);
  }
}

}  // namespace

namespace {

// Outputs [begin, end) of every row, into y (row stride y_stride), activations prepared (`xq` or `xsum`).
void run_range(const Weight& w, const float* x_ptr, int64_t x_stride, int64_t m, const QuantizedRows& xq,
               const std::vector<float>& xsum, bool int8_activations, float* y_ptr, int64_t n, int64_t begin,
               int64_t end) {
  const int64_t k = w.k;
  // Blocks of outputs whose packed weights stay in L1/L2 while every pass of activation rows reads them: the
  // weights come from memory once a call, whatever the row count.
  const int64_t out_block = std::max<int64_t>(4, 16384 / std::max<int64_t>(k / 2, 1)) / 4 * 4;
    const int64_t pass = int8_activations ? kMaxRowsA8 : kMaxRows;
    for (int64_t o0 = begin; o0 < end; o0 += out_block) {
      const int64_t o1 = std::min(end, o0 + out_block);
      for (int64_t m0 = 0; m0 < m; m0 += pass) {
        const int64_t rows = std::min<int64_t>(m - m0, pass);
#ifdef __AVX2__
        if (int8_activations) {
#ifdef HEARTH_VNNI
          if (vnni_layout(w)) {
            switch (rows) {
              case 1: tiles_a8_vnni<1>(w, xq, m0, o0, o1, y_ptr, n); break;
              case 2: tiles_a8_vnni<2>(w, xq, m0, o0, o1, y_ptr, n); break;
              case 3: tiles_a8_vnni<3>(w, xq, m0, o0, o1, y_ptr, n); break;
              default: tiles_a8_vnni<4>(w, xq, m0, o0, o1, y_ptr, n); break;
            }
            continue;
          }
#endif
          switch (rows) {
            case 1: tiles_a8<1>(w, xq, m0, o0, o1, y_ptr, n); break;
            case 2: tiles_a8<2>(w, xq, m0, o0, o1, y_ptr, n); break;
            case 3: tiles_a8<3>(w, xq, m0, o0, o1, y_ptr, n); break;
            default: tiles_a8<4>(w, xq, m0, o0, o1, y_ptr, n); break;
          }
          continue;
        }
        for (int64_t o = o0; o < o1; ++o) {
#ifdef __AVX512F__
          switch (rows) {
            case 1: row_f32_avx512<1>(w, x_ptr, x_stride, m0, o, y_ptr, n); break;
            case 2: row_f32_avx512<2>(w, x_ptr, x_stride, m0, o, y_ptr, n); break;
            case 3: row_f32_avx512<3>(w, x_ptr, x_stride, m0, o, y_ptr, n); break;
            case 4: row_f32_avx512<4>(w, x_ptr, x_stride, m0, o, y_ptr, n); break;
            case 5: row_f32_avx512<5>(w, x_ptr, x_stride, m0, o, y_ptr, n); break;
            case 6: row_f32_avx512<6>(w, x_ptr, x_stride, m0, o, y_ptr, n); break;
            case 7: row_f32_avx512<7>(w, x_ptr, x_stride, m0, o, y_ptr, n); break;
            default: row_f32_avx512<8>(w, x_ptr, x_stride, m0, o, y_ptr, n); break;
          }
#else
          switch (rows) {
            case 1: row_f32<1, 2>(w, x_ptr, x_stride, xsum.data(), m0, o, y_ptr, n); break;
            case 2: row_f32<2, 2>(w, x_ptr, x_stride, xsum.data(), m0, o, y_ptr, n); break;
            case 3: row_f32<3, 1>(w, x_ptr, x_stride, xsum.data(), m0, o, y_ptr, n); break;
            case 4: row_f32<4, 1>(w, x_ptr, x_stride, xsum.data(), m0, o, y_ptr, n); break;
            case 5: row_f32<5, 1>(w, x_ptr, x_stride, xsum.data(), m0, o, y_ptr, n); break;
            case 6: row_f32<6, 1>(w, x_ptr, x_stride, xsum.data(), m0, o, y_ptr, n); break;
            case 7: row_f32<7, 1>(w, x_ptr, x_stride, xsum.data(), m0, o, y_ptr, n); break;
            default: row_f32<8, 1>(w, x_ptr, x_stride, xsum.data(), m0, o, y_ptr, n); break;
          }
#endif
        }
#else
        for (int64_t o = o0; o < o1; ++o)
          scalar_rows(w, x_ptr, x_stride, int8_activations ? &xq : nullptr, xsum.data(), m0, rows, o, y_ptr, n);
#endif
      }
    }
}

void prepare_activations(const float* x_ptr, int64_t x_stride, int64_t m, int64_t k, int64_t group_size,
                         bool int8_activations, QuantizedRows& xq, std::vector<float>& xsum) {
  if (int8_activations) {
    xq = quantize_rows(x_ptr, x_stride, m, k, group_size);
    return;
  }
#ifndef __AVX512F__  // the AVX-512 loop dequantizes through a table: it has no zero-point term to take off
  const int64_t groups = k / group_size;
  xsum.assign(m * groups, 0.f);  // each row's sum per group, for the zero-point term
  for (int64_t r = 0; r < m; ++r)
    for (int64_t i = 0; i < k; ++i) xsum[r * groups + i / group_size] += x_ptr[r * x_stride + i];
#endif
}

}  // namespace

void hearth::int4_linear_range(const float* x, int64_t x_stride, int64_t m, const Int4WeightView& view, float* y,
                               int64_t y_stride, int64_t begin, int64_t end) {
  const Weight w{view.packed, view.scales, view.zero_scaled, view.bias, view.k, view.k / view.group_size,
                 view.group_size};
  QuantizedRows xq;
  std::vector<float> xsum;
  prepare_activations(x, x_stride, m, view.k, view.group_size, view.int8_activations, xq, xsum);
  run_range(w, x, x_stride, m, xq, xsum, view.int8_activations, y, y_stride, begin, end);
}

at::Tensor int4_skinny_linear(at::Tensor x,            // [rows, in] float32, unit inner stride
                              at::Tensor packed,       // [out, in / 2] uint8 (layout above)
                              at::Tensor scales,       // [out, groups] float32
                              at::Tensor zero_scaled,  // [out, groups] float32: zero point x scale
                              int64_t group_size, std::optional<at::Tensor> bias, bool int8_activations) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "int4_skinny_linear: x must be [rows, in] float32 with unit inner stride");
  const int64_t m = x.size(0), k = x.size(1), n = packed.size(0);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.size(1) * 2 == k,
              "int4_skinny_linear: packed must be a contiguous [out, in / 2] uint8 tensor");
  TORCH_CHECK(group_size % kHalf == 0 && k % group_size == 0 && k % kBlock == 0,
              "int4_skinny_linear: in must be a multiple of 64 and of the group size, itself a multiple of 32");
  const int64_t groups = k / group_size;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && zero_scaled.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  zero_scaled.is_contiguous() && scales.size(0) == n && scales.size(1) == groups &&
                  zero_scaled.sizes() == scales.sizes(),
              "int4_skinny_linear: scales and zero_scaled must be contiguous float32 [out, in / group_size]");
  const float* bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                "int4_skinny_linear: bias must be a contiguous float32 [out]");
    bias_ptr = bias->data_ptr<float>();
  }
  const Weight w{packed.data_ptr<uint8_t>(), scales.data_ptr<float>(), zero_scaled.data_ptr<float>(), bias_ptr,
                 k, groups, group_size};
  const float* x_ptr = x.data_ptr<float>();
  const int64_t x_stride = x.stride(0);
  QuantizedRows xq;
  std::vector<float> xsum;
  prepare_activations(x_ptr, x_stride, m, k, group_size, int8_activations, xq, xsum);
  auto y = at::empty({m, n}, x.options());
  float* y_ptr = y.data_ptr<float>();
  // Chunks of whole 4-row tiles, big enough that a thread's share amortizes the fork.
  const int64_t grain = std::max<int64_t>(16, 65536 / std::max<int64_t>(k, 1)) / 4 * 4;
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    run_range(w, x_ptr, x_stride, m, xq, xsum, int8_activations, y_ptr, n, begin, end);
  });
  return y;
}
