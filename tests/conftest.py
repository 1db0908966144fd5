from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

# Triton kernels run under the interpreter where there is no GPU; Triton reads this when a kernel is
# defined, so it must be set before any `hearth.ops.triton` module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kv_tier_helpers import RedisServer  # noqa: E402
from tiny_models import make_tiny_model  # noqa: E402


def pytest_sessionstart(session: pytest.Session) -> None:
    """Servers build the CPU kernels before they are ready; build them once here (as `hearth build-kernels`
    does at install), so no test's start timeout pays for a compile. A failed build leaves the torch paths."""
    from hearth.ops import cpu_kernels

    if cpu_kernels.enabled():
        cpu_kernels.build_before_ready()


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory):
    """Builds (and caches per session) tiny random checkpoints: factory(arch, **config_overrides) -> Path."""
    cache: dict[str, Path] = {}

    def factory(arch: str = "llama", **overrides) -> Path:
        key = arch + repr(sorted(overrides.items()))
        if key not in cache:
            cache[key] = make_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch, **overrides)
        return cache[key]

    return factory


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A real redis-server on a free loopback port, stopped after the test."""
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()
