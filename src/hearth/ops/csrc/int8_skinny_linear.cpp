// y = x @ w^T for a few rows of float32 activations and an INT8 weight [out, in] with one float32 scale per
// group of input features (GGUF's Q8_0: w = d * q, 32 weights per d), on CPU.
//
// Decode reads every weight once a step: int8 is a quarter of float32's bytes. The LM head of a small model is
// its largest matrix (SmolLM2-135M: 49,152 x 576, 113 MB in float32, 30 MB as Q8_0), so this kernel is what a
// GGUF's tied Q8_0 embedding runs on as the head. Per group g of output o:
//   sum_i x_i * (q_i * d)  =  d * sum_i x_i q_i
// the int8 weights are widened to float32 in registers and FMA'd with the float activations (the file's
// weights exactly: no rounding of the activations), and the group's sum is scaled once.
//
// Register blocking: a tile of R output rows x M activation rows shares each widened weight vector across the
// M rows and each activation load across the R outputs.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include "activations_int8.h"
#include "skinny_linear.h"
#include "vnni_tile.h"
#include "weight_prefetch.h"

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

struct Int8Weight {
  const int8_t* q;        // [n, k]
  const float* scales;    // [n, groups]
  const float* bias;      // [n] or null
  int64_t k, groups, group_size;
};

// The weights and scales of rows [o, o + rows), a few KB ahead (`weight_prefetch.h`), within [.., end).
inline void prefetch_ahead(const Int8Weight& w, int64_t o, int64_t rows, int64_t end) {
  hearth::prefetch_ahead(w.q, w.k, o, rows, end);
  hearth::prefetch_ahead(w.scales, w.groups * static_cast<int64_t>(sizeof(float)), o, rows, end);
}

#define HEARTH_UNROLL _Pragma("GCC unroll 16")

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
using VecF = __m512;
inline VecF zero_f() { return _mm512_setzero_ps(); }
inline VecF load_f(const float* p) { return _mm512_loadu_ps(p); }
inline VecF widen_i8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline VecF fma_f(VecF a, VecF b, VecF c) { return _mm512_fmadd_ps(a, b, c); }
inline VecF set1_f(float v) { return _mm512_set1_ps(v); }
inline float hsum_f(VecF v) { return _mm512_reduce_add_ps(v); }
#define HEARTH_INT8_SIMD 1
#elif defined(__AVX2__)
constexpr int64_t kLanes = 8;
using VecF = __m256;
inline VecF zero_f() { return _mm256_setzero_ps(); }
inline VecF load_f(const float* p) { return _mm256_loadu_ps(p); }
inline VecF widen_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline VecF fma_f(VecF a, VecF b, VecF c) { return _mm256_fmadd_ps(a, b, c); }
inline VecF set1_f(float v) { return _mm256_set1_ps(v); }
inline float hsum_f(VecF v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#define HEARTH_INT8_SIMD 1
#endif

#ifdef HEARTH_INT8_SIMD
// Output rows [o, o + R) x activation rows [m0, m0 + M).
template <int M, int R>
void tile(const Int8Weight& w, const float* x, int64_t x_stride, int64_t m0, int64_t o, float* y, int64_t y_stride) {
  VecF total[M][R];
  HEARTH_UNROLL
  for (int m = 0; m < M; ++m)
    HEARTH_UNROLL
    for (int r = 0; r < R; ++r) total[m][r] = zero_f();
  for (int64_t g = 0; g < w.groups; ++g) {
    VecF acc[M][R];
    HEARTH_UNROLL
    for (int m = 0; m < M; ++m)
      HEARTH_UNROLL
      for (int r = 0; r < R; ++r) acc[m][r] = zero_f();
    const int64_t first = g * w.group_size;
    for (int64_t i = first; i < first + w.group_size; i += kLanes) {
      VecF wv[R];
      HEARTH_UNROLL
      for (int r = 0; r < R; ++r) wv[r] = widen_i8(w.q + (o + r) * w.k + i);
      HEARTH_UNROLL
      for (int m = 0; m < M; ++m) {
        const VecF xv = load_f(x + (m0 + m) * x_stride + i);
        HEARTH_UNROLL
        for (int r = 0; r < R; ++r) acc[m][r] = fma_f(wv[r], xv, acc[m][r]);
      }
    }
    HEARTH_UNROLL
    for (int r = 0; r < R; ++r) {
      const VecF s = set1_f(w.scales[(o + r) * w.groups + g]);
      HEARTH_UNROLL
      for (int m = 0; m < M; ++m) total[m][r] = fma_f(acc[m][r], s, total[m][r]);
    }
  }
  HEARTH_UNROLL
  for (int m = 0; m < M; ++m)
    HEARTH_UNROLL
    for (int r = 0; r < R; ++r) y[(m0 + m) * y_stride + o + r] = hsum_f(total[m][r]) + (w.bias ? w.bias[o + r] : 0.f);
}

template <int M>
void tiles(const Int8Weight& w, const float* x, int64_t x_stride, int64_t m0, int64_t begin, int64_t end, float* y,
           int64_t n, int64_t range_end) {
  constexpr int R = M == 1 ? 4 : 2;
  int64_t o = begin;
  for (; o + R <= end; o += R) prefetch_ahead(w, o, R, range_end), tile<M, R>(w, x, x_stride, m0, o, y, n);
  for (; o < end; ++o) tile<M, 1>(w, x, x_stride, m0, o, y, n);
}
#endif

#ifdef HEARTH_VNNI
// W8A8 (opt-in, as llama.cpp's Q8_0 x Q8_0): the activations rounded to int8 per (row, group), the dot by
// `vnni_tile.h`. vpdpbusd multiplies unsigned by signed bytes, so the weights go in with their sign bit flipped
// (w + 128, unsigned): the extra 128 x sum(x) per group is taken off after the dot (`xq.sum` holds s x sum(q)).
template <int M, int R>
void tile_a8(const Int8Weight& w, const QuantizedRows& xq, int64_t m0, int64_t o, float* y, int64_t y_stride) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  auto block = [&](int r, int64_t b) { return _mm512_xor_si512(_mm512_loadu_si512(w.q + (o + r) * w.k + b * 64), flip); };
  float dots[M][R];
  vnni_tile<M, R>(xq, w.scales, w.k, w.groups, w.group_size, m0, o, block, dots);
  store_vnni_tile<M, R>(dots, xq, w.scales, 128.f, w.groups, w.bias, m0, o, y, y_stride);  // the sign bit's 128 x scale
}

template <int M>
void tiles_a8(const Int8Weight& w, const QuantizedRows& xq, int64_t m0, int64_t begin, int64_t end, float* y,
              int64_t n, int64_t range_end) {
  constexpr int R = M == 1 ? 4 : 2;
  int64_t o = begin;
  for (; o + R <= end; o += R) prefetch_ahead(w, o, R, range_end), tile_a8<M, R>(w, xq, m0, o, y, n);
  for (; o < end; ++o) tile_a8<M, 1>(w, xq, m0, o, y, n);
}
#endif

void scalar_rows(const Int8Weight& w, const float* x, int64_t x_stride, int64_t m0, int64_t rows, int64_t o, float* y,
                 int64_t y_stride) {
  for (int64_t m = m0; m < m0 + rows; ++m) {
    float total = 0.f;
    for (int64_t g = 0; g < w.groups; ++g) {
      float dot = 0.f;
      for (int64_t i = g * w.group_size; i < (g + 1) * w.group_size; ++i)
        dot += static_cast<float>(w.q[o * w.k + i]) * x[m * x_stride + i];
      total += w.scales[o * w.groups + g] * dot;
    }
    y[m * y_stride + o] = total + (w.bias ? w.bias[o] : 0.f);
  }
}

constexpr int kMaxRows = 4;  // activation rows per pass over a weight tile: M x R accumulators stay in registers

// W8A8 runs where the CPU has AVX-512 VNNI and the groups fit its blocks of 64; elsewhere float activations.
bool int8_activations_supported(const Int8Weight& w) {
#ifdef HEARTH_VNNI
  return vnni_groups(w.k, w.group_size);
#else
  (void)w;
  return false;
#endif
}

// Outputs [begin, end) of every row into y (row stride y_stride); `xq`: the rows rounded to int8 (W8A8).
void run_range(const Int8Weight& w, const float* x_ptr, int64_t x_stride, int64_t m, const QuantizedRows* xq,
               float* y_ptr, int64_t n, int64_t begin, int64_t end) {
  const int64_t k = w.k;
  // Blocks of outputs whose weights stay in L1/L2 while every pass of activation rows reads them: the
  // weights come from memory once a call, whatever the row count.
  const int64_t out_block = std::max<int64_t>(4, 32768 / std::max<int64_t>(k, 1)) / 4 * 4;
    for (int64_t o0 = begin; o0 < end; o0 += out_block) {
      const int64_t o1 = std::min(end, o0 + out_block);
      for (int64_t m0 = 0; m0 < m; m0 += kMaxRows) {
        const int64_t rows = std::min<int64_t>(m - m0, kMaxRows);
#ifdef HEARTH_VNNI
        if (xq != nullptr) {
          switch (rows) {
            case 1: tiles_a8<1>(w, *xq, m0, o0, o1, y_ptr, n, end); break;
            case 2: tiles_a8<2>(w, *xq, m0, o0, o1, y_ptr, n, end); break;
            case 3: tiles_a8<3>(w, *xq, m0, o0, o1, y_ptr, n, end); break;
            default: tiles_a8<4>(w, *xq, m0, o0, o1, y_ptr, n, end); break;
          }
          continue;
        }
#endif
#ifdef HEARTH_INT8_SIMD
        switch (rows) {
          case 1: tiles<1>(w, x_ptr, x_stride, m0, o0, o1, y_ptr, n, end); break;
          case 2: tiles<2>(w, x_ptr, x_stride, m0, o0, o1, y_ptr, n, end); break;
          case 3: tiles<3>(w, x_ptr, x_stride, m0, o0, o1, y_ptr, n, end); break;
          default: tiles<4>(w, x_ptr, x_stride, m0, o0, o1, y_ptr, n, end); break;
        }
#else
        for (int64_t o = o0; o < o1; ++o) scalar_rows(w, x_ptr, x_stride, m0, rows, o, y_ptr, n);
#endif
      }
    }
}

}  // namespace

void hearth::int8_linear_range(const float* x, int64_t x_stride, int64_t m, const Int8WeightView& view, float* y,
                               int64_t y_stride, int64_t begin, int64_t end) {
  const Int8Weight w{view.q, view.scales, view.bias, view.k, view.k / view.group_size, view.group_size};
  QuantizedRows xq;
  const bool a8 = view.int8_activations && int8_activations_supported(w);
  if (a8) xq = quantize_rows(x, x_stride, m, view.k, view.group_size);
  run_range(w, x, x_stride, m, a8 ? &xq : nullptr, y, y_stride, begin, end);
}

at::Tensor int8_skinny_linear(at::Tensor x,       // [rows, in] float32, unit inner stride
                              at::Tensor q,       // [out, in] int8, contiguous
                              at::Tensor scales,  // [out, in / group_size] float32, contiguous
                              int64_t group_size, std::optional<at::Tensor> bias, bool int8_activations) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "int8_skinny_linear: x must be [rows, in] float32 with unit inner stride");
  const int64_t m = x.size(0), k = x.size(1), n = q.size(0);
  TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous() && q.dim() == 2 && q.size(1) == k,
              "int8_skinny_linear: q must be a contiguous [out, in] int8 tensor");
  TORCH_CHECK(group_size > 0 && group_size % 16 == 0 && k % group_size == 0,
              "int8_skinny_linear: the group size must be a multiple of 16 dividing the input features");
  const int64_t groups = k / group_size;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.size(0) == n &&
                  scales.size(1) == groups,
              "int8_skinny_linear: scales must be contiguous float32 [out, in / group_size]");
  const float* bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                "int8_skinny_linear: bias must be a contiguous float32 [out]");
    bias_ptr = bias->data_ptr<float>();
  }
  const Int8Weight w{q.data_ptr<int8_t>(), scales.data_ptr<float>(), bias_ptr, k, groups, group_size};
  const float* x_ptr = x.data_ptr<float>();
  const int64_t x_stride = x.stride(0);
  auto y = at::empty({m, n}, x.options());
  float* y_ptr = y.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(16, 65536 / std::max<int64_t>(k, 1)) / 4 * 4;
  QuantizedRows xq;
  const bool a8 = int8_activations && int8_activations_supported(w);
  if (a8) xq = quantize_rows(x_ptr, x_stride, m, k, group_size);
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    run_range(w, x_ptr, x_stride, m, a8 ? &xq : nullptr, y_ptr, n, begin, end);
  });
  return y;
}
