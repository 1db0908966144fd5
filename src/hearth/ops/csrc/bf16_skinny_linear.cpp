// y = x @ w^T for a few rows of float32 activations and a bfloat16 weight [out, in], on CPU.
//
// Decoding a handful of sequences is bound by reading the weights, not by arithmetic: a bf16
// copy halves the bytes read per step. bf16 -> f32 is exact (the high half of the f32 bits), so
// with float32 activations and accumulation this computes what an f32 model loaded from the same
// bf16 checkpoint computes, up to summation order. GCC/Clang vector extensions keep it portable:
// -march=native turns them into AVX2/AVX-512 (or NEON) code.
// ATen headers only: torch/extension.h (pybind, autograd) triples the compile time; bindings.cpp has it.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include "skinny_linear.h"

#include <cstdint>
#include <cstring>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

constexpr int kLanes = 8;
typedef float f32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

inline f32x8 load_bf16(const uint16_t* p) {
#ifdef __AVX2__
  // GCC lowers the generic widening below to four shuffles; AVX2 has it as one instruction.
  const __m256i bits = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
  return reinterpret_cast<f32x8>(_mm256_castsi256_ps(bits));
#else
  u16x8 half;
  std::memcpy(&half, p, sizeof(half));
  u32x8 bits = __builtin_convertvector(half, u32x8) << 16;
  f32x8 out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
#endif
}

inline f32x8 load_f32(const float* p) {
  f32x8 out;
  std::memcpy(&out, p, sizeof(out));
  return out;
}

inline float sum_lanes(f32x8 v) {
#ifdef __AVX2__
  const __m256 x = reinterpret_cast<__m256>(v);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
#else
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
#endif
}

inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// R output features x M rows at a time, over U consecutive vectors of the reduction per step:
// each weight vector loaded once serves all M rows, and U * R * M independent FMA chains hide the
// FMA latency. Few concurrent weight rows (small R) keep the weight read one sequential stream,
// which the hardware prefetcher follows at full bandwidth; several rows read side by side do not.
template <int R, int M, int U>
void tile(const float* x, int64_t x_stride, const uint16_t* w, int64_t k, float* y, int64_t y_stride,
          const float* bias) {
  f32x8 acc[U][R][M] = {};
  const int64_t k_block = k - k % (U * kLanes);
  int64_t i = 0;
  for (; i < k_block; i += U * kLanes) {
    for (int u = 0; u < U; ++u) {
      f32x8 wv[R];
      for (int r = 0; r < R; ++r) wv[r] = load_bf16(w + r * k + i + u * kLanes);
      for (int m = 0; m < M; ++m) {
        const f32x8 xv = load_f32(x + m * x_stride + i + u * kLanes);
        for (int r = 0; r < R; ++r) acc[u][r][m] += wv[r] * xv;
      }
    }
  }
  for (; i + kLanes <= k; i += kLanes) {
    for (int r = 0; r < R; ++r) {
      const f32x8 wv = load_bf16(w + r * k + i);
      for (int m = 0; m < M; ++m) acc[0][r][m] += wv * load_f32(x + m * x_stride + i);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int m = 0; m < M; ++m) {
      f32x8 total = acc[0][r][m];
      for (int u = 1; u < U; ++u) total += acc[u][r][m];
      float s = sum_lanes(total);
      for (int64_t j = i; j < k; ++j) s += bf16_to_f32(w[r * k + j]) * x[m * x_stride + j];
      y[m * y_stride + r] = s + (bias ? bias[r] : 0.f);
    }
  }
}

template <int R, int M, int U>
void rows(const float* x, int64_t x_stride, const uint16_t* w, int64_t k, float* y, int64_t y_stride,
          const float* bias, int64_t begin, int64_t end) {
  int64_t n = begin;
  for (; n + R <= end; n += R) tile<R, M, U>(x, x_stride, w + n * k, k, y + n, y_stride, bias ? bias + n : nullptr);
  for (; n < end; ++n) tile<1, M, U>(x, x_stride, w + n * k, k, y + n, y_stride, bias ? bias + n : nullptr);
}

constexpr int64_t kMaxTileRows = 8;

// Outputs [begin, end) of every row into y (row stride y_stride).
void run_range(const float* x_ptr, int64_t x_stride, int64_t m, const uint16_t* w_ptr, int64_t k, const float* bias_ptr,
               float* y_ptr, int64_t n, int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < m; m0 += kMaxTileRows) {
      const float* xb = x_ptr + m0 * x_stride;
      float* yb = y_ptr + m0 * n;
      switch (std::min(m - m0, kMaxTileRows)) {
        // Accumulators (U * R * M) and weight vectors within the 16 AVX2 vector registers.
        case 1: rows<1, 1, 8>(xb, x_stride, w_ptr, k, yb, n, bias_ptr, begin, end); break;
        case 2: rows<1, 2, 4>(xb, x_stride, w_ptr, k, yb, n, bias_ptr, begin, end); break;
        case 3: rows<1, 3, 4>(xb, x_stride, w_ptr, k, yb, n, bias_ptr, begin, end); break;
        case 4: rows<1, 4, 2>(xb, x_stride, w_ptr, k, yb, n, bias_ptr, begin, end); break;
        case 5: rows<1, 5, 2>(xb, x_stride, w_ptr, k, yb, n, bias_ptr, begin, end); break;
        case 6: rows<1, 6, 2>(xb, x_stride, w_ptr, k, yb, n, bias_ptr, begin, end); break;
        case 7: rows<1, 7, 1>(xb, x_stride, w_ptr, k, yb, n, bias_ptr, begin, end); break;
        default: rows<1, 8, 1>(xb, x_stride, w_ptr, k, yb, n, bias_ptr, begin, end); break;
      }
    }
}

}  // namespace

void hearth::bf16_linear_range(const float* x, int64_t x_stride, int64_t m, const Bf16WeightView& view, float* y,
                               int64_t y_stride, int64_t begin, int64_t end) {
  run_range(x, x_stride, m, view.weight, view.k, view.bias, y, y_stride, begin, end);
}

at::Tensor bf16_skinny_linear(at::Tensor x, at::Tensor weight, std::optional<at::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "bf16_skinny_linear: x must be [rows, in] float32 with unit inner stride");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.is_contiguous(),
              "bf16_skinny_linear: weight must be a contiguous [out, in] bfloat16 tensor");
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  TORCH_CHECK(weight.size(1) == k, "bf16_skinny_linear: x has ", k, " features, weight expects ", weight.size(1));
  const float* bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                "bf16_skinny_linear: bias must be a contiguous float32 [out]");
    bias_ptr = bias->data_ptr<float>();
  }
  auto y = at::empty({m, n}, x.options());
  const float* x_ptr = x.data_ptr<float>();
  const uint16_t* w_ptr = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  float* y_ptr = y.data_ptr<float>();
  const int64_t x_stride = x.stride(0);
  // Split the output features among threads; each thread streams its own slice of the weight.
  const int64_t grain = std::max<int64_t>(16, 32768 / std::max<int64_t>(k, 1));
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    run_range(x_ptr, x_stride, m, w_ptr, k, bias_ptr, y_ptr, n, begin, end);
  });
  return y;
}
