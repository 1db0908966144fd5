// bf16 as the 16 high bits of a float32, for the kernels that read and write bf16 tensors: scalar conversions and,
// with AVX512-BF16, 16 lanes at a time. Rounding is to nearest, ties to even, as torch's conversion rounds (and
// `vcvtneps2bf16`); a NaN stays a NaN.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define HEARTH_BF16_VECTORS 1
#endif

namespace hearth {

inline float bf16_to_float(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7f800000u) == 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | ((bits & 0xffff) ? 0x40 : 0));
  return static_cast<uint16_t>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

// The float32 value a bf16 tensor holds after an op whose float32 result is `f` (torch's bf16 ops round each one).
inline float round_to_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

#if defined(HEARTH_BF16_VECTORS)
inline __m512 load_bf16x16(const void* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

inline void store_bf16x16(void* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
}

inline __m512 round_to_bf16x16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}
#endif

}  // namespace hearth
