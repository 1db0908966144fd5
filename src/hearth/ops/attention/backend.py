"""The attention backend interface: per-step metadata prepared once, per-layer forward over a paged KV pool.

A step's batch is rows in cu_seqlens form: row r's query tokens are `query_start_loc[r] ..
query_start_loc[r+1]` of the flat batch, at the last positions of a context of `seq_lens[r]` tokens,
whose keys live in the pages `page_table[r, :ceil(seq_lens[r] / page_size)]`. The first
`num_decode_rows` rows have exactly one query token each. New tokens' K/V go to `slot_mapping`
(slot = page * page_size + offset).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch


class AttentionStepInput(Protocol):
    """The fields of `hearth.engine.step_input.StepInput` that attention reads (ops knows nothing of engines)."""

    num_decode_rows: int
    query_start_loc: list[int]
    seq_lens: list[int]
    page_table: list[int]
    page_table_width: int
    slot_mapping: list[int]


class PagedKVCache(Protocol):
    """What a backend needs of the KV pool (`hearth.kv.pool.KVPool`)."""

    page_size: int

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def store(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def kv_scales(self, index: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer `index`'s (K, V) per-KV-head scales that stored values are multiplied by on read (FP8); None
        when the pool stores plain values."""
        ...


@dataclass
class AttentionMetadata:
    """One step's attention metadata on the backend's device, shared by every layer.

    `page_table` is the first `num_rows` rows of a buffer of fixed capacity `[max_num_seqs,
    max_pages_per_seq]` (so its address never changes and a GPU backend can capture graphs over it);
    only its first `page_table_width` columns belong to this step, the rest is stale (valid page ids).
    The `*_host` lists are the same values as Python lists, for backends that loop over rows.
    """

    page_size: int
    num_decode_rows: int
    slot_mapping: torch.Tensor  # long [num_tokens]
    query_start_loc: torch.Tensor  # long [num_rows + 1]
    seq_lens: torch.Tensor  # long [num_rows]
    page_table: torch.Tensor  # long [num_rows, max_pages_per_seq], contiguous
    page_table_width: int
    query_start_loc_host: list[int]
    seq_lens_host: list[int]

    @property
    def num_rows(self) -> int:
        return len(self.seq_lens_host)


@dataclass(frozen=True)
class AttentionKind:
    """What one layer's queries attend to, causally: the whole context (the default), the last
    `sliding_window` positions (Mistral, Gemma 3's local layers, Qwen2's windowed layers), or the positions of
    their own `chunk_size`-token chunk (chunked local attention, Llama 4's local layers)."""

    sliding_window: int | None = None
    chunk_size: int | None = None

    @property
    def is_full(self) -> bool:
        return self.sliding_window is None and self.chunk_size is None

    def first_positions(self, context_lens: torch.Tensor) -> torch.Tensor:
        """The first key position the last query of each row (at `context_len - 1`) attends to."""
        if self.sliding_window is not None:
            return (context_lens - self.sliding_window).clamp_(min=0)
        if self.chunk_size is not None:
            return torch.div(context_lens - 1, self.chunk_size, rounding_mode="floor") * self.chunk_size
        return torch.zeros_like(context_lens)

    def limits(self, context_len: int) -> bool:
        """Whether some query of a row ending at `context_len` attends to less than its causal prefix."""
        if self.sliding_window is not None:
            return context_len > self.sliding_window
        return self.chunk_size is not None and context_len > self.chunk_size

    def restrict(self, mask: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        """`mask` (causal) narrowed to this kind's keys."""
        if self.sliding_window is not None:
            return mask & (key_pos > query_pos - self.sliding_window)
        if self.chunk_size is not None:
            return mask & (
                key_pos >= torch.div(query_pos, self.chunk_size, rounding_mode="floor") * self.chunk_size
            )
        return mask


class AttentionBackend(ABC):
    """Paged attention for one worker's device.

    Contract:
    - `prepare(step_input)` runs once per step, before the model: it turns the step's flat lists into
      device tensors and builds everything every layer shares (masks, per-row page lists), writing the
      page table into the preallocated buffer. Layers never rebuild metadata.
    - `forward(layer_index, q, k, v, kv_pool, metadata, scale)` runs per layer: it stores the step's new
      keys and values (`k`, `v` `[num_tokens, num_kv_heads, head_dim]`, already rotated) into the pool at
      `metadata.slot_mapping` — unless they are None, when the caller wrote them itself (a fused
      rotary + KV-write kernel) — then returns the attention output for `q` `[num_tokens, num_heads,
      head_dim]`, same shape and dtype, each query attending causally to its row's context as the layer's
      `AttentionKind` says (`layer_kinds[layer_index]`; without them every layer is
      `AttentionKind(sliding_window)`).
    """

    name: ClassVar[str]
    # Whether `decode_graph_metadata` exists: decode steps can be captured as CUDA graphs (hearth.engine.cuda_graphs).
    supports_decode_graphs: ClassVar[bool] = False

    def __init__(
        self,
        *,
        device: torch.device | str,
        page_size: int,
        max_num_seqs: int,
        max_pages_per_seq: int,
        dtype: torch.dtype = torch.float32,
        kv_dtype: torch.dtype | None = None,
        sliding_window: int | None = None,
        layer_kinds: tuple[AttentionKind, ...] | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.max_pages_per_seq = max_pages_per_seq
        self.dtype = dtype
        self.kv_dtype = kv_dtype if kv_dtype is not None else dtype
        self.sliding_window = sliding_window
        # One kind per layer of this stage (indexed by the local layer index); None: all the default kind.
        self.default_kind = AttentionKind(sliding_window=sliding_window)
        kinds = tuple(layer_kinds) if layer_kinds else ()
        self.layer_kinds: tuple[AttentionKind, ...] | None = kinds if len(set(kinds)) > 1 else None
        if kinds and self.layer_kinds is None:
            self.default_kind = kinds[0]
            self.sliding_window = self.default_kind.sliding_window
        # Zero-filled, so columns no step has written yet still name a valid page.
        self.page_table_buffer = torch.zeros(
            max_num_seqs, max_pages_per_seq, dtype=torch.long, device=self.device
        )

    @abstractmethod
    def prepare(self, step_input: AttentionStepInput) -> AttentionMetadata: ...

    @abstractmethod
    def forward(
        self,
        layer_index: int,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        kv_pool: PagedKVCache,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...

    def decode_graph_metadata(
        self, num_rows: int, slot_mapping: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor
    ) -> AttentionMetadata:
        """Metadata of an all-decode step of `num_rows` rows over static tensors that each replay refills
        (and over `page_table_buffer[:num_rows]`): nothing in it may depend on one step's lengths, since a
        captured graph keeps whatever the host decided at capture."""
        raise NotImplementedError(f"the {self.name} attention backend cannot be captured in a graph")

    def _common_metadata(self, step: AttentionStepInput) -> AttentionMetadata:
        """The cu_seqlens tensors and the page table, moved to the device in one transfer."""
        num_rows = len(step.seq_lens)
        width = step.page_table_width
        if num_rows > self.max_num_seqs or width > self.max_pages_per_seq:
            raise ValueError(
                f"a step of {num_rows} rows x {width} pages exceeds the attention buffers "
                f"({self.max_num_seqs} x {self.max_pages_per_seq})"
            )
        num_tokens = len(step.slot_mapping)
        packed = torch.tensor(
            step.slot_mapping + step.seq_lens + step.query_start_loc + step.page_table, dtype=torch.long
        )
        if self.device.type == "cuda":  # pinned, so the copy is asynchronous
            packed = packed.pin_memory().to(self.device, non_blocking=True)
        elif self.device.type != "cpu":
            packed = packed.to(self.device)
        ends = (num_tokens, num_tokens + num_rows, num_tokens + 2 * num_rows + 1)
        page_table = self.page_table_buffer[:num_rows]
        if width:
            page_table[:, :width].copy_(packed[ends[2] :].view(num_rows, width))
        return AttentionMetadata(
            page_size=self.page_size,
            num_decode_rows=step.num_decode_rows,
            slot_mapping=packed[: ends[0]],
            seq_lens=packed[ends[0] : ends[1]],
            query_start_loc=packed[ends[1] : ends[2]],
            page_table=page_table,
            page_table_width=width,
            query_start_loc_host=step.query_start_loc,
            seq_lens_host=step.seq_lens,
        )


@dataclass
class AttentionContext:
    """What the model's forward gets for attention: the backend, this step's metadata, and the KV pool."""

    backend: AttentionBackend
    metadata: AttentionMetadata
    kv_pool: PagedKVCache


def as_copyable(t: torch.Tensor) -> torch.Tensor:
    """The same bytes as uint8 for float8 tensors, whose dtypes lack CPU `index_copy_`/`index_select`."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t


def write_kv(
    k_pool: torch.Tensor, v_pool: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    as_copyable(k_pool).index_copy_(0, slot_mapping, as_copyable(k.to(k_pool.dtype)))
    as_copyable(v_pool).index_copy_(0, slot_mapping, as_copyable(v.to(v_pool.dtype)))


def gather_pages_as(
    pool: torch.Tensor,
    page_ids: torch.Tensor,
    page_size: int,
    dtype: torch.dtype,
    scale: torch.Tensor | None,
) -> torch.Tensor:
    """`gather_pages` in `dtype`, dequantized by the per-KV-head `scale` when the pool holds scaled values."""
    gathered = gather_pages(pool, page_ids, page_size)
    if scale is None:
        return gathered.to(dtype)
    return (gathered.to(torch.float32) * scale.view(-1, 1)).to(dtype)


def gather_pages(pool: torch.Tensor, page_ids: torch.Tensor, page_size: int) -> torch.Tensor:
    """`[*page_ids.shape[:-1], num_pages * page_size, kv_heads, head_dim]` from a slot-addressed pool.

    Whole pages at a time (`index_select` of page-sized rows): several times faster on CPU than a gather per slot.
    """
    num_slots, kv_heads, head_dim = pool.shape
    rows = (
        as_copyable(pool)
        .view(num_slots // page_size, page_size * kv_heads * head_dim)
        .index_select(0, page_ids.flatten())
    )
    rows = rows.view(pool.dtype)
    return rows.view(*page_ids.shape[:-1], page_ids.shape[-1] * page_size, kv_heads, head_dim)
