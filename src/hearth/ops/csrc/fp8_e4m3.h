// FP8 e4m3fn <-> float32 for KV storage on CPUs without FP8 math.
#pragma once
#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace hearth {

constexpr float kFp8Max = 448.0f;

// Exact for every finite e4m3fn value: the 7 magnitude bits moved to float32's exponent/mantissa place
// make a float32 whose exponent is 120 too small (e4m3's bias is 7, float32's 127), and e4m3 subnormals
// land on float32 subnormals with the same factor; one multiply by 2^120 fixes both. Branch-free, so
// the loops over a key's bytes vectorize (AVX2), unlike a table lookup.
inline float fp8_e4m3_to_float(uint8_t byte) {
  const uint32_t bits = (static_cast<uint32_t>(byte & 0x80) << 24) | (static_cast<uint32_t>(byte & 0x7f) << 20);
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value * 1.329227995784916e36f;  // 2^120
}

// Saturating, round-to-nearest-even (c10's conversion, as torch's .to(float8_e4m3fn) after a clamp).
inline uint8_t float_to_fp8_e4m3(float value) {
  const float clamped = std::min(std::max(value, -kFp8Max), kFp8Max);
  return c10::Float8_e4m3fn(clamped).x;
}

}  // namespace hearth
