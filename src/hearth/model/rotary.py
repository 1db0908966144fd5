"""Rotary position embeddings: the frequency schedules Llama/Qwen/Mistral checkpoints ship, as one cos/sin table.

Positions index a precomputed table, so a batch of requests at unrelated positions costs one gather.
"""

from __future__ import annotations

import math

import torch

from hearth.model.config import ModelConfig


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    factor = params["factor"]
    low_freq_factor = params.get("low_freq_factor", 1.0)
    high_freq_factor = params.get("high_freq_factor", 4.0)
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(
    base: float, dim: int, params: dict, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    original_max = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position_embeddings / original_max

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        if params.get("mscale") and params.get("mscale_all_dim"):
            attention_factor = mscale(factor, params["mscale"]) / mscale(factor, params["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, float(attention_factor)


def build_cos_sin_table(config: ModelConfig, max_positions: int) -> torch.Tensor:
    """float32 `[max_positions, rotary_size]`: cos in the first half, sin in the second (both already scaled)."""
    dim = config.rotary_size
    base = config.rope_theta
    params = config.rope_scaling
    rope_type = params.get("rope_type", "default")
    positions = torch.arange(max_positions, dtype=torch.float32)
    attention_factor = 1.0
    inv_freq = _default_inv_freq(base, dim)
    if rope_type == "linear":
        inv_freq = inv_freq / params["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, params)
    elif rope_type == "yarn":
        inv_freq, attention_factor = _yarn_inv_freq(base, dim, params, config.max_position_embeddings)
    freqs = torch.outer(positions, inv_freq)
    if rope_type == "dynamic" and max_positions > config.max_position_embeddings:
        # Dynamic NTK: within the trained length the plain schedule; beyond it, each position uses the base
        # that transformers would pick for a sequence ending there.
        factor = params.get("factor", 1.0)
        trained = config.max_position_embeddings
        seq_lens = positions[trained:] + 1
        scaled_base = base * ((factor * seq_lens / trained) - (factor - 1)) ** (dim / (dim - 2))
        exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
        long_inv_freq = 1.0 / scaled_base[:, None] ** exponents[None, :]
        freqs[trained:] = positions[trained:, None] * long_inv_freq
    return torch.cat([freqs.cos() * attention_factor, freqs.sin() * attention_factor], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on `x[tokens, heads, head_dim]` with `cos/sin[tokens, head_dim/2]`."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
