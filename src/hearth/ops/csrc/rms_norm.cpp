// RMSNorm over float32 rows, optionally fused with the residual add that precedes it:
//   residual' = x + residual;  out = weight * residual' / sqrt(mean(residual'^2) + eps)
// A decoder layer's norms are ~8 small torch ops each (and the add one more); at decode batch
// sizes their dispatch costs more than their arithmetic, so one call does it all.
// ATen headers only: torch/extension.h (pybind, autograd) triples the compile time; bindings.cpp has it.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <optional>

#include "bf16_bits.h"
#include <tuple>

namespace {

#if defined(HEARTH_BF16_VECTORS)
using hearth::load_bf16x16;
using hearth::round_to_bf16x16;
using hearth::store_bf16x16;
#endif

// bf16 rows (a bf16 model, issue 11), rounded where the torch path rounds: the residual sum and the
// normalized row are bf16 tensors there, the statistics float32 (as transformers' LlamaRMSNorm does).
std::tuple<at::Tensor, at::Tensor> rms_norm_bf16(const at::Tensor& x, const at::Tensor& weight, float eps,
                                                 const std::optional<at::Tensor>& residual, bool add) {
  using bf16 = c10::BFloat16;
  const int64_t n = x.size(0), h = x.size(1);
  at::Tensor out = at::empty_like(x);
  at::Tensor summed = add ? at::empty_like(x) : x;
  const bf16* x_ptr = x.data_ptr<bf16>();
  const bf16* r_ptr = add ? residual->data_ptr<bf16>() : nullptr;
  const bf16* w_ptr = weight.data_ptr<bf16>();
  bf16* s_ptr = summed.data_ptr<bf16>();
  bf16* o_ptr = out.data_ptr<bf16>();
  at::parallel_for(0, n, std::max<int64_t>(1, 16384 / std::max<int64_t>(h, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const bf16* xr = x_ptr + row * h;
      bf16* sr = s_ptr + row * h;
      float sum_sq = 0.f;
      int64_t i = 0;
#if defined(HEARTH_BF16_VECTORS)
      // 16 lanes at a time, rounded to bf16 where the scalar loop rounds (vcvtneps2bf16: to nearest even).
      __m512 squares = _mm512_setzero_ps();
      for (; i + 16 <= h; i += 16) {
        __m512 v = load_bf16x16(xr + i);
        if (add) {
          v = round_to_bf16x16(_mm512_add_ps(v, load_bf16x16(r_ptr + row * h + i)));
          store_bf16x16(sr + i, v);
        }
        squares = _mm512_fmadd_ps(v, v, squares);
      }
      sum_sq = _mm512_reduce_add_ps(squares);
#endif
      if (add) {
        const bf16* rr = r_ptr + row * h;
        for (int64_t j = i; j < h; ++j) {
          const bf16 v = bf16(static_cast<float>(xr[j]) + static_cast<float>(rr[j]));
          sr[j] = v;
          const float f = static_cast<float>(v);
          sum_sq += f * f;
        }
      } else {
        for (int64_t j = i; j < h; ++j) sum_sq += static_cast<float>(xr[j]) * static_cast<float>(xr[j]);
      }
      const float scale = 1.f / std::sqrt(sum_sq / static_cast<float>(h) + eps);
      bf16* orow = o_ptr + row * h;
      int64_t k = 0;
#if defined(HEARTH_BF16_VECTORS)
      const __m512 vscale = _mm512_set1_ps(scale);
      for (; k + 16 <= h; k += 16) {
        const __m512 normalized = round_to_bf16x16(_mm512_mul_ps(load_bf16x16(sr + k), vscale));
        store_bf16x16(orow + k, _mm512_mul_ps(load_bf16x16(w_ptr + k), normalized));
      }
#endif
      for (; k < h; ++k) {
        const bf16 normalized = bf16(static_cast<float>(sr[k]) * scale);
        orow[k] = bf16(static_cast<float>(w_ptr[k]) * static_cast<float>(normalized));
      }
    }
  });
  return {out, summed};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> rms_norm(at::Tensor x, at::Tensor weight, double eps,
                                            std::optional<at::Tensor> residual) {
  if (x.scalar_type() == at::kBFloat16) {
    const bool add_bf16 = residual.has_value() && residual->defined();
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() &&
                    weight.numel() == x.size(1),
                "rms_norm: bf16 x must be contiguous [rows, hidden] with a contiguous bf16 [hidden] weight");
    TORCH_CHECK(!add_bf16 || (residual->scalar_type() == at::kBFloat16 && residual->is_contiguous() &&
                              residual->sizes() == x.sizes()),
                "rms_norm: residual must be a contiguous bf16 tensor shaped like x");
    return rms_norm_bf16(x, weight, static_cast<float>(eps), residual, add_bf16);
  }
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "rms_norm: x must be a contiguous [rows, hidden] float32 or bfloat16 tensor");
  const int64_t n = x.size(0), h = x.size(1);
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == h,
              "rms_norm: weight must be a contiguous float32 [hidden]");
  const bool add = residual.has_value() && residual->defined();
  if (add) {
    TORCH_CHECK(residual->scalar_type() == at::kFloat && residual->is_contiguous() && residual->sizes() == x.sizes(),
                "rms_norm: residual must be a contiguous float32 tensor shaped like x");
  }
  at::Tensor out = at::empty_like(x);
  at::Tensor summed = add ? at::empty_like(x) : x;
  const float* x_ptr = x.data_ptr<float>();
  const float* r_ptr = add ? residual->data_ptr<float>() : nullptr;
  const float* w_ptr = weight.data_ptr<float>();
  float* s_ptr = summed.data_ptr<float>();
  float* o_ptr = out.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, n, std::max<int64_t>(1, 16384 / std::max<int64_t>(h, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float* xr = x_ptr + row * h;
      float* sr = s_ptr + row * h;
      float sum_sq = 0.f;
      if (add) {
        const float* rr = r_ptr + row * h;
        for (int64_t i = 0; i < h; ++i) {
          const float v = xr[i] + rr[i];
          sr[i] = v;
          sum_sq += v * v;
        }
      } else {
        for (int64_t i = 0; i < h; ++i) sum_sq += xr[i] * xr[i];
      }
      const float scale = 1.f / std::sqrt(sum_sq / static_cast<float>(h) + feps);
      float* orow = o_ptr + row * h;
      for (int64_t i = 0; i < h; ++i) orow[i] = w_ptr[i] * (sr[i] * scale);
    }
  });
  return {out, summed};
}
