"""The fused mixture-of-experts op: every (token, chosen expert) pair of a batch through its expert's
gate/up and down projections, grouped by expert.

The pairs are sorted by expert, so each expert's tokens are one contiguous block of rows and the
expert runs as one GEMM per projection over that block (a grouped GEMM, one group per expert); the
weighted rows are then added back to their tokens with one `index_add_`. The Python loop is over
the experts that received tokens, never over tokens.

On CPU the per-expert `torch.mm` loop is the grouped GEMM: torch's own `grouped_mm` runs on CPU but
measured ~2x slower than this loop (float32 and bfloat16, 16 experts x 128 tokens, torch 2.13). On a
CUDA device of compute capability >= 9.0 in bfloat16, `torch._grouped_mm` (CUTLASS grouped GEMM) runs
each projection as one launch with the group offsets computed on the device: no host sync and no
Python loop over experts, which on a GPU costs two launches per expert per layer.

Expert parallelism: a rank holds experts `[first_expert, first_expert + num_local_experts)`; pairs
routed to other ranks' experts are dropped here (they contribute zero), and the caller sums the
ranks' outputs (`hearth.parallel.state.all_reduce_ep`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def fused_moe(
    hidden: torch.Tensor,
    gate_up_weights: torch.Tensor,
    down_weights: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    first_expert: int = 0,
    activation: Callable[[torch.Tensor], torch.Tensor] = F.silu,
    grouped: bool | None = None,
) -> torch.Tensor:
    """`sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden[t])` over this rank's experts.

    hidden `[tokens, hidden_size]`; gate_up_weights `[local_experts, 2 * intermediate, hidden_size]`
    (gate rows then up rows, as `nn.Linear` weights); down_weights `[local_experts, hidden_size,
    intermediate]`; topk_weights (any float dtype) and topk_ids (global expert ids) `[tokens, top_k]`.
    Returns `[tokens, hidden_size]` in hidden's dtype. `grouped`: one `torch._grouped_mm` per projection
    instead of the per-expert loop (None: where it is fast, see `grouped_mm_pays`).
    """
    num_tokens, hidden_size = hidden.shape
    num_local_experts = gate_up_weights.shape[0]
    intermediate = down_weights.shape[2]
    top_k = topk_ids.shape[1]
    out = torch.zeros_like(hidden)
    if num_tokens == 0:
        return out
    local_ids = topk_ids.reshape(-1) - first_expert
    pair_weights = topk_weights.reshape(-1)
    pair_tokens = torch.arange(num_tokens, device=hidden.device).repeat_interleave(top_k)
    local = (local_ids >= 0) & (local_ids < num_local_experts)
    # A CUDA graph capture cannot wait on this check; graphs are only captured where every expert is local.
    capturing = hidden.is_cuda and torch.cuda.is_current_stream_capturing()
    if not capturing and not bool(local.all()):  # some pairs go to other ranks' experts
        local_ids, pair_weights, pair_tokens = local_ids[local], pair_weights[local], pair_tokens[local]
        if local_ids.numel() == 0:
            return out
    order = torch.argsort(local_ids, stable=True)
    sorted_tokens = pair_tokens[order]
    sorted_weights = pair_weights[order]
    # Not bincount: on CUDA it reads the largest id back to the host, which a graph capture cannot do.
    counts = torch.zeros(num_local_experts, dtype=torch.long, device=hidden.device)
    counts.scatter_add_(0, local_ids, torch.ones_like(local_ids))
    rows = hidden.index_select(0, sorted_tokens)  # [pairs, hidden_size], grouped by expert
    if grouped if grouped is not None else grouped_mm_pays(hidden):
        group_ends = torch.cumsum(counts, 0).to(torch.int32)
        gate_up = torch._grouped_mm(rows, gate_up_weights.transpose(-2, -1), offs=group_ends)
        gate, up = gate_up.split(intermediate, dim=-1)
        expert_out = torch._grouped_mm(activation(gate) * up, down_weights.transpose(-2, -1), offs=group_ends)
    else:
        if capturing:  # before the host read below, which would break the capture with a CUDA error
            raise RuntimeError(
                "the per-expert MoE loop reads expert counts on the host: it cannot be captured"
            )
        expert_out = torch.empty_like(rows)
        start = 0
        for expert, count in enumerate(counts.tolist()):
            if count == 0:
                continue
            block = rows[start : start + count]
            gate_up = torch.mm(block, gate_up_weights[expert].t())
            gate, up = gate_up.split(intermediate, dim=-1)
            torch.mm(activation(gate) * up, down_weights[expert].t(), out=expert_out[start : start + count])
            start += count
    expert_out.mul_(sorted_weights.to(expert_out.dtype).unsqueeze(1))
    out.index_add_(0, sorted_tokens, expert_out)
    return out


def grouped_mm_pays(hidden: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` is the faster grouped GEMM for these activations (see the module doc)."""
    return (
        hidden.is_cuda
        and hidden.dtype == torch.bfloat16
        and hasattr(torch, "_grouped_mm")
        and torch.cuda.get_device_capability(hidden.device) >= (9, 0)
    )


def moe_reference(
    hidden: torch.Tensor,
    gate_up_weights: torch.Tensor,
    down_weights: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    first_expert: int = 0,
    activation: Callable[[torch.Tensor], torch.Tensor] = F.silu,
) -> torch.Tensor:
    """The same sum, token by token and expert by expert (the tests' oracle; slow)."""
    intermediate = down_weights.shape[2]
    out = torch.zeros_like(hidden)
    for token in range(hidden.shape[0]):
        for k in range(topk_ids.shape[1]):
            expert = int(topk_ids[token, k]) - first_expert
            if not 0 <= expert < gate_up_weights.shape[0]:
                continue
            gate_up = gate_up_weights[expert] @ hidden[token]
            act = activation(gate_up[:intermediate]) * gate_up[intermediate:]
            out[token] += topk_weights[token, k].to(hidden.dtype) * (down_weights[expert] @ act)
    return out
