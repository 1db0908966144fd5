"""CUDA graphs for decode steps: captured once at start, replayed per step, so a decode step costs a few
copies and one launch instead of one launch per kernel (the batch-1 profile on an H200 was launch-bound:
108 ms of CPU time against 14 ms of GPU time for 16 tokens).

A step qualifies when every row is a plain decode row (one token, no drafts) that samples. Its row count
is padded up to the next captured size (`capture_sizes`); the padding rows read and write one scratch
page that the allocator never hands out (the worker's pool has one page more than the cache manager's),
and their logits are sliced off. Steps that do not qualify, or have more rows than the largest size,
run eagerly.

The graphs read their inputs from static buffers: `[4, max_rows]` step values (token ids, positions,
slots, context lengths) and the attention backend's fixed page table buffer; each replay refills them
with two copies from one pinned host tensor. What the graphs need of the rest of the worker is narrow:
a `forward(token_ids, positions, metadata, logits_indices) -> logits` callable and an attention backend
that can build metadata over static tensors (`AttentionBackend.decode_graph_metadata`), so a persistent
batch that keeps its inputs on the device can feed the same buffers later.

Memory is bounded: every graph shares one memory pool (captured largest first, so smaller ones reuse its
blocks) and writes its logits into one `[max_rows, vocab]` buffer. Capture time and memory are logged.

Without a GPU (`capture=False`) a "graph" is the same closure run eagerly over the same static buffers,
so the padding, the scratch page and the graph-safe attention path are tested on a CPU.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from hearth.ops.attention import AttentionBackend, AttentionMetadata
from hearth.parallel.state import ParallelState

logger = logging.getLogger("hearth.cuda_graphs")

# Largest row count captured by default (vLLM captures up to 512; 256 keeps start-up near a few seconds).
DEFAULT_MAX_CAPTURE_ROWS = 256
SMALL_SIZES = (1, 2, 4, 8)
SIZE_STEP = 16  # above the small sizes, one graph every 16 rows: at most 15 padding rows


class DecodeStep(Protocol):
    """The fields of `hearth.engine.step_input.StepInput` a decode graph reads."""

    token_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    seq_lens: list[int]
    num_decode_rows: int
    page_table: list[int]
    page_table_width: int
    logits_indices: list[int]


Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor], torch.Tensor]


def wants_decode_graphs(
    enforce_eager: bool, device: torch.device, backend_cls: type[AttentionBackend], parallel: ParallelState
) -> bool:
    """Graphs on by default on CUDA, for one process holding the whole model (collectives between ranks
    and pipeline stages are not captured) over a backend with a graph-safe decode path."""
    return (
        not enforce_eager
        and device.type == "cuda"
        and backend_cls.supports_decode_graphs
        and parallel.tp_size == 1
        and parallel.pp_size == 1
    )


def capture_sizes(max_rows: int) -> list[int]:
    """The row counts captured: 1, 2, 4, 8, then every 16 up to `max_rows`, and `max_rows` itself."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    sizes = [s for s in SMALL_SIZES if s <= max_rows]
    sizes += range(SIZE_STEP, max_rows + 1, SIZE_STEP)
    if sizes[-1] != max_rows:
        sizes.append(max_rows)
    return sizes


def bucket_for(num_rows: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size that holds `num_rows` rows (sorted `sizes`); None past the largest."""
    index = bisect.bisect_left(sizes, num_rows)
    return sizes[index] if index < len(sizes) else None


def is_plain_decode(step: DecodeStep) -> bool:
    """Every row one token without drafts, and every row sampled (so `logits_indices` is 0..rows-1)."""
    num_rows = len(step.seq_lens)
    return (
        num_rows > 0
        and step.num_decode_rows == num_rows
        and len(step.token_ids) == num_rows
        and len(step.logits_indices) == num_rows
    )


@dataclass
class PaddedDecode:
    """A decode step padded to `rows`: `values` is token ids, positions, slots and context lengths, each
    `rows` long, back to back; `page_table` is `[rows, width]` row-major."""

    rows: int
    values: list[int]
    page_table: list[int]
    width: int


def pad_decode_step(step: DecodeStep, rows: int, scratch_page: int, page_size: int) -> PaddedDecode:
    """Pads a plain decode step to `rows` rows. A padding row is token 0 at position 0 with a context of
    one token, reading and writing slot 0 of `scratch_page` alone."""
    num_rows = len(step.seq_lens)
    if rows < num_rows:
        raise ValueError(f"cannot pad {num_rows} rows to {rows}")
    pad = rows - num_rows
    width = max(step.page_table_width, 1)
    values = (
        step.token_ids + [0] * pad
        + step.positions + [0] * pad
        + step.slot_mapping + [scratch_page * page_size] * pad
        + step.seq_lens + [1] * pad
    )  # fmt: skip
    return PaddedDecode(rows, values, step.page_table + [scratch_page] * (pad * width), width)


class DecodeGraphs:
    """Captured decode steps over static buffers; `run(step)` replays the one for the step's row count and
    returns its logits, or None when the step must run eagerly."""

    def __init__(
        self,
        forward: Forward,
        backend: AttentionBackend,
        scratch_page: int,
        max_rows: int,
        capture: bool = True,
    ) -> None:
        if not backend.supports_decode_graphs:
            raise ValueError(f"the {backend.name} attention backend has no graph-safe decode path")
        self.forward = forward
        self.backend = backend
        self.device = backend.device
        self.page_size = backend.page_size
        self.scratch_page = scratch_page
        self.sizes = capture_sizes(min(max_rows, backend.max_num_seqs))
        self.max_rows = self.sizes[-1]
        self.use_cuda_graphs = capture
        self._step = torch.zeros(4, self.max_rows, dtype=torch.long, device=self.device)
        self._query_start_loc = torch.arange(self.max_rows + 1, device=self.device)
        self._logits_indices = torch.arange(self.max_rows, device=self.device)
        self._logits: torch.Tensor | None = None  # [max_rows, vocab] float32, made at the first capture
        self._replays: dict[int, Callable[[], None]] = {}
        self.capture_s = 0.0
        self.num_replays = 0
        self.capture_bytes = 0

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every size, largest first (the smaller graphs reuse the largest one's pool blocks)."""
        start = time.perf_counter()
        free_before = 0
        if self.use_cuda_graphs:  # capture empties torch's cache: empty it first, or the figure counts that
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            free_before = torch.cuda.mem_get_info(self.device)[0]
        pool = torch.cuda.graph_pool_handle() if self.use_cuda_graphs else None
        for rows in reversed(self.sizes):
            self._replays[rows] = self._capture_one(rows, pool)
        if self.use_cuda_graphs:
            torch.cuda.synchronize(self.device)
            self.capture_bytes = free_before - torch.cuda.mem_get_info(self.device)[0]
        self.capture_s = time.perf_counter() - start
        logger.info(
            "decode graphs: %d sizes (1..%d rows) captured in %.2f s, %.0f MiB",
            len(self.sizes),
            self.max_rows,
            self.capture_s,
            self.capture_bytes / 2**20,
        )

    def _capture_one(self, rows: int, pool: object) -> Callable[[], None]:
        self._load(pad_decode_step(_EMPTY_STEP, rows, self.scratch_page, self.page_size))
        metadata = self.backend.decode_graph_metadata(
            rows, self._step[2, :rows], self._step[3, :rows], self._query_start_loc[: rows + 1]
        )
        ids, positions, indices = self._step[0, :rows], self._step[1, :rows], self._logits_indices[:rows]
        if self._logits is None:  # the first (largest) size: run once for the vocabulary width
            vocab = self.forward(ids, positions, metadata, indices).shape[-1]
            self._logits = torch.empty(self.max_rows, vocab, dtype=torch.float32, device=self.device)
        logits = self._logits[:rows]

        def step() -> None:
            logits.copy_(self.forward(ids, positions, metadata, indices))

        if not self.use_cuda_graphs:
            return step
        side = torch.cuda.Stream(self.device)  # warm-up off the default stream, as torch's docs ask
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            step()  # compiles the Triton kernels at these shapes, sizes cuBLAS workspaces
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            step()
        return graph.replay

    def run(self, step: DecodeStep) -> torch.Tensor | None:
        """The step's logits `[rows, vocab]` (a view of the graphs' output buffer, valid until the next
        replay), or None when it does not qualify: not plain decode, too many rows, or too wide."""
        if not is_plain_decode(step) or step.page_table_width > self.backend.max_pages_per_seq:
            return None
        num_rows = len(step.seq_lens)
        rows = bucket_for(num_rows, self.sizes)
        if rows is None or rows not in self._replays:
            return None
        self._load(pad_decode_step(step, rows, self.scratch_page, self.page_size))
        self._replays[rows]()
        self.num_replays += 1
        assert self._logits is not None
        return self._logits[:num_rows]

    def _load(self, padded: PaddedDecode) -> None:
        """The padded step into the static buffers: one host-to-device transfer, two device copies."""
        rows, width = padded.rows, padded.width
        host = torch.tensor(padded.values + padded.page_table, dtype=torch.long)
        if self.device.type == "cuda":  # pinned, so the copy is asynchronous
            packed = host.pin_memory().to(self.device, non_blocking=True)
        else:
            packed = host.to(self.device)
        self._step[:, :rows].copy_(packed[: 4 * rows].view(4, rows))
        self.backend.page_table_buffer[:rows, :width].copy_(packed[4 * rows :].view(rows, width))


@dataclass
class _NoRows:
    token_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    seq_lens: list[int]
    num_decode_rows: int
    page_table: list[int]
    page_table_width: int
    logits_indices: list[int]


# Capture runs on padding rows only: every row reads and writes the scratch page.
_EMPTY_STEP = _NoRows([], [], [], [], 0, [], 1, [])
