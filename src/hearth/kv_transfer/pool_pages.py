"""A pool's pages as a transport sees them: the sender's `PageSource` and the receiver's `PageSink`, both
over the pool's `hearth.kv.page_io.PageIO` (the one owner of a page's bytes).

The sender hands the pool's own page runs to `sendmsg` (no gather copy); a receiver whose pool has the
wire's dtype `recvmsg_into`s straight into its pages. Other dtypes (and FP8 scales) are converted by
`PageIO.write` with the receiver's own scales (precision per role: a BF16 prefill pool into an FP8 decode
pool). Transfers between different TP sizes move a part of each page's heads (`first_kv_head`).
"""

from __future__ import annotations

import torch

from hearth.kv.page_io import PageIO, Scales


class PoolPageSource:
    """A request's held pages, read page-major for the wire (`heads`: only those local KV heads)."""

    def __init__(self, io: PageIO, page_ids: list[int], heads: tuple[int, int] | None = None) -> None:
        self.io = io
        self.page_ids = page_ids
        self.heads = heads
        if io.pool.storage.device.type != "cpu" or heads is not None:
            self.page_runs = None  # type: ignore[assignment]  # gathered into host memory instead

    @property
    def num_pages(self) -> int:
        return len(self.page_ids)

    @property
    def dtype(self) -> torch.dtype:
        return self.io.dtype

    @property
    def scales(self) -> Scales | None:
        scales = self.io.scales
        if scales is None or self.heads is None:
            return scales
        part = slice(self.heads[0], self.heads[0] + self.heads[1])
        return scales[0][:, part].contiguous(), scales[1][:, part].contiguous()

    def page_runs(self, first: int, count: int) -> list[memoryview]:
        """Pages [first, first + count) as the pool's contiguous byte runs, in wire order (for `sendmsg`)."""
        return self.io.page_runs(self.page_ids[first : first + count])

    def read_into(self, first: int, count: int, out: torch.Tensor) -> None:
        ids = self.page_ids[first : first + count]
        if self.heads is None:
            self.io.read_into(ids, out)
            return
        whole = self.io.read(ids)
        out.copy_(whole[:, :, :, :, self.heads[0] : self.heads[0] + self.heads[1]])


class PoolSink:
    """Writes wire pages into the pool (converting when the dtype or FP8 scales differ); `page_runs` says
    where same-dtype pages can be received as they are. `first_kv_head`: the received pages hold the
    local KV heads from there on (a sender of another TP size sends its part)."""

    def __init__(self, io: PageIO, first_kv_head: int | None = None) -> None:
        self.io = io
        self.first_kv_head = first_kv_head

    def __call__(self, page_ids: list[int], data: torch.Tensor, src_scales: Scales | None = None) -> None:
        if self.first_kv_head is None:
            self.io.write(page_ids, data, src_scales)
        else:
            self.io.write_heads(page_ids, data, self.first_kv_head, src_scales)

    def page_runs(self, page_ids: list[int], dtype: torch.dtype) -> list[memoryview] | None:
        if self.first_kv_head is not None:
            return None
        return self.io.writable_runs(page_ids, dtype)
