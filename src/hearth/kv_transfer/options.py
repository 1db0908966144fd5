"""The prefill/decode disaggregation options (`KVTransferOptions`, a part of `EngineConfig`). The secret is
not one: it travels in $HEARTH_KV_TRANSFER_SECRET (`hearth.contracts.cli_common`). Torch-free."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from hearth.contracts.options import option
from hearth.kv_transfer import KV_TRANSPORTS

ROLE_CHOICES = ("mixed", "prefill", "decode")

_option = functools.partial(option, group="kv_transfer")


@dataclass(frozen=True)
class KVTransferOptions:
    """This server's role in a PD deployment and how its KV moves (`hearth.kv_transfer`, docs/pd-protocol.md)."""

    role: str = _option(
        "mixed",
        choices=ROLE_CHOICES,
        help="mixed: computes everything; prefill: computes prompts and sends their KV; decode: receives "
        "prompt KV and answers",
    )
    kv_transfer: str = _option("tcp", choices=KV_TRANSPORTS, help="how KV moves between servers")
    kv_transfer_host: str = _option("127.0.0.1", help="decode role: address the KV listener binds")
    kv_transfer_port: int = _option(0, type=int, help="decode role: KV listener port (0: any free port)")
    kv_transfer_timeout_s: float = _option(
        30.0,
        flags=("--kv-transfer-timeout",),
        type=float,
        help="seconds a decode request waits for its KV before it computes the prompt itself",
    )

    def _check_kv_transfer_options(self) -> None:
        if self.kv_transfer_timeout_s <= 0:
            raise ValueError("kv_transfer_timeout_s must be > 0")
