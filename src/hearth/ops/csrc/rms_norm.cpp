// RMSNorm over float32 rows, optionally fused with the residual add that precedes it:
//   residual' = x + residual;  out = weight * residual' / sqrt(mean(residual'^2) + eps)
// A decoder layer's norms are ~8 small torch ops each (and the add one more); at decode batch
// sizes their dispatch costs more than their arithmetic, so one call does it all.
// ATen headers only: torch/extension.h (pybind, autograd) triples the compile time; bindings.cpp has it.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>

std::tuple<at::Tensor, at::Tensor> rms_norm(at::Tensor x, at::Tensor weight, double eps,
                                            std::optional<at::Tensor> residual) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "rms_norm: x must be a contiguous [rows, hidden] float32 tensor");
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
