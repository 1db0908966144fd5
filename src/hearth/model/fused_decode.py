"""Decode steps of a dense Llama-family model through every layer in one compiled call (CPU, float32).

On a deep model a decode step's Python, not its arithmetic, was the cost: SmolLM2-135M (30 layers) spent
~4 ms of an 11 ms batch-1 step in module calls and dispatch around ~10 small kernels a layer. The compiled
`DecodeStack` (`hearth/ops/csrc/decode_stack.cpp`) chains the same kernels the Python layers call, in the
same order, so its tokens are the Python path's exactly.

`DecodeStackRunner.build` decides once per model whether every layer has the shape the stack runs: the base
`DecoderLayer`/`Attention`/`MLP` (no q/k norm, RoPE on every layer over the whole head, SiLU), one rank and
one pipeline stage, and projections the skinny kernels take (INT4, INT8, or a float32 weight with an exact
bf16 copy). `run` then decides per step: decode rows only (no prefill chunk, no verify rows), every row
sampled, one attention kind for every layer, the compiled decode attention chosen for the step, and at most
`BF16_MAX_ROWS` rows where a projection is bf16 (where the Python path's bf16 linears also take their
kernel, so both paths compute alike; INT4 and INT8 take theirs at every row count). Anything else runs the
Python layers. `HEARTH_FUSED_DECODE=0` turns it off (to compare).

In one step the threads run one OpenMP region: each layer's projections split by output features and its
attention by work items (KV heads, and at batch < threads key chunks, merged in a stage of their own), small stages (norms, RoPE + KV write, SiLU x up) on one thread, a barrier between
stages. Under `OMP_WAIT_POLICY=PASSIVE` (the serving core's setting until session 10) a kernel per region woke the threads ~270 times a
step on a 30-layer model, about half of a batch-1 step.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from hearth.model.layers import MLP, Attention, DecoderLayer, Linear, RMSNorm
from hearth.model.quantization.unquantized import UnquantizedLinearMethod
from hearth.ops.attention import AttentionContext
from hearth.ops.attention.torch_ref import TorchMetadata
from hearth.ops.cpu_kernels import decode_stack_classes
from hearth.ops.int4 import INT4_MAX_ROWS, Int4Weights
from hearth.ops.int8 import INT8_ACTIVATION_MAX_ROWS, Int8Weights
from hearth.ops.linear import BF16_MAX_ROWS

INT4, INT8, BF16 = 0, 1, 2  # `DecodeLinear::Kind`


def enabled() -> bool:
    return os.environ.get("HEARTH_FUSED_DECODE", "1") != "0"


def _decode_linear(layer: Linear, linear_class: Any) -> tuple[int, Any] | None:
    """(kind, the kernel view) of one projection, or None where the stack has no kernel for its weights."""
    if getattr(layer, "int4_parts", None) is not None or layer.tp.size != 1:
        return None
    int4 = getattr(layer, "int4", None)
    if isinstance(int4, Int4Weights):
        if not int4.kernel_ok or int4.perm is not None:
            return None
        return INT4, linear_class(
            INT4,
            int4.packed,
            int4.scales,
            int4.zero_scaled,
            group_size=int4.group_size,
            int8_activations=int4.int8_activations,
            int8_activations_max_rows=INT4_MAX_ROWS,
            bias=layer.bias,
        )
    int8 = getattr(layer, "int8", None)
    if isinstance(int8, Int8Weights):
        if int8.group_size % 16:
            return None
        return INT8, linear_class(
            INT8,
            int8.q,
            int8.scales,
            group_size=int8.group_size,
            int8_activations=int8.int8_activations,
            int8_activations_max_rows=INT8_ACTIVATION_MAX_ROWS,
            bias=layer.bias,
        )
    prepared = getattr(layer, "prepared", None)
    if (
        isinstance(layer.quant_method, UnquantizedLinearMethod)
        and prepared is not None
        and prepared.bf16 is not None
    ):
        return BF16, linear_class(BF16, prepared.bf16, bias=layer.bias)
    return None


def _plain_norm(norm: nn.Module) -> bool:
    return (
        type(norm)._norm is RMSNorm._norm
        and type(norm).add_and_norm is RMSNorm.add_and_norm
        and isinstance(norm.weight, torch.Tensor)
        and norm.weight.dtype == torch.float32
        and norm.weight.is_contiguous()
    )


def _plain_layer(layer: nn.Module) -> bool:
    if not isinstance(layer, DecoderLayer) or type(layer).forward is not DecoderLayer.forward:
        return False
    attn, mlp = layer.self_attn, layer.mlp
    return (
        type(attn).forward is Attention.forward
        and type(attn)._rotate_and_write_kv is Attention._rotate_and_write_kv
        and attn.q_norm is None
        and attn.use_rope
        and type(mlp).forward is MLP.forward
        and mlp.is_silu
        and _plain_norm(layer.input_layernorm)
        and _plain_norm(layer.post_attention_layernorm)
    )


class DecodeStackRunner:
    """A model's `DecodeStack` and the pool it was built over."""

    def __init__(
        self, stack: Any, kv_pool: Any, k_pool_ptr: int, head_dim: int, max_rows: int | None
    ) -> None:
        self.stack = stack
        self.max_rows = max_rows
        self.kv_pool = kv_pool
        self.k_pool_ptr = k_pool_ptr  # a pool rebuilt under the same object is another pool
        self.head_dim = head_dim

    @classmethod
    def build(cls, model: nn.Module, kv_pool: Any) -> DecodeStackRunner | None:
        """The stack over `model` (a `DecoderModel`) and `kv_pool`, or None where some layer does not qualify."""
        classes = decode_stack_classes()
        if classes is None:
            return None
        stack_class, linear_class = classes
        if model.first_layer != 0 or not (model.is_first_stage and model.is_last_stage):
            return None
        stack = stack_class()
        # One attention shape for every layer: the stack plans a step's attention split once (`add_layer`
        # refuses another shape, so a model with several falls back here instead).
        shapes: set[tuple[int, int, int]] = set()
        kinds: set[int] = set()
        for index in range(model.first_layer, model.end_layer):
            layer = model.layers[index]
            if not _plain_layer(layer):
                return None
            attn, mlp = layer.self_attn, layer.mlp
            shapes.add((attn.num_heads, attn.num_kv_heads, attn.head_dim))
            if len(shapes) != 1:
                return None
            linears = [
                _decode_linear(part, linear_class)
                for part in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            ]
            if any(linear is None for linear in linears):
                return None
            kinds.update(kind for kind, _ in linears)
            k_pool, v_pool = kv_pool.layer(attn.layer_index)
            scales = kv_pool.kv_scales(attn.layer_index)
            if k_pool.dtype != torch.float32 and scales is None:
                return None
            if k_pool.dim() != 3 or not (k_pool.is_contiguous() and v_pool.is_contiguous()):
                return None
            stack.add_layer(
                layer.input_layernorm.weight.detach(),
                layer.post_attention_layernorm.weight.detach(),
                layer.input_layernorm.eps,
                *(linear for _, linear in linears),
                k_pool,
                v_pool,
                None if scales is None else scales[0],
                None if scales is None else scales[1],
                attn.num_heads,
                attn.num_kv_heads,
                attn.head_dim,
                attn.scale,
            )
        if not shapes:
            return None
        max_rows = BF16_MAX_ROWS if BF16 in kinds else None
        head_dim = shapes.pop()[2]
        return cls(stack, kv_pool, kv_pool.layer(0)[0].data_ptr(), head_dim, max_rows)

    def applies(
        self, ctx: AttentionContext, hidden: torch.Tensor, cos: torch.Tensor, num_sampled: int
    ) -> bool:
        md = ctx.metadata
        rows = hidden.shape[0]
        return (
            cos.shape[-1] * 2 == self.head_dim  # rotary over the whole head (the kernel's only form)
            and ctx.kv_pool is self.kv_pool
            and self.kv_pool.layer(0)[0].data_ptr() == self.k_pool_ptr
            and hidden.dtype == torch.float32
            and (self.max_rows is None or rows <= self.max_rows)
            and num_sampled == rows
            and isinstance(md, TorchMetadata)
            and md.per_layer is None
            and md.decode_kernel is not None
            and md.num_decode_rows == rows
            and getattr(md, "token_rows", None) is None
        )

    def run(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        md = ctx.metadata
        assert isinstance(md, TorchMetadata) and md.decode_first_positions is not None
        n = md.num_decode_rows
        return self.stack.forward(
            hidden.contiguous(),
            None,
            cos,
            sin,
            md.slot_mapping,
            md.page_table[:n],
            md.seq_lens[:n],
            md.decode_first_positions,
            md.page_size,
        )
