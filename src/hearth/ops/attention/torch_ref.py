"""Paged attention in plain torch: the reference backend, on any device (the tests' oracle, and the GPU path
until a Triton backend exists).

Decode rows (one query token each) are attended as one batch over their gathered pages; every other row
(a prefill chunk, or a decode row with draft tokens to verify) is attended on its own, since lengths
differ. Masks and per-row page lists are built once per step in `prepare`, on the backend's device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from hearth.ops.attention.backend import (
    AttentionBackend,
    AttentionKind,
    AttentionMetadata,
    AttentionStepInput,
    PagedKVCache,
    gather_pages_as,
)


@dataclass
class PrefillChunk:
    """A row with several query tokens, attended on its own."""

    query_start: int  # row of the chunk's first token in the flat batch
    query_len: int
    page_ids: torch.Tensor  # long [num_pages]: the pages holding the chunk's context, in position order
    context_len: int
    kind: AttentionKind
    _mask: torch.Tensor | None = field(default=None, repr=False)

    @property
    def plain_causal(self) -> bool:
        """Whether query i sees keys [0, first position + i]: no cached prefix, no window that bites."""
        return self.context_len == self.query_len and not self.kind.limits(self.context_len)

    def mask(self) -> torch.Tensor | None:
        """bool `[query_len, context_len]` (True = attend), None when plain causal. Built on first use and
        kept for the step's other layers: kernels that mask by position never pay for it."""
        if self._mask is None and not self.plain_causal:
            device = self.page_ids.device
            end, start = self.context_len, self.context_len - self.query_len
            query_pos = torch.arange(start, end, device=device)[:, None]
            key_pos = torch.arange(end, device=device)[None, :]
            mask = key_pos <= query_pos
            self._mask = self.kind.restrict(mask, query_pos, key_pos) if self.kind.limits(end) else mask
        return self._mask


@dataclass
class TorchMetadata(AttentionMetadata):
    decode_first_positions: torch.Tensor | None = None  # long [num_decode_rows]: first key attended
    decode_mask: torch.Tensor | None = (
        None  # bool [num_decode_rows, width * page_size], when the torch path runs
    )
    prefills: list[PrefillChunk] = field(default_factory=list)
    decode_kernel: Callable[..., torch.Tensor] | None = None  # a compiled decode kernel a subclass picked
    # Layers of different attention kinds: each layer's metadata (one per distinct kind, shared), by local index.
    per_layer: list[TorchMetadata] | None = None


class TorchRefBackend(AttentionBackend):
    name = "torch_ref"

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._zero_positions = torch.zeros(self.max_num_seqs, dtype=torch.long, device=self.device)

    def _uses_decode_kernel(self) -> bool:
        return False

    def prepare(self, step_input: AttentionStepInput) -> TorchMetadata:
        if self.layer_kinds is None:
            return self._prepare_kind(step_input, self.default_kind)
        # Per-layer kinds (Gemma 3's sliding and full layers, Llama 4's chunked and NoPE-full ones): masks
        # and first positions once per distinct kind, each layer pointed at its kind's.
        variants = {kind: self._prepare_kind(step_input, kind) for kind in dict.fromkeys(self.layer_kinds)}
        md = variants[self.layer_kinds[0]]
        md.per_layer = [variants[kind] for kind in self.layer_kinds]
        return md

    def _prepare_kind(self, step_input: AttentionStepInput, kind: AttentionKind) -> TorchMetadata:
        common = self._common_metadata(step_input)
        md = TorchMetadata(**vars(common))
        n = md.num_decode_rows
        if n:
            lens = md.seq_lens[:n]
            md.decode_first_positions = (
                kind.first_positions(lens.clone()) if not kind.is_full else self._zero_positions[:n]
            )
            if not self._uses_decode_kernel():
                # Key positions [first, context_len) of each row are attended; the rest is padding or out of the window.
                positions = torch.arange(md.page_table_width * self.page_size, device=self.device)
                md.decode_mask = (positions[None, :] < lens[:, None]) & (
                    positions[None, :] >= md.decode_first_positions[:, None]
                )
        starts = md.query_start_loc_host
        for row in range(n, md.num_rows):
            query_start, query_len = starts[row], starts[row + 1] - starts[row]
            end = md.seq_lens_host[row]
            page_ids = md.page_table[row, : -(-end // self.page_size)]
            md.prefills.append(PrefillChunk(query_start, query_len, page_ids, end, kind))
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
        assert isinstance(metadata, TorchMetadata)
        if metadata.per_layer is not None:
            metadata = metadata.per_layer[layer_index]
        if k is not None and v is not None:
            kv_pool.store(layer_index, metadata.slot_mapping, k, v)
        k_pool, v_pool = kv_pool.layer(layer_index)
        kv_scales = kv_pool.kv_scales(layer_index)
        if metadata.num_decode_rows == q.shape[0]:  # a pure decode step: no copy into an output buffer
            return self._decode(q, k_pool, v_pool, metadata, scale, kv_scales)
        n = metadata.num_decode_rows
        if not n and len(metadata.prefills) == 1 and metadata.prefills[0].query_len == q.shape[0]:
            # One prompt chunk alone (no padding rows): its result is the output.
            return self._prefill(q, k_pool, v_pool, kv_scales, metadata.prefills[0], metadata, scale)
        out = torch.empty_like(q)
        if n:
            out[:n] = self._decode(q[:n], k_pool, v_pool, metadata, scale, kv_scales)
        for chunk in metadata.prefills:
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            out[rows] = self._prefill(q[rows], k_pool, v_pool, kv_scales, chunk, metadata, scale)
        return out

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
        """One multi-token row's attention, `[query_len, heads, dim]`: SDPA over its gathered pages."""
        k_scale, v_scale = kv_scales if kv_scales is not None else (None, None)
        keys = gather_pages_as(k_pool, chunk.page_ids, md.page_size, q.dtype, k_scale)[: chunk.context_len]
        values = gather_pages_as(v_pool, chunk.page_ids, md.page_size, q.dtype, v_scale)[: chunk.context_len]
        attended = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0),
            attn_mask=chunk.mask(),
            is_causal=chunk.plain_causal,
            scale=scale,
            enable_gqa=q.shape[1] != k_pool.shape[1],
        )
        return attended.squeeze(0).transpose(0, 1)

    def _decode(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        md: TorchMetadata,
        scale: float,
        kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """One query token per row: gather each row's pages (dequantized by `kv_scales` when the pool holds
        FP8), then one masked SDPA over the batch."""
        assert md.decode_mask is not None
        k_scale, v_scale = kv_scales if kv_scales is not None else (None, None)
        table = md.page_table[: md.num_decode_rows, : md.page_table_width]
        keys = gather_pages_as(k_pool, table, md.page_size, q.dtype, k_scale)
        values = gather_pages_as(v_pool, table, md.page_size, q.dtype, v_scale)
        # Slots past a row's context may hold anything (the pool is never cleared, and fresh memory can
        # be NaN); a masked NaN still poisons SDPA's sums, so those slots are zeroed in the gathered copy.
        outside = ~md.decode_mask[:, :, None, None]
        keys.masked_fill_(outside, 0.0)
        values.masked_fill_(outside, 0.0)
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)
        attended = F.scaled_dot_product_attention(
            q.unsqueeze(2),
            keys,
            values,
            attn_mask=md.decode_mask[:, None, None, :],
            scale=scale,
            enable_gqa=q.shape[1] != k_pool.shape[1],
        )
        return attended.squeeze(2)
