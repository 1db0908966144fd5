"""A plain-PyTorch EAGLE-3 head over whole sequences: what `scripts/train_eagle3.py` trains, and the
reference the tests hold Hearth's paged head (`hearth.model.eagle3`) to. Same parameter names as the
published checkpoint layout, so `state_dict()` is what gets saved.

Training-time test (EAGLE-3, section 3.2): step 0 runs every position p on (token p+1, fc(target aux at p));
step s > 0 runs position p on (token p+1+s, the step s-1 output at p), at rotary position p+s, attending to
the step-0 keys of positions <= p and to its own chain's keys of steps 1..s at p: exactly what position
p+s sees at inference when p was the last position with target states. Step s at p predicts token p+2+s.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama rotary (rotate-half), `x` `[tokens, heads, head_dim]`."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, half, dtype=torch.float32) * 2 / x.shape[-1]))
    angles = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = angles.cos()[:, None, :].to(x.dtype), angles.sin()[:, None, :].to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class _Norm(nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.q_proj = nn.Linear(2 * hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)


class _MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)


class _MidLayer(nn.Module):
    def __init__(self, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.self_attn = _Attention(hidden, heads, kv_heads, head_dim)
        self.mlp = _MLP(hidden, intermediate)
        self.input_layernorm = _Norm(hidden)
        self.hidden_norm = _Norm(hidden)
        self.post_attention_layernorm = _Norm(hidden)


class ReferenceEagle3Head(nn.Module):
    """`config`: the head's config.json dict (Llama fields, `draft_vocab_size`, `target_hidden_size`)."""

    def __init__(self, config: dict[str, Any], embed_tokens: torch.Tensor) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        self.heads = config["num_attention_heads"]
        self.kv_heads = config.get("num_key_value_heads") or self.heads
        self.head_dim = config.get("head_dim") or hidden // self.heads
        self.eps = float(config.get("rms_norm_eps", 1e-6))
        rope = config.get("rope_parameters") or {}
        self.theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
        self.norm_before_residual = bool(config.get("norm_before_residual", False))
        target_hidden = config.get("target_hidden_size") or hidden
        draft_vocab = config.get("draft_vocab_size") or config["vocab_size"]
        self.fc = nn.Linear(3 * target_hidden, hidden, bias=False)
        self.midlayer = _MidLayer(
            hidden, config["intermediate_size"], self.heads, self.kv_heads, self.head_dim
        )
        self.norm = _Norm(hidden)
        self.lm_head = nn.Linear(hidden, draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config["vocab_size"], dtype=torch.bool))
        self.embed = embed_tokens  # the target's, frozen: not a parameter of the head

    def set_vocab(self, draft_to_target: torch.Tensor) -> None:
        """`draft_to_target[d]`: the target id of draft id d (stored as offsets, as published)."""
        self.d2t.copy_(draft_to_target - torch.arange(len(draft_to_target)))
        self.t2d.zero_()
        self.t2d[draft_to_target] = True

    def _qkv(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):  # type: ignore[no-untyped-def]
        layer = self.midlayer
        normed = _rms(hidden, layer.hidden_norm.weight, self.eps)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat(
            [_rms(F.embedding(tokens, self.embed), layer.input_layernorm.weight, self.eps), normed], -1
        )
        attn = layer.self_attn
        n = x.shape[0]
        q = _rotate(attn.q_proj(x).view(n, self.heads, self.head_dim), positions, self.theta)
        k = _rotate(attn.k_proj(x).view(n, self.kv_heads, self.head_dim), positions, self.theta)
        v = attn.v_proj(x).view(n, self.kv_heads, self.head_dim)
        repeat = self.heads // self.kv_heads
        return q, k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1), residual

    def _finish(self, attn_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        layer = self.midlayer
        x = layer.self_attn.o_proj(attn_out.reshape(attn_out.shape[0], -1)) + residual
        mlp = layer.mlp
        h = _rms(x, layer.post_attention_layernorm.weight, self.eps)
        return mlp.down_proj(F.silu(mlp.gate_proj(h)) * mlp.up_proj(h)) + x

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Over the draft vocabulary."""
        return self.lm_head(_rms(out, self.norm.weight, self.eps))

    def forward(
        self, token_ids: torch.Tensor, aux: torch.Tensor, num_steps: int, rows: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """`aux` `[T, 3 * target_hidden]` the target's aux vectors at positions 0..T-1, `token_ids` the
        sequence (at least T long; tokens past its end read as 0). Returns the pre-norm outputs of steps
        0..num_steps-1: step 0 `[T, hidden]`, row p meant to predict token p+2; steps s > 0 for `rows` only
        (default: all), `[len(rows), hidden]`, meant to predict token p+2+s (training runs the chained steps
        on the answer's rows only: the prompt's rows matter as step-0 keys)."""
        length = aux.shape[0]
        positions = torch.arange(length)
        scale = 1.0 / math.sqrt(self.head_dim)
        padded = torch.cat([token_ids, token_ids.new_zeros(max(0, length + num_steps + 1 - len(token_ids)))])
        hidden = self.fc(aux)
        q, k0, v0, residual = self._qkv(padded[1 : 1 + length], hidden, positions)
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        scores = torch.einsum("thd,shd->hts", q, k0) * scale
        weights = scores.masked_fill(~causal, float("-inf")).float().softmax(dim=-1).to(q.dtype)
        hidden = self._finish(torch.einsum("hts,shd->thd", weights, v0), residual)
        outputs = [hidden]
        if num_steps == 1:
            return outputs
        rows = positions if rows is None else rows
        hidden = hidden[rows]
        context = causal[rows]  # each chained row sees the step-0 keys at positions <= its own
        chain_k: list[torch.Tensor] = []
        chain_v: list[torch.Tensor] = []
        for step in range(1, num_steps):
            q, k, v, residual = self._qkv(padded[rows + 1 + step], hidden, rows + step)
            chain_k.append(k)
            chain_v.append(v)
            # [heads, rows, T] over the step-0 keys, then [heads, rows, step] over the row's own chain.
            scores = (torch.einsum("thd,shd->hts", q, k0) * scale).masked_fill(~context, float("-inf"))
            diag = torch.stack([(q * ck).sum(-1) for ck in chain_k], dim=-1).transpose(0, 1) * scale
            weights = torch.cat([scores, diag], dim=-1).float().softmax(dim=-1).to(q.dtype)
            out = torch.einsum("hts,shd->thd", weights[..., :length], v0)
            for r, cv in enumerate(chain_v):
                out = out + weights[..., length + r].transpose(0, 1)[..., None] * cv
            hidden = self._finish(out, residual)
            outputs.append(hidden)
        return outputs

    @torch.no_grad()
    def propose(self, token_ids: list[int], aux: torch.Tensor, num_tokens: int) -> list[int]:
        """Greedy chain from the last position with target states (len(token_ids) - 2), target ids."""
        anchor = len(token_ids) - 2
        extended = list(token_ids)
        guesses: list[int] = []
        for step in range(num_tokens):
            outputs = self.forward(
                torch.tensor(extended), aux[: anchor + 1], step + 1, torch.tensor([anchor])
            )
            draft = int(self.logits(outputs[step][-1]).argmax())
            guess = draft + int(self.d2t[draft])
            guesses.append(guess)
            extended.append(guess)
        return guesses
