"""A draft model's greedy chain with as few torch ops as possible, for small batches on CPU.

On a small draft (the demo's: 2 layers, hidden 128) a forward through the engine's model code is per-op
overhead, not arithmetic: building a paged step input, the attention backend's `prepare`, module calls,
a KV write through the pool, ~0.9x a target decode step per drafted token. This runner uses the same
loaded weights (the draft `Worker`'s model, its linear layers' own fast paths) but keeps each request's
draft KV in contiguous per-layer tensors of its own (no pages, no metadata per chained step), and a
forward is ~45 ops: embedding, per layer norm / qkv / qk-norm / RoPE (one op pair for q and k together,
from precomputed full-width tables) / KV write / decode-kernel attention / o / norm / MLP, then the head and
an argmax.

Proposals need not match the engine's draft numerics bit for bit: any proposal is verified by the target,
so a draft only changes speed, never output. They are deterministic given the request's tokens.

Supported: Llama-family decoders of `hearth.model.decoder.CausalLM` with rotary over the whole head, SiLU
MLP, no sliding window, one rank. `LeanDraftRunner.build` returns None for anything else (the paged path
serves it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from hearth.ops.cpu_kernels import bf16_skinny_linear_kernel, paged_decode_attention_kernel, rms_norm_kernel

_INITIAL_CAPACITY = 512  # tokens; doubled as a request's context grows
# The draft sees a request's last this-many tokens at its first proposal, and everything after: on the demo
# model's tool calls the last 96 tokens (the user's request, the turn markers) predict as well as the whole
# 150-450 token prompt (6.16 vs 6.17 tokens a verified step at K=8, 16 held-out prompts), and the draft's
# catch-up over the whole prompt cost ~20 ms a request, a quarter of its decode time.
CONTEXT_WINDOW_TOKENS = 128
_SKINNY_MAX_ROWS = 16  # more rows (a prompt's catch-up feed) take the layer's own path (oneDNN)


@dataclass
class LeanSequence:
    """One request's draft KV: `k[layer][:length]`, `v[layer][:length]` hold `token_ids`, which are the
    request's tokens from `offset` on (at positions counted from there)."""

    k: list[torch.Tensor] = field(default_factory=list)  # per layer [capacity, kv_heads, head_dim]
    v: list[torch.Tensor] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    offset: int = -1  # first token of the request the draft sees; -1 until the first feed sets it

    @property
    def capacity(self) -> int:
        return self.k[0].shape[0] if self.k else 0


@dataclass
class _Layer:
    input_norm: torch.Tensor  # RMSNorm weights
    qkv: Callable[[torch.Tensor], torch.Tensor]
    qk_norm_weight: torch.Tensor | None  # [heads + kv_heads, head_dim]: q's norm weight per q head, then k's
    o: Callable[[torch.Tensor], torch.Tensor]
    post_norm: torch.Tensor
    gate_up: Callable[[torch.Tensor], torch.Tensor]
    down: Callable[[torch.Tensor], torch.Tensor]


def _direct_linear(module: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """The layer's product as one kernel call when it has an exact bf16 copy (a bf16 checkpoint) and no
    bias: no module call, no per-call path checks; else the layer itself."""
    prepared = getattr(module, "prepared", None)
    kernel = bf16_skinny_linear_kernel()
    if prepared is not None and prepared.bf16 is not None and kernel is not None and module.bias is None:
        weight, forward = prepared.bf16, module.forward
        return lambda x: kernel(x, weight, None) if x.shape[0] <= _SKINNY_MAX_ROWS else forward(x)
    return module.forward  # type: ignore[no-any-return]


class LeanDraftRunner:
    def __init__(self, model: Any, vocab_size: int, context_window: int = CONTEXT_WINDOW_TOKENS) -> None:
        config = model.config
        self.context_window = context_window
        self.vocab_size = vocab_size  # proposals stay within the target's sampled vocabulary
        decoder = model.model
        self.model = model
        self.num_layers = config.num_layers
        first = decoder.layers[0].self_attn
        self.num_heads = first.num_heads
        self.num_kv_heads = first.num_kv_heads
        self.head_dim = first.head_dim
        self.q_size = first.q_size
        self.kv_size = first.kv_size
        self.scale = first.scale
        self.eps = config.rms_norm_eps
        self.embed_weight = decoder.embed_tokens.weight.detach()
        self.intermediate = decoder.layers[0].mlp.intermediate_size
        self.layers: list[_Layer] = []
        for layer in decoder.layers:
            attn = layer.self_attn
            qk_weight = None
            if attn.q_norm is not None:
                qk_weight = torch.cat(
                    [
                        attn.q_norm.weight.detach().expand(self.num_heads, -1),
                        attn.k_norm.weight.detach().expand(self.num_kv_heads, -1),
                    ]
                ).contiguous()
            self.layers.append(
                _Layer(
                    layer.input_layernorm.weight.detach(),
                    _direct_linear(attn.qkv_proj),
                    qk_weight,
                    _direct_linear(attn.o_proj),
                    layer.post_attention_layernorm.weight.detach(),
                    _direct_linear(layer.mlp.gate_up_proj),
                    _direct_linear(layer.mlp.down_proj),
                )
            )
        self.final_norm_weight = decoder.norm.weight.detach()
        self._ones = torch.ones(self.head_dim, dtype=model.cos_sin.dtype)
        # Full-width RoPE tables: rotated = x * cos_full + swap_halves(x) * sin_signed (rotate-half RoPE).
        cos, sin = model.cos_sin.float().chunk(2, dim=-1)
        self.cos_full = torch.cat([cos, cos], dim=-1).contiguous()
        self.sin_signed = torch.cat([-sin, sin], dim=-1).contiguous()
        self.max_positions = self.cos_full.shape[0]
        rms = rms_norm_kernel()
        attention = paged_decode_attention_kernel()
        assert rms is not None and attention is not None  # `build` checked
        self._rms: Callable[..., Any] = rms
        self._attention: Callable[..., torch.Tensor] = attention
        self._zero_table = torch.zeros(self.max_positions, 1, dtype=torch.long)
        self._zero_firsts = torch.zeros(self.max_positions, dtype=torch.long)
        self.dtype = model.cos_sin.dtype

    @staticmethod
    def kernels_ready() -> bool:
        """The compiled CPU kernels the chain is made of are loaded (they build in the background)."""
        return (
            rms_norm_kernel() is not None
            and paged_decode_attention_kernel() is not None
            and bf16_skinny_linear_kernel() is not None
        )

    @classmethod
    def build(
        cls, model: Any, vocab_size: int, context_window: int = CONTEXT_WINDOW_TOKENS
    ) -> LeanDraftRunner | None:
        """The runner for `model`, or None where it is not supported (see the module docstring) or the
        kernels are not loaded yet (`kernels_ready`)."""
        from hearth.model.decoder import CausalLM
        from hearth.model.layers import DecoderLayer

        config = getattr(model, "config", None)
        if not isinstance(model, CausalLM) or config is None:
            return None
        decoder = model.model
        if (
            not decoder.is_first_stage
            or not decoder.is_last_stage
            or config.sliding_window is not None
            or config.hidden_act != "silu"
            or model.cos_sin.device.type != "cpu"
            or model.cos_sin.shape[-1] != config.head_dim  # rotary over the whole head
            or any(type(layer) is not DecoderLayer for layer in decoder.layers)
            or decoder.layers[0].self_attn.qkv_proj.tp.size != 1
            or model.cos_sin.dtype != torch.float32
            or decoder.embed_tokens.weight.dtype != torch.float32
            or not cls.kernels_ready()
        ):
            return None
        return cls(model, vocab_size, context_window)

    def new_sequence(self) -> LeanSequence:
        return LeanSequence()

    def _ensure_capacity(self, sequence: LeanSequence, length: int) -> None:
        if length <= sequence.capacity:
            return
        capacity = max(_INITIAL_CAPACITY, sequence.capacity)
        while capacity < length:
            capacity *= 2
        capacity = min(capacity, self.max_positions)
        shape = (capacity, self.num_kv_heads, self.head_dim)
        held = len(sequence.token_ids)
        for index in range(self.num_layers):
            k, v = torch.empty(shape, dtype=self.dtype), torch.empty(shape, dtype=self.dtype)
            if held:
                k[:held].copy_(sequence.k[index][:held])
                v[:held].copy_(sequence.v[index][:held])
            if index < len(sequence.k):
                sequence.k[index], sequence.v[index] = k, v
            else:
                sequence.k.append(k)
                sequence.v.append(v)

    @torch.inference_mode()
    def propose(self, sequence: LeanSequence, token_ids: list[int], num_tokens: int) -> list[int]:
        """Up to `num_tokens` greedy draft tokens after `token_ids`; `sequence` is kept in step (its KV past
        the first token that differs from `token_ids` is dropped, the rest fed in one forward)."""
        if sequence.offset < 0:
            sequence.offset = max(0, len(token_ids) - self.context_window)
        offset = sequence.offset
        held = sequence.token_ids
        limit = min(
            len(held), len(token_ids) - offset - 1
        )  # the last token is always fed: its logits propose
        keep = 0
        while keep < limit and held[keep] == token_ids[offset + keep]:
            keep += 1
        del held[keep:]
        room = self.max_positions - (len(token_ids) - offset)
        num_tokens = min(num_tokens, room)
        if num_tokens <= 0:
            return []
        self._ensure_capacity(sequence, len(token_ids) - offset + num_tokens)
        feed = token_ids[offset + keep :]
        proposals: list[int] = []
        while len(proposals) < num_tokens:
            token = self._forward(sequence, feed)
            proposals.append(token)
            feed = [token]
        # The last proposal is not fed; the KV holds everything before it.
        return proposals

    def _forward(self, sequence: LeanSequence, feed: list[int]) -> int:
        start = len(sequence.token_ids)
        end = start + len(feed)
        count = len(feed)
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        qk_heads, qk_size = heads + kv_heads, self.q_size + self.kv_size
        rms, eps = self._rms, self.eps
        hidden = self.embed_weight[feed[0]].view(1, -1) if count == 1 else self.embed_weight[feed]
        cos, sin = self.cos_full[start:end, None, :], self.sin_signed[start:end, None, :]
        # Attention through the paged decode kernel over the contiguous cache seen as one page of `capacity`
        # slots: query i attends to keys [0, start + i] (causal within the feed, everything before visible).
        capacity = sequence.capacity
        table = self._zero_table[:count]
        lens = torch.arange(start + 1, end + 1) if count > 1 else torch.tensor([end])
        firsts = self._zero_firsts[:count]
        residual = None
        for index, layer in enumerate(self.layers):
            if residual is None:
                residual = hidden
                x = rms(hidden, layer.input_norm, eps)[0]
            else:
                x, residual = rms(hidden, layer.input_norm, eps, residual)
            qkv = layer.qkv(x)
            qk = qkv[:, :qk_size].reshape(count * qk_heads, dim)
            if layer.qk_norm_weight is not None:
                qk = rms(qk, self._ones, eps)[0].view(count, qk_heads, dim).mul_(layer.qk_norm_weight)
            else:
                qk = qk.view(count, qk_heads, dim)
            swapped = qk.view(count, qk_heads, 2, dim // 2).flip(2).view(count, qk_heads, dim)
            qk = torch.addcmul(qk * cos, swapped, sin)
            k_cache, v_cache = sequence.k[index], sequence.v[index]
            k_cache[start:end].copy_(qk[:, heads:])
            v_cache[start:end].copy_(qkv[:, qk_size:].view(count, kv_heads, dim))
            attended = self._attention(
                qk[:, :heads].contiguous(), k_cache, v_cache, table, lens, firsts, capacity, self.scale
            )
            x, residual = rms(layer.o(attended.view(count, self.q_size)), layer.post_norm, eps, residual)
            gate_up = layer.gate_up(x)
            hidden = layer.down(F.silu(gate_up[:, : self.intermediate]).mul_(gate_up[:, self.intermediate :]))
        last = rms(hidden[-1:], self.final_norm_weight, eps, residual[-1:].contiguous())[0]
        sequence.token_ids.extend(feed)
        return int(self.model._lm_head(last)[0, : self.vocab_size].argmax())
