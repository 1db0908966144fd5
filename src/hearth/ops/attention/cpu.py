"""The CPU backend: the torch reference, with decode rows through the compiled paged decode kernel.

The kernel (`hearth.ops.cpu_kernels`, float32 queries; a float32 pool, or FP8 with per-head scales) reads keys and values in place from
their pages; until it is built, or for other dtypes, decode rows take the torch path. The choice is
made once per step in `prepare`, so every layer of a step runs the same code.

Short multi-token rows (`token_rows`): a speculative verify row (the last known token + K drafts) is K+1
queries at consecutive positions, causal within the row. Query i of a row ending at context length S with
L queries attends to keys [0, S - L + 1 + i): exactly a decode query with that context length over the
row's pages. So a step whose rows all have at most `MAX_KERNEL_ROW_TOKENS` queries (decode rows and verify
rows, the steady state of speculative decoding) runs as one decode-kernel call per layer over every query,
each with its row's page table and its own context length (a per-query table built once per step),
reading the pages in place. The prefill path it replaces gathers each row's pages into contiguous tensors
and builds a causal mask per row (in `prepare` and per layer), ~1.35x a decode step on the demo model.

Longer rows (prompt chunks) go through the compiled prefill kernel (`csrc/prefill_attention.cpp`): flash-style
tiles over the chunk's pages read in place, causal and sliding-window masks applied by position, bf16 queries on
AVX512-BF16 and float32 ones on AVX-512, over float32, bf16 or FP8 pools; under bf16 prefill math
(`hearth.ops.prefill_math`) float32 queries take the bf16 tiles. Chunked local attention (Llama 4), head dims that
are not a multiple of 16, other ISAs and devices keep the torch path (SDPA over the gathered pages).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hearth.ops.attention.backend import AttentionKind, AttentionMetadata, AttentionStepInput, PagedKVCache
from hearth.ops.attention.torch_ref import PrefillChunk, TorchMetadata, TorchRefBackend
from hearth.ops.cpu_kernels import (
    paged_decode_attention_bf16_kernel,
    paged_decode_attention_fp8_kernel,
    paged_decode_attention_kernel,
    prefill_attention_kernel,
)
from hearth.ops.fp8 import is_fp8
from hearth.ops.prefill_math import bf16_rows


def _bf16_decode(kernel: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """The bf16-pool kernel as the float32 one is called: it takes float32 queries and returns float32."""

    def decode(q: torch.Tensor, *args: object) -> torch.Tensor:
        return kernel(q.float(), *args).to(torch.bfloat16)

    return decode


# A row with more queries than this is a prefill chunk: a query at a time (the kernel) would lose to SDPA's
# matmuls over the gathered pages. Verify rows carry 1 + K queries, K being at most ~8 in practice.
MAX_KERNEL_ROW_TOKENS = 16


@dataclass
class TokenRows:
    """One decode-kernel query per token of the step: its row's pages, its context length, its first key."""

    page_table: torch.Tensor  # long [num_tokens, page_table_width], contiguous
    seq_lens: torch.Tensor  # long [num_tokens]
    first_positions: torch.Tensor  # long [num_tokens]


@dataclass
class CpuMetadata(TorchMetadata):
    token_rows: TokenRows | None = None  # set when every row of the step goes through the decode kernel


class CpuBackend(TorchRefBackend):
    name = "cpu"
    # Multi-token rows through the decode kernel (`token_rows`); off only to A/B it (scripts/time_verify_row.py).
    verify_rows_kernel: bool = True

    def _kernel(self) -> Callable[..., object] | None:
        if self.device.type != "cpu":
            return None
        if self.dtype == torch.bfloat16 and self.kv_dtype == torch.bfloat16:
            # A bf16 model (CPUs with bf16 math): without this, decode gathers every row's pages and
            # masks them, over half of a bf16 decode step on Sapphire Rapids (issue 11).
            kernel = paged_decode_attention_bf16_kernel()
            return _bf16_decode(kernel) if kernel is not None else None  # type: ignore[arg-type]
        if self.dtype != torch.float32:
            return None
        if self.kv_dtype == torch.float32:
            return paged_decode_attention_kernel()
        if is_fp8(self.kv_dtype):
            return paged_decode_attention_fp8_kernel()
        return None

    def _uses_decode_kernel(self) -> bool:
        return self._kernel() is not None

    def _prefill(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        kv_scales: tuple[torch.Tensor, torch.Tensor] | None,
        chunk: PrefillChunk,
        md: TorchMetadata,
        scale: float,
    ) -> torch.Tensor:
        kernel = prefill_attention_kernel(q.dtype) if q.device.type == "cpu" else None
        if (
            kernel is None
            or chunk.kind.chunk_size is not None
            or q.shape[-1] % 16
            or k_pool.shape[-1] != q.shape[-1]
            or v_pool.shape != k_pool.shape
            or q.shape[1] % k_pool.shape[1]
        ):
            return super()._prefill(q, k_pool, v_pool, kv_scales, chunk, md, scale)
        k_scale, v_scale = kv_scales if kv_scales is not None else (None, None)
        pages, context_len, window = chunk.page_ids, chunk.context_len, chunk.kind.sliding_window or 0
        if bf16_rows(q) and (bf16_kernel := prefill_attention_kernel(torch.bfloat16)) is not None:
            # bf16 prefill math: bf16 tiles over the float32 (or FP8) pool, converted as it is packed.
            q_bf16 = q.to(torch.bfloat16)
            attended = bf16_kernel(
                q_bf16, k_pool, v_pool, k_scale, v_scale, pages, context_len, md.page_size, window, scale
            )
            return attended.float()
        return kernel(q, k_pool, v_pool, k_scale, v_scale, pages, context_len, md.page_size, window, scale)

    def _prepare_kind(self, step_input: AttentionStepInput, kind: AttentionKind) -> TorchMetadata:
        if step_input.num_decode_rows < len(step_input.seq_lens) and self.verify_rows_kernel:
            md_rows = self._prepare_token_rows(step_input, kind)
            if md_rows is not None:
                return md_rows
        md = super()._prepare_kind(step_input, kind)
        md.decode_kernel = self._kernel() if md.decode_mask is None else None
        return md

    def _prepare_token_rows(self, step: AttentionStepInput, kind: AttentionKind) -> CpuMetadata | None:
        """Per-query decode metadata when every row is short (see the module docstring); None otherwise."""
        kernel = self._kernel()
        starts = step.query_start_loc
        query_lens = [starts[r + 1] - starts[r] for r in range(len(step.seq_lens))]
        if kernel is None or max(query_lens) > MAX_KERNEL_ROW_TOKENS:
            return None
        common = self._common_metadata(step)
        md = CpuMetadata(**vars(common))
        md.decode_kernel = kernel
        lens: list[int] = []
        for end, count in zip(step.seq_lens, query_lens, strict=True):
            lens.extend(range(end - count + 1, end + 1))
        seq_lens = torch.tensor(lens, dtype=torch.long, device=self.device)
        width = md.page_table_width
        table = md.page_table[:, :width].repeat_interleave(
            torch.tensor(query_lens, dtype=torch.long, device=self.device), dim=0, output_size=len(lens)
        )
        firsts = kind.first_positions(seq_lens.clone())
        md.token_rows = TokenRows(table, seq_lens, firsts)
        return md

    def forward(
        self,
        layer_index: int,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        kv_pool: PagedKVCache,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if isinstance(metadata, TorchMetadata) and metadata.per_layer is not None:
            metadata = metadata.per_layer[layer_index]
        rows = metadata.token_rows if isinstance(metadata, CpuMetadata) else None
        if rows is None:
            return super().forward(layer_index, q, k, v, kv_pool, metadata, scale)
        assert isinstance(metadata, CpuMetadata) and metadata.decode_kernel is not None
        if k is not None and v is not None:
            kv_pool.store(layer_index, metadata.slot_mapping, k, v)
        k_pool, v_pool = kv_pool.layer(layer_index)
        return self._call_kernel(
            metadata.decode_kernel,
            q,
            k_pool,
            v_pool,
            kv_pool.kv_scales(layer_index),
            rows.page_table,
            rows.seq_lens,
            rows.first_positions,
            metadata.page_size,
            scale,
        )

    @staticmethod
    def _call_kernel(
        kernel: Callable[..., torch.Tensor],
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        kv_scales: tuple[torch.Tensor, torch.Tensor] | None,
        page_table: torch.Tensor,
        seq_lens: torch.Tensor,
        first_positions: torch.Tensor,
        page_size: int,
        scale: float,
    ) -> torch.Tensor:
        if kv_scales is not None:
            return kernel(
                q.contiguous(),
                k_pool,
                v_pool,
                *kv_scales,
                page_table,
                seq_lens,
                first_positions,
                page_size,
                scale,
            )
        return kernel(q.contiguous(), k_pool, v_pool, page_table, seq_lens, first_positions, page_size, scale)

    def _decode(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        md: TorchMetadata,
        scale: float,
        kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        kernel = md.decode_kernel
        if kernel is None:
            return super()._decode(q, k_pool, v_pool, md, scale, kv_scales)
        n = md.num_decode_rows
        # The whole-width rows of the page table buffer: contiguous, and the kernel reads only the
        # pages a row's context covers.
        return self._call_kernel(
            kernel,
            q,
            k_pool,
            v_pool,
            kv_scales,
            md.page_table[:n],
            md.seq_lens[:n],
            md.decode_first_positions,
            md.page_size,
            scale,
        )
