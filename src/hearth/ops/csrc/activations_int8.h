// Activations rounded to int8 per (row, group), for the integer dot products of the W4A8 and W8A8 kernels.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

// Activations rounded to int8 per (row, group): q = round(x / s), s = max|x| / 127 over the group.
struct QuantizedRows {
  std::vector<int8_t> q;       // [rows, k]
  std::vector<float> scale;    // [rows, groups]
  std::vector<float> sum;      // [rows, groups]: s * sum(q), the zero-point term's activation sum
};

inline QuantizedRows quantize_rows(const float* x, int64_t x_stride, int64_t m, int64_t k, int64_t group_size) {
  const int64_t groups = k / group_size;
  QuantizedRows out{std::vector<int8_t>(m * k), std::vector<float>(m * groups), std::vector<float>(m * groups)};
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      const float* xg = x + r * x_stride + g * group_size;
      int8_t* qg = out.q.data() + r * k + g * group_size;
      float amax = 0.f;
      for (int64_t i = 0; i < group_size; ++i) amax = std::max(amax, std::fabs(xg[i]));
      const float s = amax / 127.f;
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      int32_t total = 0;
      for (int64_t i = 0; i < group_size; ++i) {
        const int32_t v = static_cast<int32_t>(std::nearbyint(xg[i] * inv));
        qg[i] = static_cast<int8_t>(std::clamp(v, -127, 127));
        total += qg[i];
      }
      out.scale[r * groups + g] = s;
      out.sum[r * groups + g] = s * static_cast<float>(total);
    }
  return out;
}

}  // namespace
