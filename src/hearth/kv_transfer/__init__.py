"""Moving KV pages between servers (prefill/decode disaggregation): transports in a registry.

`make_transport(name, ...)` builds one by `--kv-transfer` name: `tcp` (the default, everywhere) and
`mooncake` (Mooncake Transfer Engine, when installed). See `base.py` for the contract. The package
itself imports nothing heavy: the router uses `auth` (instruction signing) without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hearth.kv_transfer.base import KVTransport, PageSink, WireLayout

TRANSPORT_CHOICES = ("tcp", "mooncake")


def make_transport(
    name: str, layout: WireLayout, secret: bytes, timeout_s: float, sink: PageSink
) -> KVTransport:
    from hearth.kv_transfer.base import TRANSPORTS

    if name == "tcp":
        import hearth.kv_transfer.tcp  # noqa: F401 - registers itself
    elif name == "mooncake":
        import hearth.kv_transfer.mooncake  # noqa: F401 - registers itself (raises if not installed)
    if name not in TRANSPORTS:
        raise ValueError(f"unknown KV transport {name!r}; choose one of {', '.join(TRANSPORT_CHOICES)}")
    return TRANSPORTS[name](layout, secret, timeout_s, sink)
