// y = x @ w^T for a few rows of float32 activations and an INT4 weight [out, in] with per-group scales
// and zero points, on CPU (AVX2; a scalar path elsewhere).
//
// Decode is bound by reading weights: 4 bits a weight (plus a scale and a zero per group) is ~3.5x fewer
// bytes than bf16. Weights are unpacked to float32 in registers and multiplied with float32 activations
// (weight-only quantization: the activations are not rounded). Per group g of output o:
//   sum_i x_i * (q_i - z) * s  =  s * sum_i x_i q_i  -  (z s) * sum_i x_i
// so the inner loop is a plain dot with the unsigned nibbles, and the zero term uses the rows' group sums.
//
// Packed layout (`hearth.ops.int4.pack_int4`): per output row, blocks of 64 weights in 8 little-endian
// uint32 lanes; nibble j of lane l is weight 8j + l. A shift and an AND per nibble give 8 consecutive weights
// in the 8 lanes of a vector, with no byte shuffles (the shuffle port is what limits a nibble unpack).
// Weights 0..31 of a block are nibbles 0..3, weights 32..63 nibbles 4..7: groups of 32 stay addressable.
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

constexpr int64_t kBlock = 64;  // weights per packed block (32 bytes)
constexpr int64_t kHalf = 32;   // the unit groups are made of
constexpr int kMaxRows = 8;     // rows sharing each unpacked weight block (within 16 vector registers)

#ifdef __AVX2__
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Rows [0, M) of x (stride x_stride) against one output row's packed weights: y[m] for each m.
// A accumulators per row: two hide the FMA latency for few rows; eight rows need their registers for one each.
template <int M, int A>
void out_row(const float* x, int64_t x_stride, const uint8_t* w, const float* scales, const float* zero_scaled,
             const float* xsum, int64_t groups, int64_t k, int64_t group_size, float* y, int64_t y_stride,
             float bias) {
  __m256 total[M];
  float zero_term[M];
  for (int m = 0; m < M; ++m) {
    total[m] = _mm256_setzero_ps();
    zero_term[m] = 0.f;
  }
  const __m256i low_mask = _mm256_set1_epi32(0x0f);
  const int64_t halves_per_group = group_size / kHalf;
  for (int64_t g = 0; g < groups; ++g) {
    __m256 acc[M][A];
    for (int m = 0; m < M; ++m)
      for (int a = 0; a < A; ++a) acc[m][a] = _mm256_setzero_ps();
    for (int64_t h = g * halves_per_group; h < (g + 1) * halves_per_group; ++h) {
      const int64_t i = h * kHalf;
      __m256i lanes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (h / 2) * 32));
      if (h & 1) lanes = _mm256_srli_epi32(lanes, 16);  // nibbles 4..7: weights 32..63 of the block
      const __m256 w0 = _mm256_cvtepi32_ps(_mm256_and_si256(lanes, low_mask));
      const __m256 w1 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(lanes, 4), low_mask));
      const __m256 w2 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(lanes, 8), low_mask));
      const __m256 w3 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(lanes, 12), low_mask));
      for (int m = 0; m < M; ++m) {
        const float* xm = x + m * x_stride + i;
        acc[m][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xm), acc[m][0]);
        acc[m][1 % A] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xm + 8), acc[m][1 % A]);
        acc[m][0] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xm + 16), acc[m][0]);
        acc[m][1 % A] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xm + 24), acc[m][1 % A]);
      }
    }
    const __m256 s = _mm256_set1_ps(scales[g]);
    for (int m = 0; m < M; ++m) {
      total[m] = _mm256_fmadd_ps(s, A == 2 ? _mm256_add_ps(acc[m][0], acc[m][A - 1]) : acc[m][0], total[m]);
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
        const int64_t block = i / kBlock, r = i % kBlock;
        const uint8_t* lane = w + block * 32 + (r % 8) * 4;  // little-endian uint32 lane r % 8
        const uint32_t bits = lane[0] | (lane[1] << 8) | (lane[2] << 16) | (static_cast<uint32_t>(lane[3]) << 24);
        const float q = static_cast<float>((bits >> (4 * (r / 8))) & 0x0f);
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
          case 1: out_row<1, 2>(xb, x_stride, w, s, z, xs, groups, k, group_size, yb, n, b); break;
          case 2: out_row<2, 2>(xb, x_stride, w, s, z, xs, groups, k, group_size, yb, n, b); break;
          case 3: out_row<3, 2>(xb, x_stride, w, s, z, xs, groups, k, group_size, yb, n, b); break;
          case 4: out_row<4, 2>(xb, x_stride, w, s, z, xs, groups, k, group_size, yb, n, b); break;
          case 5: out_row<5, 1>(xb, x_stride, w, s, z, xs, groups, k, group_size, yb, n, b); break;
          case 6: out_row<6, 1>(xb, x_stride, w, s, z, xs, groups, k, group_size, yb, n, b); break;
          case 7: out_row<7, 1>(xb, x_stride, w, s, z, xs, groups, k, group_size, yb, n, b); break;
          default: out_row<8, 1>(xb, x_stride, w, s, z, xs, groups, k, group_size, yb, n, b); break;
        }
#else
        out_row_scalar(xb, x_stride, std::min<int64_t>(m - m0, kMaxRows), w, s, z, xs, groups, group_size, yb, n, b);
#endif
      }
    }
  });
  return y;
}
