// The skinny linear kernels over a range of output features, on raw pointers: what a caller that splits one
// projection among its own threads (decode_stack.cpp) runs per thread, with no tensor made per call. Each
// writes y[row * y_stride + o] for o in [begin, end) and every row, exactly as the whole call computes them.
#pragma once

#include <cstdint>

namespace hearth {

struct Int4WeightView {
  const uint8_t* packed;      // [out, in / 2] (int4_skinny_linear.cpp's layout)
  const float* scales;        // [out, in / group_size]
  const float* zero_scaled;   // [out, in / group_size]
  const float* bias;          // [out] or null
  int64_t k, group_size;
  bool int8_activations;
};

struct Int8WeightView {
  const int8_t* q;        // [out, in]
  const float* scales;    // [out, in / group_size]
  const float* bias;      // [out] or null
  int64_t k, group_size;
  bool int8_activations;  // W8A8 where the CPU has AVX-512 VNNI
};

struct Bf16WeightView {
  const uint16_t* weight;  // [out, in] bfloat16 bits
  const float* bias;       // [out] or null
  int64_t k;
};

void int4_linear_range(const float* x, int64_t x_stride, int64_t m, const Int4WeightView& w, float* y,
                       int64_t y_stride, int64_t begin, int64_t end);
void int8_linear_range(const float* x, int64_t x_stride, int64_t m, const Int8WeightView& w, float* y,
                       int64_t y_stride, int64_t begin, int64_t end);
void bf16_linear_range(const float* x, int64_t x_stride, int64_t m, const Bf16WeightView& w, float* y,
                       int64_t y_stride, int64_t begin, int64_t end);

}  // namespace hearth
