"""`--kv-transfer mooncake`: page bytes through Mooncake Transfer Engine, control on the TCP transport.

Everything but the page bytes is the TCP transport's (`tcp.py`): the HMAC handshake both ways, the
layout check, `Want`, per-batch headers with checksums, and the transfer-id check under the lock
before any write into the pool. What changes is where the bytes go: the receiver registers a staging
buffer for the transfer with its Transfer Engine and names it in `Want` (its TE session and the
buffer's address); the sender writes each batch there with `transfer_sync_write` (RDMA where the
machine has it; Mooncake's own TCP transport otherwise) before it sends the batch's header. The
receiver then checks the batch and copies it from staging into the pool exactly as the TCP transport
does, so a one-sided write can only ever land in staging, never in pages another request owns, and
the staging buffer is unregistered when the connection ends.

Needs `mooncake-transfer-engine` (`mooncake-transfer-engine-non-cuda` on CPU machines). Its engine
listens on every interface (0.0.0.0) whatever `--kv-transfer-host` says; run it on a trusted network
(its tests run in a private network namespace).
"""

from __future__ import annotations

import socket
import threading

import numpy as np
import torch

from hearth.kv_transfer.base import PageSink, ReceiveSpec, WireLayout
from hearth.kv_transfer.tcp import Batch, TCPTransport, TransferError, Want

try:
    from mooncake.engine import TransferEngine
except ImportError as exc:  # pragma: no cover - depends on the machine
    raise ImportError(
        "--kv-transfer mooncake needs Mooncake Transfer Engine: pip install mooncake-transfer-engine "
        "(or mooncake-transfer-engine-non-cuda on machines without CUDA)"
    ) from exc

MOONCAKE_PROTOCOL = "tcp"  # "rdma" where the machine has RDMA NICs


class _Staging:
    def __init__(self, engine: TransferEngine, size: int) -> None:
        self.engine = engine
        self.buffer = torch.empty(max(size, 1), dtype=torch.uint8)
        self.address = self.buffer.data_ptr()
        if engine.register_memory(self.address, self.buffer.numel()) != 0:
            raise TransferError("Mooncake could not register the staging buffer")
        self.view = memoryview(self.buffer.numpy())

    def close(self) -> None:
        self.engine.unregister_memory(self.address)


class MooncakeTransport(TCPTransport):
    name = "mooncake"

    def __init__(self, layout: WireLayout, secret: bytes, timeout_s: float, sink: PageSink) -> None:
        super().__init__(layout, secret, timeout_s, sink)
        self._engine: TransferEngine | None = None
        self._session = ""
        self._engine_lock = threading.Lock()

    def engine(self, host: str = "127.0.0.1") -> TransferEngine:
        with self._engine_lock:
            if self._engine is None:
                engine = TransferEngine()
                if engine.initialize(host, "P2PHANDSHAKE", MOONCAKE_PROTOCOL, "") != 0:
                    raise TransferError(f"Mooncake Transfer Engine did not start on {host}")
                self._engine = engine
                self._session = f"{host}:{engine.get_rpc_port()}"
            return self._engine

    def listen(self, host: str, port: int) -> str:
        self.engine(host)
        return super().listen(host, port)

    # ---- receiver: a registered staging buffer per transfer --------------------------------------

    def _open_payload(self, spec: ReceiveSpec, sender: WireLayout) -> object:
        from hearth.kv_transfer.base import WIRE_DTYPES

        dtype = WIRE_DTYPES.get(sender.dtype)
        if dtype is None:
            raise TransferError(f"pages in dtype {sender.dtype!r} cannot be received here")
        return _Staging(self.engine(), self.layout.page_bytes(dtype) * len(spec.page_ids))

    def _want_extras(self, want: Want, payload: object) -> Want:
        assert isinstance(payload, _Staging)
        want.remote = self._session
        want.remote_addr = payload.address
        return want

    def _recv_payload(self, sock: socket.socket, payload: object, batch: Batch, size: int) -> memoryview:
        assert isinstance(payload, _Staging)
        if batch.offset < 0 or batch.offset + size > len(payload.view):
            raise TransferError(f"batch at byte {batch.offset} overruns the staging buffer")
        return payload.view[batch.offset : batch.offset + size]

    def _close_payload(self, payload: object) -> None:
        if isinstance(payload, _Staging):
            payload.close()

    # ---- sender: one-sided writes into the receiver's staging ------------------------------------

    def _send_payload(self, sock: socket.socket, want: Want, raw: memoryview, offset: int) -> None:
        if want.remote is None:
            raise TransferError("the decode server does not use Mooncake (its Want names no buffer)")
        engine = self.engine()
        address = np.frombuffer(raw, dtype=np.uint8).ctypes.data
        if engine.register_memory(address, len(raw)) != 0:
            raise TransferError("Mooncake could not register the pages to send")
        try:
            if engine.transfer_sync_write(want.remote, address, want.remote_addr + offset, len(raw)) != 0:
                raise TransferError(f"Mooncake write to {want.remote} failed")
        finally:
            engine.unregister_memory(address)
