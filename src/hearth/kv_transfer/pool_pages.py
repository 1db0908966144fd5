"""A pool's pages as a transport sees them: the sender's `PageSource` and the receiver's `PageSink`, both
over the pool's `hearth.kv.page_io.PageIO` (the one owner of a page's bytes).

The sender hands the pool's own page runs to `sendmsg` (no gather copy); a receiver whose pool has the
wire's dtype `recvmsg_into`s straight into its pages. Other dtypes (and FP8 scales) are converted by
`PageIO.write` with the receiver's own scales (precision per role: a BF16 prefill pool into an FP8 decode
pool). Pages re-assembled from several ranks (a receiver of another TP size) go out of a tensor.
"""

from __future__ import annotations

import torch

from hearth.kv.page_io import PageIO, Scales


class PoolPageSource:
    """A request's held pages, read page-major for the wire."""

    def __init__(self, io: PageIO, page_ids: list[int]) -> None:
        self.io = io
        self.page_ids = page_ids
        if io.pool.storage.device.type != "cpu":
            self.page_runs = None  # type: ignore[assignment]  # GPU pools: gathered into host memory

    @property
    def num_pages(self) -> int:
        return len(self.page_ids)

    @property
    def dtype(self) -> torch.dtype:
        return self.io.dtype

    @property
    def scales(self) -> Scales | None:
        return self.io.scales

    def page_runs(self, first: int, count: int) -> list[memoryview]:
        """Pages [first, first + count) as the pool's contiguous byte runs, in wire order (for `sendmsg`)."""
        return self.io.page_runs(self.page_ids[first : first + count])

    def read_into(self, first: int, count: int, out: torch.Tensor) -> None:
        self.io.read_into(self.page_ids[first : first + count], out)


class TensorPageSource:
    """Pages already copied out (`[num_pages, *page_shape]`, CPU), with their FP8 scales if any."""

    def __init__(self, pages: torch.Tensor, scales: Scales | None) -> None:
        self.pages = pages
        self.scales = scales

    @property
    def num_pages(self) -> int:
        return self.pages.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.pages.dtype

    def read_into(self, first: int, count: int, out: torch.Tensor) -> None:
        part = self.pages[first : first + count]
        if part.element_size() == 1:  # FP8: copied as bytes
            out.view(torch.uint8).copy_(part.view(torch.uint8))
        else:
            out.copy_(part)


class PoolSink:
    """Writes wire pages into the pool (converting when the dtype or FP8 scales differ); `page_runs` says
    where same-dtype pages can be received as they are."""

    def __init__(self, io: PageIO) -> None:
        self.io = io

    def __call__(self, page_ids: list[int], data: torch.Tensor, src_scales: Scales | None = None) -> None:
        self.io.write(page_ids, data, src_scales)

    def page_runs(self, page_ids: list[int], dtype: torch.dtype) -> list[memoryview] | None:
        return self.io.writable_runs(page_ids, dtype)
