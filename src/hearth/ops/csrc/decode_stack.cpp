// A decode step through every layer of a dense Llama-family model in one call (float32 activations, CPU).
//
// A decode layer is ~10 small kernels (two norms, four projections, RoPE + KV write, attention, SiLU x up). Run
// from Python each costs a module call, argument checks and a dispatch: on a 30-layer model at batch 1 that
// was ~4 ms of an 11 ms step. Here the same kernels the Python path calls (their output-range and work-item
// entry points: skinny_linear.h, paged_decode_attention.h) are chained in C++. The numerics are the Python
// path's exactly: the same kernels in the same order; SiLU x up is ATen's own silu and mul.
//
// The stack holds each layer's weights (views of the model's own tensors, nothing copied) and its KV pool
// tensors; `hearth.model.fused_decode` builds it, decides per step whether the step qualifies (decode rows
// only, one rank, this layer shape) and runs the rest of the model (embedding, final norm, head) itself.
#include "decode_stack.h"

#include "paged_decode_attention.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/silu.h>
#include <c10/core/InferenceMode.h>
#include <omp.h>

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <exception>
#include <utility>

std::tuple<at::Tensor, at::Tensor> rms_norm(at::Tensor x, at::Tensor weight, double eps,
                                            std::optional<at::Tensor> residual);
at::Tensor rotary_write_kv(at::Tensor qkv, at::Tensor cos, at::Tensor sin, int64_t heads, at::Tensor k_pool,
                           at::Tensor v_pool, at::Tensor slot_mapping);
at::Tensor rotary_write_kv_fp8(at::Tensor qkv, at::Tensor cos, at::Tensor sin, int64_t heads, at::Tensor k_pool,
                               at::Tensor v_pool, at::Tensor slot_mapping, at::Tensor k_scale, at::Tensor v_scale);

int64_t DecodeLinear::in_features() const { return kind == kInt4 ? a.size(1) * 2 : a.size(1); }

void DecodeLinear::bind() {
  const float* bias_ptr = bias.has_value() && bias->defined() ? bias->data_ptr<float>() : nullptr;
  const int64_t k = in_features();
  switch (kind) {
    case kInt4:
      int4_ = {a.data_ptr<uint8_t>(), b.data_ptr<float>(), c.data_ptr<float>(), bias_ptr, k, group_size,
               int8_activations};
      break;
    case kInt8:
      int8_ = {a.data_ptr<int8_t>(), b.data_ptr<float>(), bias_ptr, k, group_size, int8_activations};
      break;
    case kBf16:
      bf16_ = {reinterpret_cast<const uint16_t*>(a.data_ptr<at::BFloat16>()), bias_ptr, k};
      break;
  }
}

void DecodeLinear::run_range(const float* x, int64_t m, float* y, int64_t y_stride, int64_t begin,
                             int64_t end) const {
  if (end <= begin) return;
  const int64_t k = in_features();
  switch (kind) {
    case kInt4: {
      hearth::Int4WeightView view = int4_;
      view.int8_activations = int8_activations && m <= int8_activations_max_rows;  // as int4_linear chooses
      hearth::int4_linear_range(x, k, m, view, y, y_stride, begin, end);
      break;
    }
    case kInt8: {
      hearth::Int8WeightView view = int8_;
      view.int8_activations = int8_activations && m <= int8_activations_max_rows;
      hearth::int8_linear_range(x, k, m, view, y, y_stride, begin, end);
      break;
    }
    case kBf16:
      hearth::bf16_linear_range(x, k, m, bf16_, y, y_stride, begin, end);
      break;
  }
}

// The checks the kernels' tensor entry points make, once, so the per-thread ranges can skip them.
void check_linear(const DecodeLinear& linear, int64_t in_features, const char* name) {
  TORCH_CHECK(linear.in_features() == in_features, "decode stack: ", name, " takes ", linear.in_features(),
              " features, the layer gives it ", in_features);
  const int64_t n = linear.out_features();
  const bool has_bias = linear.bias.has_value() && linear.bias->defined();
  TORCH_CHECK(!has_bias || (linear.bias->scalar_type() == at::kFloat && linear.bias->is_contiguous() &&
                            linear.bias->numel() == n),
              "decode stack: ", name, "'s bias must be contiguous float32 [out]");
  TORCH_CHECK(linear.a.is_contiguous() && linear.a.dim() == 2, "decode stack: ", name, "'s weight must be contiguous");
  switch (linear.kind) {
    case DecodeLinear::kInt4: {
      const int64_t k = in_features, g = linear.group_size;
      TORCH_CHECK(linear.a.scalar_type() == at::kByte && g > 0 && g % 32 == 0 && k % g == 0 && k % 64 == 0,
                  "decode stack: ", name, ": INT4 needs uint8 nibbles, in a multiple of 64 and of the group size");
      for (const at::Tensor* t : {&linear.b, &linear.c})
        TORCH_CHECK(t->defined() && t->scalar_type() == at::kFloat && t->is_contiguous() && t->size(0) == n &&
                        t->size(1) == k / g,
                    "decode stack: ", name, ": INT4 scales and zeros must be contiguous float32 [out, groups]");
      break;
    }
    case DecodeLinear::kInt8: {
      const int64_t k = in_features, g = linear.group_size;
      TORCH_CHECK(linear.a.scalar_type() == at::kChar && g > 0 && g % 16 == 0 && k % g == 0,
                  "decode stack: ", name, ": INT8 needs int8 weights and a group size that is a multiple of 16");
      TORCH_CHECK(linear.b.defined() && linear.b.scalar_type() == at::kFloat && linear.b.is_contiguous() &&
                      linear.b.size(0) == n && linear.b.size(1) == k / g,
                  "decode stack: ", name, ": INT8 scales must be contiguous float32 [out, groups]");
      break;
    }
    case DecodeLinear::kBf16:
      TORCH_CHECK(linear.a.scalar_type() == at::kBFloat16, "decode stack: ", name, ": bf16 weights expected");
      break;
    default:
      TORCH_CHECK(false, "decode stack: ", name, ": unknown kind ", linear.kind);
  }
}

void DecodeStack::add_layer(DecodeLayer layer) {
  TORCH_CHECK(layer.k_pool.dim() == 3 && layer.k_pool.size(1) == layer.num_kv_heads &&
                  layer.k_pool.size(2) == layer.head_dim,
              "decode stack: the KV pool is not [slots, kv_heads, head_dim]");
  TORCH_CHECK(layer.k_scale.has_value() == layer.v_scale.has_value(), "decode stack: K and V scales go together");
  TORCH_CHECK(layer.k_pool.is_contiguous() && layer.v_pool.is_contiguous() && layer.k_pool.sizes() == layer.v_pool.sizes(),
              "decode stack: contiguous K and V pools of one shape");
  if (layer.k_scale.has_value()) {
    const at::Tensor& k_scale = *layer.k_scale;
    const at::Tensor& v_scale = *layer.v_scale;
    TORCH_CHECK(layer.k_pool.scalar_type() == at::kFloat8_e4m3fn && layer.v_pool.scalar_type() == at::kFloat8_e4m3fn &&
                    k_scale.scalar_type() == at::kFloat && v_scale.scalar_type() == at::kFloat &&
                    k_scale.is_contiguous() && v_scale.is_contiguous() && k_scale.numel() == layer.num_kv_heads &&
                    v_scale.numel() == layer.num_kv_heads,
                "decode stack: FP8 e4m3 pools with float32 [kv_heads] scales");
  } else {
    TORCH_CHECK(layer.k_pool.scalar_type() == at::kFloat && layer.v_pool.scalar_type() == at::kFloat,
                "decode stack: float32 pools, or FP8 ones with their scales");
  }
  const int64_t hidden = layer.input_norm.numel(), q_size = layer.num_heads * layer.head_dim;
  TORCH_CHECK(layer.input_norm.scalar_type() == at::kFloat && layer.post_norm.scalar_type() == at::kFloat &&
                  layer.input_norm.is_contiguous() && layer.post_norm.is_contiguous() &&
                  layer.post_norm.numel() == hidden,
              "decode stack: contiguous float32 norm weights");
  TORCH_CHECK(layer.num_heads % layer.num_kv_heads == 0, "decode stack: heads must be a multiple of KV heads");
  check_linear(layer.qkv, hidden, "qkv");
  TORCH_CHECK(layer.qkv.out_features() == (layer.num_heads + 2 * layer.num_kv_heads) * layer.head_dim,
              "decode stack: qkv's outputs are not the heads' q, k and v");
  check_linear(layer.o, q_size, "o");
  TORCH_CHECK(layer.o.out_features() == hidden, "decode stack: o must give the hidden size");
  check_linear(layer.gate_up, hidden, "gate_up");
  TORCH_CHECK(layer.gate_up.out_features() % 2 == 0, "decode stack: gate_up holds gate and up");
  check_linear(layer.down, layer.gate_up.out_features() / 2, "down");
  TORCH_CHECK(layer.down.out_features() == hidden, "decode stack: down must give the hidden size");
  TORCH_CHECK(layers_.empty() || (layers_[0].input_norm.numel() == hidden), "decode stack: one hidden size");
  TORCH_CHECK(layers_.empty() || (layers_[0].num_heads == layer.num_heads &&
                                  layers_[0].num_kv_heads == layer.num_kv_heads && layers_[0].head_dim == layer.head_dim),
              "decode stack: one attention shape (a step's attention split is planned once)");
  for (DecodeLinear* linear : {&layer.qkv, &layer.o, &layer.gate_up, &layer.down}) linear->bind();
  layers_.push_back(std::move(layer));
}

namespace {

// Threads meet between the stages of a step here. OpenMP's own barrier sleeps at once under
// OMP_WAIT_POLICY=PASSIVE (the core's setting before its bounded GOMP_SPINCOUNT), and a wake-up
// costs ~10-20 us: with ~8 parallel kernels a layer that was ~4 ms of a 30-layer batch-1 step. This one spins
// first (the stages are short and balanced, so the other thread is usually microseconds away), then sleeps on
// a futex. How long each thread spins adapts: a wait that ended while spinning keeps (or doubles) its budget,
// one that had to sleep halves it. With the cores to itself a step spins (one 256-token stream: 2.35 s against
// 3.3 s with a fixed short spin); with another busy process on a core the partner is often descheduled, and
// spinning for it would only burn the core it needs (8.5 s with a fixed long spin, 4.3 s adaptive or short).
class SpinBarrier {
 public:
  void reset(int parties) {
    parties_ = parties;
    waiting_.store(0);
  }
  // `spin_budget`: the calling thread's own, carried from wait to wait.
  void wait(int& spin_budget) {
    const int generation = generation_.load();
    if (waiting_.fetch_add(1) == parties_ - 1) {
      waiting_.store(0);
      generation_.fetch_add(1);
      // After the generation moved: a waiter that counted itself in before that gets woken; one counting
      // itself in after it sees the new generation before it sleeps (both sequentially consistent).
      if (sleepers_.load() > 0) futex(FUTEX_WAKE_PRIVATE, INT32_MAX);
      return;
    }
    for (int spins = 0; spins < spin_budget; ++spins) {
      if (generation_.load(std::memory_order_acquire) != generation) {
        spin_budget = std::min(kMaxSpins, spin_budget * 2);
        return;
      }
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
    }
    spin_budget = std::max(kMinSpins, spin_budget / 2);
    sleepers_.fetch_add(1);
    while (generation_.load() == generation) futex(FUTEX_WAIT_PRIVATE, generation);
    sleepers_.fetch_sub(1);
  }

  static constexpr int kMaxSpins = 2000, kMinSpins = 50;

 private:
  long futex(int op, int value) {
    static_assert(sizeof(std::atomic<int>) == sizeof(int), "a futex word is an int");
    return syscall(SYS_futex, reinterpret_cast<int*>(&generation_), op, value, nullptr, nullptr, 0);
  }

  int parties_ = 1;
  std::atomic<int> waiting_{0};
  std::atomic<int> generation_{0};
  std::atomic<int> sleepers_{0};
};

// [begin, end) of `n` for thread `t` of `threads`.
std::pair<int64_t, int64_t> even_share(int64_t n, int t, int threads) { return {n * t / threads, n * (t + 1) / threads}; }

// [begin, end) of `n` for thread `t` of `threads`, in multiples of 4 (the kernels' output tiles).
std::pair<int64_t, int64_t> share(int64_t n, int t, int threads) {
  const int64_t units = (n + 3) / 4;
  const int64_t begin = std::min(n, units * t / threads * 4), end = std::min(n, units * (t + 1) / threads * 4);
  return {begin, end};
}

}  // namespace

// The stages of a layer, each split among the threads where it is a product (outputs of a projection,
// sequences of attention) and run by thread 0 where it is small (norms, RoPE + KV write, SiLU x up), with a
// barrier after each. Slices of a projection's outputs are computed exactly as the whole call computes them
// (every output's sum is its own), so the step's numbers are the unsplit kernels'.
std::tuple<at::Tensor, at::Tensor> DecodeStack::forward(at::Tensor hidden, std::optional<at::Tensor> residual,
                                                        const at::Tensor& cos, const at::Tensor& sin,
                                                        const at::Tensor& slot_mapping, const at::Tensor& page_table,
                                                        const at::Tensor& seq_lens,
                                                        const at::Tensor& first_positions, int64_t page_size) const {
  TORCH_CHECK(!layers_.empty(), "decode stack: no layers");
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kFloat && hidden.is_contiguous(),
              "decode stack: hidden must be contiguous float32 [rows, hidden]");
  const int64_t rows = hidden.size(0);
  TORCH_CHECK(slot_mapping.numel() == rows && page_table.dim() == 2 && page_table.size(0) == rows &&
                  seq_lens.numel() == rows && first_positions.numel() == rows,
              "decode stack: one slot, page table row, length and first position per row");
  for (const at::Tensor* t : {&slot_mapping, &page_table, &seq_lens, &first_positions})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "decode stack: contiguous int64 step inputs");
  at::Tensor stream = residual.has_value() ? *residual : at::Tensor();
  const auto options = hidden.options();
  SpinBarrier barrier;
  std::exception_ptr failure;
  std::atomic<bool> failed{false};
  // Shared between the stages of a layer.
  at::Tensor normed, qkv, q, attended, projected, gate_up, activated;
  const int requested = std::max(1, at::get_num_threads());
  const bool inference_mode = c10::InferenceMode::is_enabled();
  // One split for every layer (the stack takes only models whose layers share their attention's shape).
  const hearth::DecodeAttentionSplit attention_split =
      hearth::decode_attention_split(seq_lens, first_positions, layers_[0].num_kv_heads, requested);
  std::vector<float> attention_partials(
      attention_split.partial_floats(rows, layers_[0].num_heads, layers_[0].head_dim));
#pragma omp parallel num_threads(requested)
  {
    // Autograd's modes are per thread: the team's threads take the caller's (the engine runs in inference
    // mode, and its tensors may only be written in place there).
    c10::InferenceMode guard(inference_mode);
    const int t = omp_get_thread_num();
#pragma omp single
    barrier.reset(omp_get_num_threads());
    const int threads = omp_get_num_threads();
    int spin_budget = SpinBarrier::kMaxSpins;
    // Every thread passes every barrier, whatever failed: a thread that skipped one would leave the others
    // waiting forever. The first failure is kept and thrown after the region.
    auto stage = [&](bool all_threads, auto&& work) {
      if ((all_threads || t == 0) && !failed.load(std::memory_order_acquire)) {
        try {
          work();
        } catch (...) {
#pragma omp critical(hearth_decode_stack_failure)
          if (!failed.exchange(true)) failure = std::current_exception();
        }
      }
      barrier.wait(spin_budget);
    };
    for (const DecodeLayer& layer : layers_) {
      const int64_t qkv_size = (layer.num_heads + 2 * layer.num_kv_heads) * layer.head_dim;
      const int64_t q_size = layer.num_heads * layer.head_dim;
      const int64_t hidden_size = layer.input_norm.numel();
      stage(false, [&] {
        if (stream.defined()) {
          std::tie(normed, stream) = rms_norm(hidden, layer.input_norm, layer.eps, stream);
        } else {
          stream = hidden;
          normed = std::get<0>(rms_norm(hidden, layer.input_norm, layer.eps, std::nullopt));
        }
        qkv = at::empty({rows, qkv_size}, options);
        attended = at::empty({rows, layer.num_heads, layer.head_dim}, options);
        projected = at::empty({rows, hidden_size}, options);
      });
      stage(true, [&] {
        const auto [begin, end] = share(qkv_size, t, threads);
        layer.qkv.run_range(normed.data_ptr<float>(), rows, qkv.data_ptr<float>(), qkv_size, begin, end);
      });
      stage(false, [&] {
        q = layer.k_scale.has_value()
                ? rotary_write_kv_fp8(qkv, cos, sin, layer.num_heads, layer.k_pool, layer.v_pool, slot_mapping,
                                      *layer.k_scale, *layer.v_scale)
                : rotary_write_kv(qkv, cos, sin, layer.num_heads, layer.k_pool, layer.v_pool, slot_mapping);
      });
      stage(true, [&] {
        const auto [begin, end] = even_share(rows * attention_split.items(), t, threads);
        const at::Tensor* k_scale = layer.k_scale.has_value() ? &*layer.k_scale : nullptr;
        const at::Tensor* v_scale = layer.v_scale.has_value() ? &*layer.v_scale : nullptr;
        hearth::decode_attention_items(q, attended, attention_partials.data(), layer.k_pool, layer.v_pool, k_scale,
                                       v_scale, page_table, seq_lens, first_positions, page_size, layer.scale,
                                       attention_split, begin, end);
      });
      if (attention_split.key_chunks > 1) {
        stage(true, [&] {
          const auto [begin, end] = even_share(rows * layer.num_heads, t, threads);
          hearth::decode_attention_merge(attention_partials.data(), attended, attention_split, begin, end);
        });
      }
      stage(true, [&] {
        const auto [begin, end] = share(hidden_size, t, threads);
        layer.o.run_range(attended.data_ptr<float>(), rows, projected.data_ptr<float>(), hidden_size, begin, end);
      });
      stage(false, [&] {
        std::tie(normed, stream) = rms_norm(projected, layer.post_norm, layer.eps, stream);
        gate_up = at::empty({rows, layer.gate_up.out_features()}, options);
        hidden = at::empty({rows, hidden_size}, options);
      });
      stage(true, [&] {
        // Gate and up rows of the same intermediate features: each thread's half of both.
        const int64_t width = gate_up.size(1), intermediate = width / 2;
        const auto [begin, end] = share(intermediate, t, threads);
        const float* x = normed.data_ptr<float>();
        float* y = gate_up.data_ptr<float>();
        layer.gate_up.run_range(x, rows, y, width, begin, end);
        layer.gate_up.run_range(x, rows, y, width, intermediate + begin, intermediate + end);
      });
      stage(false, [&] {
        // As the Python MLP: silu into a fresh tensor, times up in place.
        const int64_t intermediate = gate_up.size(1) / 2;
        activated = at::silu(gate_up.narrow(1, 0, intermediate));
        activated.mul_(gate_up.narrow(1, intermediate, intermediate));
      });
      stage(true, [&] {
        const auto [begin, end] = share(hidden_size, t, threads);
        layer.down.run_range(activated.data_ptr<float>(), rows, hidden.data_ptr<float>(), hidden_size, begin, end);
      });
    }
  }
  if (failure) std::rethrow_exception(failure);
  return {hidden, stream};
}
