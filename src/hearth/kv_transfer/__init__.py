"""Moving KV pages between servers (prefill/decode disaggregation): transports in a registry.

`make_transport(name, ...)` builds one by `--kv-transfer` name from `KV_TRANSPORTS`: `tcp` (the default,
everywhere) and `mooncake` (Mooncake Transfer Engine, when installed). See `base.py` for the contract. The
package itself imports nothing heavy: the router uses `auth` (instruction signing) and the config the
transport names without torch; a transport's module is imported when it is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hearth.contracts.registry import Registry

if TYPE_CHECKING:
    from hearth.kv_transfer.base import KVTransport, PageSink, WireLayout

KV_TRANSPORTS: Registry[type[KVTransport]] = Registry("KV transport")
KV_TRANSPORTS.add("tcp", "hearth.kv_transfer.tcp:TCPTransport")
# Importing it raises a clear error when the Mooncake Transfer Engine is not installed.
KV_TRANSPORTS.add("mooncake", "hearth.kv_transfer.mooncake:MooncakeTransport")


def make_transport(
    name: str, layout: WireLayout, secret: bytes, timeout_s: float, sink: PageSink
) -> KVTransport:
    return KV_TRANSPORTS.get(name)(layout, secret, timeout_s, sink)
