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


@dataclass
class TritonMetadata(AttentionMetadata):
    max_query_len: int = 0
    max_seq_len: int = 0


class TritonBackend(AttentionBackend):
    name = "triton"

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)

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
        table = metadata.page_table
        if (
            metadata.num_decode_rows == metadata.num_rows
            and metadata.max_seq_len >= SPLIT_K_MIN_CONTEXT_TOKENS
        ):
            return paged_decode(
                q, k_cache, v_cache, table, metadata.seq_lens, metadata.max_seq_len, scale, self.page_size,
                sliding_window=self.sliding_window, k_scale=k_scale, v_scale=v_scale,
            )  # fmt: skip
        return paged_attention(
            q, k_cache, v_cache, table, metadata.query_start_loc, metadata.seq_lens, metadata.max_query_len,
            scale, self.page_size, sliding_window=self.sliding_window, k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip

