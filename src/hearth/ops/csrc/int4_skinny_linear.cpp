// y = x @ w^T for a few rows of float32 activations and an INT4 weight [out, in] with per-group scales
// and zero points, on CPU (AVX2; a scalar path elsewhere).
//
// Decode is bound by reading weights: 4 bits a weight (plus a scale and a zero per group) is ~3.5x fewer
// bytes than bf16. Weights are unpacked to float32 in registers and multiplied with float32 activations
// (weight-only quantization: the activations are not rounded). Per group g of output o:
//   sum_i x_i * (q_i - z) * s  =  s * sum_i x_i q_i  -  (z s) * sum_i x_i
// so the inner loop is a plain dot with the unsigned nibbles, and the zero term uses the rows' group sums.
//
// Packed layout (`hearth.ops.int4.pack_int4`): per output row, blocks of 32 weights in 16 bytes; byte b of a
// block holds weight b in its low nibble and weight b + 16 in its high nibble, so one AND and one shift
// give two runs of 16 consecutive weights.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;  // weights per packed block
constexpr int kMaxRows = 4;     // rows sharing each unpacked weight block (4 x 4 accumulators + 4 weights)

#ifdef __AVX2__
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Rows [0, M) of x (stride x_stride) against one output row's packed weights: y[m] for each m.
template <int M>
void out_row(const float* x, int64_t x_stride, const uint8_t* w, const float* scales, const float* zero_scaled,
             const float* xsum, int64_t groups, int64_t k, int64_t group_size, float* y, int64_t y_stride,
             float bias) {
  __m256 total[M];
  float zero_term[M];
  for (int m = 0; m < M; ++m) {
    total[m] = _mm256_setzero_ps();
    zero_term[m] = 0.f;
  }
  const __m128i low_mask = _mm_set1_epi8(0x0f);
  const int64_t blocks_per_group = group_size / kBlock;
  for (int64_t g = 0; g < groups; ++g) {
    __m256 acc[M][2];
    for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks_per_group; ++b) {
      const int64_t i = (g * blocks_per_group + b) * kBlock;
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i / 2));
      const __m128i lo = _mm_and_si128(bytes, low_mask);                     // weights i .. i+15
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low_mask);  // weights i+16 .. i+31
      const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
      const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
      const __m256 w2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
      const __m256 w3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
      for (int m = 0; m < M; ++m) {
        const float* xm = x + m * x_stride + i;
        acc[m][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xm), acc[m][0]);
        acc[m][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xm + 8), acc[m][1]);
        acc[m][0] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xm + 16), acc[m][0]);
        acc[m][1] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xm + 24), acc[m][1]);
      }
    }
    const __m256 s = _mm256_set1_ps(scales[g]);
    for (int m = 0; m < M; ++m) {
      total[m] = _mm256_fmadd_ps(s, _mm256_add_ps(acc[m][0], acc[m][1]), total[m]);
      zero_term[m] += zero_scaled[g] * xsum[m * groups + g];
    }
  }
  for (int m = 0; m < M; ++m) y[m * y_stride] = hsum(total[m]) - zero_term[m] + bias;
}
#endif

void out_row_scalar(const float* x, int64_t x_stride, int64_t rows, const uint8_t* w, const float* scales,
                    const float* zero_scaled, const float* xsum, int64_t groups, int64_t group_size, float* y,
                    int64_t y_stride, float bias) {
  for (int64_t m = 0; m < rows; ++m) {
    float total = 0.f;
    for (int64_t g = 0; g < groups; ++g) {
      float dot = 0.f;
      for (int64_t i = g * group_size; i < (g + 1) * group_size; ++i) {
        const int64_t block = i / kBlock, j = i % kBlock;
        const uint8_t byte = w[block * (kBlock / 2) + (j % 16)];
        const float q = static_cast<float>(j < 16 ? (byte & 0x0f) : (byte >> 4));
        dot += q * x[m * x_stride + i];
      }
      total += scales[g] * dot - zero_scaled[g] * xsum[m * groups + g];
    }
    y[m * y_stride] = total + bias;
  }
}

}  // namespace

at::Tensor int4_skinny_linear(at::Tensor x,            // [rows, in] float32, unit inner stride
                              at::Tensor packed,       // [out, in / 2] uint8 (layout above)
                              at::Tensor scales,       // [out, groups] float32
                              at::Tensor zero_scaled,  // [out, groups] float32: zero point x scale
                              int64_t group_size, std::optional<at::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "int4_skinny_linear: x must be [rows, in] float32 with unit inner stride");
  const int64_t m = x.size(0), k = x.size(1), n = packed.size(0);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.size(1) * 2 == k,
              "int4_skinny_linear: packed must be a contiguous [out, in / 2] uint8 tensor");
  TORCH_CHECK(group_size % kBlock == 0 && k % group_size == 0, "int4_skinny_linear: group size must divide in and be a multiple of 32");
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
  const float* x_ptr = x.data_ptr<float>();
  const int64_t x_stride = x.stride(0);
  // Each row's sum per group, for the zero-point term.
  std::vector<float> xsum(m * groups);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.f;
      for (int64_t i = g * group_size; i < (g + 1) * group_size; ++i) s += x_ptr[r * x_stride + i];
      xsum[r * groups + g] = s;
    }
  auto y = at::empty({m, n}, x.options());
  float* y_ptr = y.data_ptr<float>();
  const uint8_t* w_ptr = packed.data_ptr<uint8_t>();
  const float* s_ptr = scales.data_ptr<float>();
  const float* z_ptr = zero_scaled.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(16, 65536 / std::max<int64_t>(k, 1));
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      const uint8_t* w = w_ptr + o * (k / 2);
      const float* s = s_ptr + o * groups;
      const float* z = z_ptr + o * groups;
      const float b = bias_ptr ? bias_ptr[o] : 0.f;
      for (int64_t m0 = 0; m0 < m; m0 += kMaxRows) {
        const float* xb = x_ptr + m0 * x_stride;
        const float* xs = xsum.data() + m0 * groups;
        float* yb = y_ptr + m0 * n + o;
#ifdef __AVX2__
        switch (std::min<int64_t>(m - m0, kMaxRows)) {
          case 1: out_row<1>(xb, x_stride, w, s, z, xs, groups, k, group_size, yb, n, b); break;
          case 2: out_row<2>(xb, x_stride, w, s, z, xs, groups, k, group_size, yb, n, b); break;
          case 3: out_row<3>(xb, x_stride, w, s, z, xs, groups, k, group_size, yb, n, b); break;
          default: out_row<4>(xb, x_stride, w, s, z, xs, groups, k, group_size, yb, n, b); break;
        }
#else
        out_row_scalar(xb, x_stride, std::min<int64_t>(m - m0, kMaxRows), w, s, z, xs, groups, group_size, yb, n, b);
#endif
      }
    }
  });
  return y;
}
