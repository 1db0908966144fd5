// INT4 and INT8 weights dequantized to a dense bfloat16 [out, in], for prompt chunks multiplied on bf16 tiles
// (oneDNN's AVX512-BF16 / AMX GEMM): one pass over the packed bytes, the products rounded once to bf16.
//
// Why per call rather than a bf16 copy kept at load: a copy costs 2 bytes a weight for as long as the server runs
// (4-8x the INT4 weights); the pass costs O(weights) against the GEMM's O(rows x weights), ~2-4% of the GEMM at a
// few hundred rows (docs/benchmarks.md).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cstdint>

#include "bf16_bits.h"

namespace {

using hearth::float_to_bf16;

// Output row o of an INT4 weight: packed blocks of 64 weights in 32 bytes (byte b: weight b low, b + 32 high).
void int4_row(const uint8_t* packed, const float* scales, const float* zero_scaled, int64_t in, int64_t group_size,
              uint16_t* dst) {
  for (int64_t block = 0; block < in / 64; ++block) {
    const uint8_t* bytes = packed + block * 32;
#if defined(HEARTH_BF16_VECTORS)
    for (int half = 0; half < 2; ++half) {
      for (int quarter = 0; quarter < 2; ++quarter) {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + quarter * 16));
        const __m128i nibbles = half == 0 ? _mm_and_si128(raw, _mm_set1_epi8(0x0f))
                                          : _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0f));
        const int64_t i = block * 64 + half * 32 + quarter * 16;
        const int64_t g = i / group_size;
        const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(nibbles));
        hearth::store_bf16x16(dst + i, _mm512_fmsub_ps(q, _mm512_set1_ps(scales[g]), _mm512_set1_ps(zero_scaled[g])));
      }
    }
#else
    for (int64_t b = 0; b < 32; ++b) {
      const int64_t lo = block * 64 + b, hi = lo + 32;
      dst[lo] = float_to_bf16(static_cast<float>(bytes[b] & 0x0f) * scales[lo / group_size] - zero_scaled[lo / group_size]);
      dst[hi] = float_to_bf16(static_cast<float>(bytes[b] >> 4) * scales[hi / group_size] - zero_scaled[hi / group_size]);
    }
#endif
  }
}

void int8_row(const int8_t* q, const float* scales, int64_t in, int64_t group_size, uint16_t* dst) {
  int64_t i = 0;
#if defined(HEARTH_BF16_VECTORS)
  for (; i + 16 <= in; i += 16) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i));
    const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw));
    hearth::store_bf16x16(dst + i, _mm512_mul_ps(v, _mm512_set1_ps(scales[i / group_size])));
  }
#endif
  for (; i < in; ++i) dst[i] = float_to_bf16(static_cast<float>(q[i]) * scales[i / group_size]);
}

}  // namespace

at::Tensor int4_dequantize_bf16(at::Tensor packed, at::Tensor scales, at::Tensor zero_scaled, int64_t group_size) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.is_contiguous(),
              "int4_dequantize_bf16: packed is contiguous uint8 [out, in / 2]");
  const int64_t out = packed.size(0), in = packed.size(1) * 2;
  TORCH_CHECK(in % 64 == 0 && group_size > 0 && group_size % 16 == 0 && in % group_size == 0,
              "int4_dequantize_bf16: blocks of 64 inputs, groups a multiple of 16 dividing them");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && zero_scaled.scalar_type() == at::kFloat &&
                  scales.is_contiguous() && zero_scaled.is_contiguous() && scales.numel() == out * (in / group_size) &&
                  zero_scaled.numel() == scales.numel(),
              "int4_dequantize_bf16: float32 scales and zero points [out, groups]");
  at::Tensor dense = at::empty({out, in}, packed.options().dtype(at::kBFloat16));
  const uint8_t* p = packed.data_ptr<uint8_t>();
  const float* s = scales.data_ptr<float>();
  const float* z = zero_scaled.data_ptr<float>();
  uint16_t* d = reinterpret_cast<uint16_t*>(dense.data_ptr());
  const int64_t groups = in / group_size;
  at::parallel_for(0, out, 16, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) int4_row(p + o * (in / 2), s + o * groups, z + o * groups, in, group_size, d + o * in);
  });
  return dense;
}

at::Tensor int8_dequantize_bf16(at::Tensor q, at::Tensor scales, int64_t group_size) {
  TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 2 && q.is_contiguous(),
              "int8_dequantize_bf16: q is contiguous int8 [out, in]");
  const int64_t out = q.size(0), in = q.size(1);
  TORCH_CHECK(group_size > 0 && group_size % 16 == 0 && in % group_size == 0,
              "int8_dequantize_bf16: groups a multiple of 16 dividing the inputs");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == out * (in / group_size),
              "int8_dequantize_bf16: float32 scales [out, groups]");
  at::Tensor dense = at::empty({out, in}, q.options().dtype(at::kBFloat16));
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* s = scales.data_ptr<float>();
  uint16_t* d = reinterpret_cast<uint16_t*>(dense.data_ptr());
  const int64_t groups = in / group_size;
  at::parallel_for(0, out, 16, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) int8_row(qp + o * in, s + o * groups, in, group_size, d + o * in);
  });
  return dense;
}
