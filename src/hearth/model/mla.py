"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2) over the latent KV pool.

Per token the cache holds `kv_lora_rank + qk_rope_head_dim` values, whatever the number of heads: the
normalised KV latent `c` and the rotated key part `k_pe` that all heads share. Keys and values of head h
are up-projections of `c` (`kv_b_proj` = [W_UK; W_UV] per head), which are never materialised: the
projections are absorbed instead,

    score(h, j) = q_nope_h . (W_UK_h c_j) + q_pe_h . k_pe_j = (W_UK_h^T q_nope_h) . c_j + q_pe_h . k_pe_j
    out_h       = sum_j p(h, j) W_UV_h c_j                   = W_UV_h (sum_j p(h, j) c_j)

so attention is multi-query attention with one KV "head" of `kv_lora_rank + qk_rope_head_dim` dims,
queries `[W_UK_h^T q_nope_h ; q_pe_h]`, and the latent serving as both keys and values (the first
`kv_lora_rank` dims of the output are `sum_j p c_j`, the rest is dropped). That runs through any
attention backend unchanged (on CPU the compiled paged decode kernel), for decode rows and prefill
chunks alike. Prefill would be cheaper with the up-projected (non-absorbed) form for long prompts; this
is the correctness-first path.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from hearth.model.config import ModelConfig
from hearth.model.layers import ColumnParallelLinear, LayerOptions, Linear, RMSNorm, RowParallelLinear
from hearth.model.rotary import apply_rotary
from hearth.ops.attention import AttentionContext

# transformers builds the two latent norms with RMSNorm's default eps, not the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def yarn_softmax_scale(config: ModelConfig, head_dim: int) -> float:
    """DeepSeek's softmax scale: 1/sqrt(head_dim), times mscale(factor, mscale_all_dim)^2 under yarn."""
    scale = head_dim**-0.5
    params = config.rope_scaling
    mscale_all_dim = params.get("mscale_all_dim") or 0
    if params.get("rope_type", "default") != "default" and mscale_all_dim:
        factor = float(params["factor"])
        mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= mscale * mscale
    return scale


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """DeepSeek checkpoints lay rotary dims out in pairs (x0, x1), (x2, x3)...; rotate-half wants the
    evens then the odds. Queries and keys both get it, so their dot products are unchanged."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class MLAttention(nn.Module):
    """Parameter names are the checkpoint's (`q_proj` or `q_a_proj`/`q_a_layernorm`/`q_b_proj`,
    `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj`). Heads split across tensor-parallel
    ranks; the latent projections are replicated (every rank caches the whole latent)."""

    def __init__(self, config: ModelConfig, layer_index: int, options: LayerOptions | None = None) -> None:
        super().__init__()
        options = options or LayerOptions()
        mla = config.mla
        assert mla is not None
        self.layer_index = layer_index
        self.mla = mla
        hidden, bias = config.hidden_size, config.attention_bias
        heads = config.num_heads
        if mla.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, heads * mla.qk_head_dim, False, options)
        else:
            self.q_a_proj = Linear(hidden, mla.q_lora_rank, bias, options)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(mla.q_lora_rank, heads * mla.qk_head_dim, False, options)
        self.kv_a_proj_with_mqa = Linear(hidden, mla.latent_dim, bias, options)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(
            mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim), False, options
        )
        self.o_proj = RowParallelLinear(heads * mla.v_head_dim, hidden, bias, options)
        self.num_heads = self.kv_b_proj.output_size_per_rank // (mla.qk_nope_head_dim + mla.v_head_dim)
        self.scale = yarn_softmax_scale(config, mla.qk_head_dim)
        # [heads, qk_nope_head_dim, kv_lora_rank] and [heads, v_head_dim, kv_lora_rank], from kv_b_proj
        # once it is loaded (`absorb_weights`).
        self.w_uk: torch.Tensor | None = None
        self.w_uv: torch.Tensor | None = None

    def absorb_weights(self) -> None:
        """Split `kv_b_proj`'s weight into the per-head W_UK and W_UV that the absorbed products use.
        Called after loading and before the linear layers are processed (which may drop their weights)."""
        mla = self.mla
        weight = self.kv_b_proj.weight.detach().view(
            self.num_heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank
        )
        self.w_uk = weight[:, : mla.qk_nope_head_dim].contiguous()
        self.w_uv = weight[:, mla.qk_nope_head_dim :].contiguous()

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        ctx: AttentionContext,
    ) -> torch.Tensor:
        assert self.w_uk is not None and self.w_uv is not None, "absorb_weights() runs after loading"
        mla = self.mla
        num_tokens = hidden.shape[0]
        if mla.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q_nope, q_pe = q.view(num_tokens, self.num_heads, mla.qk_head_dim).split(
            [mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1
        )
        latent, k_pe = self.kv_a_proj_with_mqa(hidden).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        k_pe = k_pe.unsqueeze(1)
        if mla.rope_interleave:
            q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
        q_pe, k_pe = apply_rotary(q_pe, cos, sin), apply_rotary(k_pe, cos, sin)
        ctx.kv_pool.store(
            self.layer_index, ctx.metadata.slot_mapping, torch.cat((latent.unsqueeze(1), k_pe), dim=-1), None
        )
        # W_UK_h^T q_nope_h for every head: [heads, tokens, nope] @ [heads, nope, rank].
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)
        query = torch.cat((q_latent, q_pe), dim=-1).contiguous()
        attended = ctx.backend.forward(
            self.layer_index, query, None, None, ctx.kv_pool, ctx.metadata, self.scale
        )
        # W_UV_h (sum_j p c_j): [heads, tokens, rank] @ [heads, rank, v].
        out = torch.bmm(attended[..., : mla.kv_lora_rank].transpose(0, 1), self.w_uv.transpose(1, 2))
        return self.o_proj(out.transpose(0, 1).reshape(num_tokens, self.num_heads * mla.v_head_dim))
