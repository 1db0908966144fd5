// SiLU(gate) x up over a fused gate_up projection of a bf16 model's rows, in one pass: torch's path is a SiLU into a
// fresh [rows, intermediate] tensor and a multiply over it (two passes, one allocation). Rounded where torch rounds:
// the SiLU (computed in float32) to bf16, then the product.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "bf16_bits.h"
#include "vector_exp.h"

namespace {

using hearth::bf16_to_float;
using hearth::float_to_bf16;

void silu_mul_row(const uint16_t* gate, const uint16_t* up, int64_t size, uint16_t* out) {
  int64_t i = 0;
#if defined(HEARTH_BF16_VECTORS)
  using hearth::load_bf16x16;
  const __m512 one = _mm512_set1_ps(1.0f);
  for (; i + 16 <= size; i += 16) {
    const __m512 g = load_bf16x16(gate + i);
    // e^-|g| keeps the exponential's argument non-positive; g >= 0: 1 / (1 + e^-g), g < 0: e^g / (1 + e^g).
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
    const __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 sigmoid = _mm512_mask_div_ps(_mm512_div_ps(one, _mm512_add_ps(one, e)), negative, e,
                                              _mm512_add_ps(one, e));
    const __m512 silu = _mm512_mul_ps(g, sigmoid);
    hearth::store_bf16x16(out + i, _mm512_mul_ps(hearth::round_to_bf16x16(silu), load_bf16x16(up + i)));
  }
#endif
  for (; i < size; ++i) {
    const float g = bf16_to_float(gate[i]);
    const float silu = hearth::round_to_bf16(g / (1.0f + std::exp(-g)));
    out[i] = float_to_bf16(silu * bf16_to_float(up[i]));
  }
}

}  // namespace

at::Tensor silu_and_mul_bf16(at::Tensor gate_up) {  // [rows, 2 * intermediate] bf16, contiguous
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == at::kBFloat16 && gate_up.is_contiguous() &&
                  gate_up.size(1) % 2 == 0,
              "silu_and_mul_bf16: a contiguous bf16 [rows, 2 * intermediate] tensor");
  const int64_t rows = gate_up.size(0), size = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, size}, gate_up.options());
  const uint16_t* in = reinterpret_cast<const uint16_t*>(gate_up.data_ptr());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, rows, std::max<int64_t>(1, 8192 / std::max<int64_t>(size, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) silu_mul_row(in + r * 2 * size, in + r * 2 * size + size, size, dst + r * size);
  });
  return out;
}
