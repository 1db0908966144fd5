"""The KV transport interface: one server's end of the wire that moves a prompt's pages between servers.

A transport moves pages; it knows nothing of requests or the scheduler (the engine's
`PeerKVConnector` maps requests onto transfers). Both ends of a transfer name it by the router's
`transfer_id`. The decode side `listen`s and `open_receive`s what it needs (which pages of the
request, into which of its own pages); the prefill side `send`s what it computed. The receiver
answers the sender with the range of request pages it wants, so only pages missing from the decode
server's own prefix cache cross the wire.

Contract:
- `open_receive(spec)`: pages for `spec.transfer_id` may be written into `spec.page_ids` from now on.
- `close_receive(transfer_id)`: when it returns, no write for that transfer lands any more (the pages
  are about to be recomputed in place or freed and reused); a sender that comes later is told nothing
  is wanted. Closing an unknown id records it as closed. Idempotent.
- `send(spec)` returns at once; the pages of `spec.source` must stay intact until the `sent` event.
- `events()` returns what finished since the last call: each opened receive and each send is
  answered exactly once (a closed receive is not answered).
- `wakeup_fd` becomes readable when an event is ready, so an idle engine loop can sleep on it.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch
import xxhash

from hearth.kv.page_io import DTYPES, PageLayout, Scales, dtype_name

__all__ = ["WIRE_DTYPES", "KVTransport", "PageSink", "PageSource", "Scales", "WireLayout", "dtype_name"]

# What a page holds, as both ends compare it at the handshake (the dtype may differ: converted). The page
# layout is `hearth.kv.page_io`'s, the one owner of a page's bytes; the wire carries pages page-major.
WireLayout = PageLayout
WIRE_DTYPES = DTYPES


def prompt_hash(token_ids: list[int]) -> int:
    """Both ends hash the prompt: KV computed for other tokens must never be used."""
    return xxhash.xxh3_64_intdigest(memoryview(torch.tensor(token_ids, dtype=torch.int64).numpy()))


class PageSource(Protocol):
    """The sender's pages: request page `i` is page `i` of what `read_into` writes."""

    @property
    def num_pages(self) -> int: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def scales(self) -> Scales | None:
        """The sender pool's FP8 scales (they travel in the handshake), or None."""
        ...

    def read_into(self, first: int, count: int, out: torch.Tensor) -> None:
        """Pages [first, first + count) page-major into `out` (`[count, *page_shape]`, contiguous, CPU):
        the sender reuses one staging buffer for every batch."""
        ...


# Writes pages (`[count, *page_shape]`, any wire dtype, CPU; with the sender's scales when FP8) into the
# named pool pages, converting to the pool's dtype and scales.
PageSink = Callable[[list[int], torch.Tensor, Scales | None], None]


@dataclass
class ReceiveSpec:
    transfer_id: str
    first_page: int  # the request's page index of page_ids[0]
    page_ids: list[int]  # pool pages, in request order
    end_token: int  # the sender must hold at least this many computed tokens of the prompt
    prompt_hash: int


@dataclass
class SendSpec:
    transfer_id: str
    endpoint: str
    source: PageSource
    num_tokens: int  # computed prompt tokens the source's pages hold (0: none; tells the receiver to give up)
    prompt_hash: int
    layout: WireLayout | None = None  # what the source's pages hold, when not the transport's whole pool


@dataclass(frozen=True)
class TransferEvent:
    transfer_id: str
    kind: Literal["received", "sent"]
    ok: bool
    detail: str = ""
    num_pages: int = 0  # pages written (received) or sent


@dataclass
class TransferCounters:
    """Totals for metrics and tests (each transport keeps one)."""

    pages_received: int = 0
    pages_sent: int = 0
    bytes_received: int = 0
    bytes_sent: int = 0
    late_writes_dropped: int = 0  # pages that arrived for a closed transfer and were not written
    handshakes_refused: int = 0  # connections that did not authenticate (nothing of theirs kept)
    connections_refused: int = 0  # closed at accept: the listener was at its connection cap
    frames_refused: int = 0  # authenticated transfers failed by a frame whose tag did not verify
    events: dict[str, int] = field(default_factory=dict)


class Waker:
    """A pipe an idle engine loop sleeps on; any thread may `wake` it."""

    def __init__(self) -> None:
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)

    @property
    def fd(self) -> int:
        return self._read_fd

    def wake(self) -> None:
        try:
            os.write(self._write_fd, b"x")
        except (BlockingIOError, OSError):  # full: a wakeup is already pending; closed: shutting down
            pass

    def drain(self) -> None:
        try:
            while os.read(self._read_fd, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        for fd in (self._read_fd, self._write_fd):
            try:
                os.close(fd)
            except OSError:
                pass


class KVTransport(ABC):
    """See the module docstring for the contract."""

    name: str

    def __init__(self, layout: WireLayout, secret: bytes, timeout_s: float, sink: PageSink) -> None:
        self.layout = layout
        self.secret = secret
        self.timeout_s = timeout_s
        self.sink = sink
        self.counters = TransferCounters()
        self.waker = Waker()

    @property
    def wakeup_fd(self) -> int:
        return self.waker.fd

    @abstractmethod
    def listen(self, host: str, port: int) -> str:
        """Start accepting senders; returns the endpoint senders are given (e.g. `tcp://127.0.0.1:40123`)."""

    @abstractmethod
    def open_receive(self, spec: ReceiveSpec) -> None: ...

    @abstractmethod
    def close_receive(self, transfer_id: str) -> None: ...

    @abstractmethod
    def send(self, spec: SendSpec) -> None: ...

    @abstractmethod
    def events(self) -> list[TransferEvent]: ...

    def close(self) -> None:
        self.waker.close()
