"""What each decoder layer costs per step, for splitting layers into pipeline stages (`split_layers`).

A pipeline runs at the pace of its slowest stage, so stages must take equal *time*, not hold equal
parameters. Parameters mislead in two ways that matter for the models the seeds serve:
- A routed-expert layer (DeepSeek-V3, Kimi K2: 256-384 experts, 8 per token) holds ~30x the parameters
  of a dense one but reads only the experts its tokens chose: at batch 1, 8 of 256.
- Time per parameter depends on how many tokens share the weight read: a one-row GEMV is bound by memory,
  a 64-row GEMM much less so per token. Experts see few tokens each, dense layers the whole batch.

So the cost model is: time(layer) = sum over its weight groups of params x seconds-per-param at the
number of tokens that group sees, with seconds-per-param measured once at start on this device and
dtype (`calibrate`: the model's linear op on one 8M-parameter matrix at 4 batch sizes, ~0.3 s on 2 idle
CPU threads) and interpolated between the measured batch
sizes. Routed experts: E x (1 - (1 - k/E)^T) of them expected to be touched by T tokens, each seeing
T k / touched tokens. The embedding (a lookup: T rows read) and the LM head (`[vocab, hidden]` for the
sampled rows, all of them in decode) ride on the first and last stage. Attention over the KV cache
costs the same in every layer of a model, so it moves no boundary and is left out.

Everything but `calibrate` and `layer_weights` is plain Python: the split is tested in milliseconds.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from dataclasses import dataclass

import torch

from hearth.model.config import ModelConfig

CALIBRATION_BATCHES = (1, 8, 32, 128)
CALIBRATION_SHAPE = (4096, 2048)  # out, in: 8M parameters, past any cache on a CPU and small on a GPU


@dataclass(frozen=True)
class LayerWeights:
    """A decoder layer's parameters by how many tokens read them: every token (`dense_params`: attention,
    a dense MLP, shared experts, the router) or the tokens routed to each expert (`expert_params`, all
    `num_experts` of them together)."""

    dense_params: int
    expert_params: int = 0
    num_experts: int = 0
    top_k: int = 0


@dataclass(frozen=True)
class LinearTiming:
    """Measured seconds per weight parameter of a linear layer, at each batch size in `batches`."""

    batches: tuple[int, ...]
    seconds_per_param: tuple[float, ...]

    def per_param(self, tokens: float) -> float:
        """Interpolated linearly between measured batches; past the last one, growing with the batch
        (compute-bound); below the first, the first's (one row is the floor of a weight read)."""
        batches, values = self.batches, self.seconds_per_param
        if tokens <= batches[0]:
            return values[0]
        if tokens >= batches[-1]:
            return values[-1] * tokens / batches[-1]
        i = bisect_left(batches, tokens)
        t = (tokens - batches[i - 1]) / (batches[i] - batches[i - 1])
        return values[i - 1] + t * (values[i] - values[i - 1])


def calibrate(dtype: torch.dtype, device: torch.device, repeats: int = 2) -> LinearTiming:
    """Times `F.linear` on one `CALIBRATION_SHAPE` weight at each of `CALIBRATION_BATCHES` (best of `repeats`)."""
    out_features, in_features = CALIBRATION_SHAPE
    weight = torch.randn(out_features, in_features, dtype=dtype, device=device)
    if device.type == "cpu":  # the layouts and paths the model's linear layers run (prepacked, GEMV)
        from hearth.ops.linear import linear, prepare_linear_weights

        prepared = prepare_linear_weights(weight, gemv_layout=True)

        def run(x: torch.Tensor) -> None:
            linear(x, prepared, None)
    else:

        def run(x: torch.Tensor) -> None:
            torch.nn.functional.linear(x, weight)

    per_param = []
    for batch in CALIBRATION_BATCHES:
        x = torch.randn(batch, in_features, dtype=dtype, device=device)
        best = float("inf")
        for _ in range(repeats + 1):  # the first run warms up (allocations, kernel choice)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            run(x)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - start)
        per_param.append(best / weight.numel())
    # Time per parameter never falls with more rows; a noisy machine can say otherwise.
    for i in range(1, len(per_param)):
        per_param[i] = max(per_param[i], per_param[i - 1])
    return LinearTiming(CALIBRATION_BATCHES, tuple(per_param))


def layer_weights(config: ModelConfig) -> list[LayerWeights]:
    """Each decoder layer's weights, counted on the meta device (no memory, any architecture)."""
    from hearth.model.layers import LayerOptions
    from hearth.model.registry import get_model_class

    layer_class = get_model_class(config.architecture).layer_class
    moe = config.moe
    weights = []
    with torch.device("meta"):
        for index in range(config.num_layers):
            layer = layer_class(config, index, LayerOptions())
            dense = experts = 0
            for name, param in layer.named_parameters():
                if name.startswith("mlp.experts."):
                    experts += param.numel()
                else:
                    dense += param.numel()
            if experts and moe is not None:
                weights.append(LayerWeights(dense, experts, moe.num_experts, moe.top_k))
            else:
                weights.append(LayerWeights(dense))
    return weights


def layer_seconds(weights: LayerWeights, timing: LinearTiming, tokens: int) -> float:
    seconds = weights.dense_params * timing.per_param(tokens)
    if weights.expert_params:
        num_experts, top_k = weights.num_experts, weights.top_k
        touched = num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)
        per_expert = weights.expert_params / num_experts
        seconds += touched * per_expert * timing.per_param(tokens * top_k / touched)
    return seconds


@dataclass(frozen=True)
class StageCosts:
    """The model's costs for one step of `tokens` tokens: per layer, and what the first stage (embedding)
    and the last (final norm + LM head) add."""

    layer_s: tuple[float, ...]
    first_extra_s: float
    last_extra_s: float


def step_costs(
    weights: list[LayerWeights], timing: LinearTiming, tokens: int, hidden_size: int, vocab_size: int
) -> StageCosts:
    return StageCosts(
        layer_s=tuple(layer_seconds(w, timing, tokens) for w in weights),
        first_extra_s=tokens * hidden_size * timing.per_param(1),  # a lookup reads T rows
        last_extra_s=vocab_size * hidden_size * timing.per_param(tokens),
    )


def stage_seconds(costs: StageCosts, stages: list[range]) -> list[float]:
    """Estimated seconds per step of each stage."""
    seconds = [sum(costs.layer_s[i] for i in stage) for stage in stages]
    seconds[0] += costs.first_extra_s
    seconds[-1] += costs.last_extra_s
    return seconds
