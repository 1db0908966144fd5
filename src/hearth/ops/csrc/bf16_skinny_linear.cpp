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

#include <cstdint>
#include <cstring>

namespace {

constexpr int kLanes = 8;
typedef float f32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

inline f32x8 load_bf16(const uint16_t* p) {
  u16x8 half;
  std::memcpy(&half, p, sizeof(half));
  u32x8 bits = __builtin_convertvector(half, u32x8) << 16;
  f32x8 out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

inline f32x8 load_f32(const float* p) {
  f32x8 out;
  std::memcpy(&out, p, sizeof(out));
  return out;
}

inline float sum_lanes(f32x8 v) {
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// R output features x M rows at a time: each weight vector loaded once serves all M rows, and
// the R * M independent accumulators hide the FMA latency.
template <int R, int M>
void tile(const float* x, int64_t x_stride, const uint16_t* w, int64_t k, float* y, int64_t y_stride,
          const float* bias) {
  f32x8 acc[R][M] = {};
  const int64_t k_vec = k - k % kLanes;
  for (int64_t i = 0; i < k_vec; i += kLanes) {
    f32x8 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = load_bf16(w + r * k + i);
    for (int m = 0; m < M; ++m) {
      const f32x8 xv = load_f32(x + m * x_stride + i);
      for (int r = 0; r < R; ++r) acc[r][m] += wv[r] * xv;
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int m = 0; m < M; ++m) {
      float s = sum_lanes(acc[r][m]);
      for (int64_t i = k_vec; i < k; ++i) s += bf16_to_f32(w[r * k + i]) * x[m * x_stride + i];
      y[m * y_stride + r] = s + (bias ? bias[r] : 0.f);
    }
  }
}

template <int M>
void rows(const float* x, int64_t x_stride, const uint16_t* w, int64_t k, float* y, int64_t y_stride,
          const float* bias, int64_t begin, int64_t end) {
  // Four features per tile for one or two rows, two beyond: stays within 16 vector registers.
  constexpr int R = M <= 2 ? 4 : 2;
  int64_t n = begin;
  for (; n + R <= end; n += R) tile<R, M>(x, x_stride, w + n * k, k, y + n, y_stride, bias ? bias + n : nullptr);
  for (; n < end; ++n) tile<1, M>(x, x_stride, w + n * k, k, y + n, y_stride, bias ? bias + n : nullptr);
}

constexpr int64_t kMaxTileRows = 4;

}  // namespace

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
    for (int64_t m0 = 0; m0 < m; m0 += kMaxTileRows) {
      const float* xb = x_ptr + m0 * x_stride;
      float* yb = y_ptr + m0 * n;
      switch (std::min(m - m0, kMaxTileRows)) {
        case 1: rows<1>(xb, x_stride, w_ptr, k, yb, n, bias_ptr, begin, end); break;
        case 2: rows<2>(xb, x_stride, w_ptr, k, yb, n, bias_ptr, begin, end); break;
        case 3: rows<3>(xb, x_stride, w_ptr, k, yb, n, bias_ptr, begin, end); break;
        default: rows<4>(xb, x_stride, w_ptr, k, yb, n, bias_ptr, begin, end); break;
      }
    }
  });
  return y;
}
