"""Shared by the KV tier tests: a real redis-server on a free loopback port, and a small CPU pool."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch

from hearth.kv.pool import KVLayout, KVPool
from hearth.kv.tiers import PageSpec

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, page_size=4, kv_dtype=torch.float32)


def small_pool(num_pages: int = 8) -> KVPool:
    pool = KVPool(LAYOUT, num_pages)
    pool.storage.zero_()
    return pool


def spec_of(pool: KVPool) -> PageSpec:
    return PageSpec(pool.layout.describe(), pool.io.layout)


def fill_page(pool: KVPool, page_id: int, value: float) -> torch.Tensor:
    data = torch.full_like(pool.read_pages([page_id]), value)
    data += torch.arange(data.numel(), dtype=data.dtype).view(data.shape) / 1000
    pool.write_pages([page_id], data)
    return data


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """redis-server on 127.0.0.1:port with no persistence; stop/start keep the port (a restart)."""

    def __init__(self, workdir: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server is not installed (apt-get install -y redis-server)")
        self.binary = binary
        self.workdir = workdir
        self.port = free_port()
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir), "--maxmemory", "256mb", "--maxmemory-policy", "allkeys-lru"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None
