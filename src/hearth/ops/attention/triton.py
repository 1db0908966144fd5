"""Paged attention with Triton kernels (`hearth.ops.triton.attention`): the GPU default.

Every row shape goes through one kernel that reads the pool in place; a step of decode rows only with a
long context takes the split-K decode kernel instead, so a small batch still fills the device. The
row lengths the kernels need for their grids are taken from the host lists in `prepare`, once per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hearth.ops.attention.backend import AttentionBackend, AttentionMetadata, AttentionStepInput, PagedKVCache
from hearth.ops.triton.attention import paged_attention, paged_decode

# Contexts at least this long in an all-decode step are split across programs (split-K).
SPLIT_K_MIN_CONTEXT_TOKENS = 512


# Programs per decode launch a captured graph aims at: splits = this / (rows x KV heads), 1..16.
GRAPH_DECODE_PROGRAMS = 1024


@dataclass
class TritonMetadata(AttentionMetadata):
    max_query_len: int = 0
    max_seq_len: int = 0
    per_row_splits: bool = False  # captured decode: each row cuts its own context into splits on the device


class TritonBackend(AttentionBackend):
    name = "triton"

    supports_decode_graphs = True

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        kinds = self.layer_kinds or (self.default_kind,)
        if any(kind.chunk_size is not None for kind in kinds):
            raise ValueError(
                "chunked local attention runs on the cpu and torch_ref backends "
                "(HEARTH_ATTENTION_BACKEND=torch_ref on a GPU); the Triton kernels take sliding windows only"
            )

    def decode_graph_metadata(
        self, num_rows: int, slot_mapping: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor
    ) -> TritonMetadata:
        max_seq_len = self.max_pages_per_seq * self.page_size  # a bound only: per-row splits never read it
        return TritonMetadata(
            page_size=self.page_size,
            num_decode_rows=num_rows,
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            page_table=self.page_table_buffer[:num_rows],
            page_table_width=self.max_pages_per_seq,
            query_start_loc_host=list(range(num_rows + 1)),
            seq_lens_host=[max_seq_len] * num_rows,
            max_query_len=1,
            max_seq_len=max_seq_len,
            per_row_splits=True,
        )

    def prepare(self, step_input: AttentionStepInput) -> TritonMetadata:
        common = self._common_metadata(step_input)
        starts = step_input.query_start_loc
        max_query_len = max((b - a for a, b in zip(starts, starts[1:])), default=0)
        return TritonMetadata(
            **vars(common), max_query_len=max_query_len, max_seq_len=max(step_input.seq_lens, default=0)
        )

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
        assert isinstance(metadata, TritonMetadata)
        if k is not None and v is not None:
            kv_pool.store(layer_index, metadata.slot_mapping, k, v)
        k_cache, v_cache = kv_pool.layer(layer_index)
        kv_scales = kv_pool.kv_scales(layer_index)  # per KV head, float32; None when unquantized
        k_scale, v_scale = kv_scales if kv_scales is not None else (None, None)
        window = (self.layer_kinds[layer_index] if self.layer_kinds else self.default_kind).sliding_window
        table = metadata.page_table
        if metadata.per_row_splits:
            programs = metadata.num_rows * k_cache.shape[1]
            return paged_decode(
                q, k_cache, v_cache, table, metadata.seq_lens, metadata.max_seq_len, scale, self.page_size,
                sliding_window=self.sliding_window, k_scale=k_scale, v_scale=v_scale,
                num_splits=max(1, min(16, GRAPH_DECODE_PROGRAMS // programs)), per_row_splits=True,
            )  # fmt: skip
        if (
            metadata.num_decode_rows == metadata.num_rows
            and metadata.max_seq_len >= SPLIT_K_MIN_CONTEXT_TOKENS
        ):
            return paged_decode(
                q, k_cache, v_cache, table, metadata.seq_lens, metadata.max_seq_len, scale, self.page_size,
                sliding_window=window, k_scale=k_scale, v_scale=v_scale,
            )  # fmt: skip
        return paged_attention(
            q, k_cache, v_cache, table, metadata.query_start_loc, metadata.seq_lens, metadata.max_query_len,
            scale, self.page_size, sliding_window=window, k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
