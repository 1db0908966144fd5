"""Prefill/decode protocol adapters, chosen by name with `--pd-protocol`.

An adapter only shapes the two upstream request bodies; the router's request path sends them,
streams the decode answer back and rewrites its usage. Protocols:

- `hearth`: docs/pd-protocol.md. Both requests at once; each names the other side and a shared
  `transfer_id`; the prefill server pushes the KV to the decode server.
- `sglang`: the same body to both at once, with `bootstrap_host/port/room` naming the prefill
  server's bootstrap endpoint and a random room both sides meet in.
- `vllm`: prefill first with `max_tokens=1` and `kv_transfer_params.do_remote_decode`, then
  decode with the `kv_transfer_params` that the prefill returned.
"""

from __future__ import annotations

import secrets
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hearth.contracts.registry import Registry
from hearth.kv_transfer.auth import sign_instruction
from hearth.router.workers import Worker


@dataclass
class PDPair:
    prefill: Worker
    decode: Worker
    transfer_id: str = field(default_factory=lambda: secrets.token_hex(16))
    # SGLang's rooms are non-negative 63-bit integers.
    room: int = field(default_factory=lambda: secrets.randbits(63))


class PDAdapter(ABC):
    """Shapes the prefill and decode requests of one PD request.

    Contract: the bodies returned are new dicts (the client's body is never mutated). When
    `sequential` is True the router sends the prefill request, waits for its JSON answer and
    passes it to `decode_body`; otherwise it sends both at once and passes None.
    """

    name: str
    sequential: bool = False
    # The deployment's KV transfer secret: protocols whose servers authenticate instructions sign them.
    secret: bytes | None = None

    @abstractmethod
    def prefill_body(self, body: dict[str, Any], pair: PDPair) -> dict[str, Any]: ...

    @abstractmethod
    def decode_body(
        self, body: dict[str, Any], pair: PDPair, prefill_response: dict[str, Any] | None
    ) -> dict[str, Any]: ...


PD_ADAPTERS: Registry[type[PDAdapter]] = Registry("PD protocol")


def register_pd_adapter(name: str) -> Callable[[type[PDAdapter]], type[PDAdapter]]:
    """Class decorator: `--pd-protocol NAME` shapes requests with this class (which then knows its name)."""

    def wrap(cls: type[PDAdapter]) -> type[PDAdapter]:
        cls.name = name
        return PD_ADAPTERS.register(name)(cls)

    return wrap


def make_pd_adapter(name: str, secret: bytes | None = None) -> PDAdapter:
    """A new adapter; an UnknownNameError (a ValueError) naming the known ones for an unknown `name`."""
    adapter = PD_ADAPTERS.get(name)()
    adapter.secret = secret
    return adapter


def one_token_request(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill side's body: same prompt, one token, not streamed."""
    out = dict(body)
    out["stream"] = False
    out.pop("stream_options", None)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    if "input" in out and "messages" not in out and "prompt" not in out:
        # A Responses request: its budget has its own name, and the one-token answer is not worth storing.
        out["max_output_tokens"] = 1
        out["store"] = False
    return out


@register_pd_adapter("hearth")
class HearthPDAdapter(PDAdapter):
    """Instructions signed with the deployment secret: Hearth servers follow no other (a client's own
    `kv_transfer` field is refused), and a prefill server sends KV only to the decode server named here."""

    def _signed(self, role: str, transfer_id: str, peer_url: str) -> dict[str, Any]:
        if self.secret is None:
            return {}
        return sign_instruction(self.secret, role, transfer_id, peer_url)

    def prefill_body(self, body: dict[str, Any], pair: PDPair) -> dict[str, Any]:
        out = one_token_request(body)
        out["kv_transfer"] = {
            "role": "prefill",
            "transfer_id": pair.transfer_id,
            "decode_url": pair.decode.url,
            **self._signed("prefill", pair.transfer_id, pair.decode.url),
        }
        return out

    def decode_body(
        self, body: dict[str, Any], pair: PDPair, prefill_response: dict[str, Any] | None
    ) -> dict[str, Any]:
        out = dict(body)
        out["kv_transfer"] = {
            "role": "decode",
            "transfer_id": pair.transfer_id,
            "prefill_url": pair.prefill.url,
            **self._signed("decode", pair.transfer_id, pair.prefill.url),
        }
        return out


@register_pd_adapter("sglang")
class SGLangPDAdapter(PDAdapter):
    def _with_bootstrap(self, body: dict[str, Any], pair: PDPair) -> dict[str, Any]:
        out = dict(body)
        out["bootstrap_host"] = pair.prefill.host
        out["bootstrap_port"] = pair.prefill.bootstrap_port
        out["bootstrap_room"] = pair.room
        return out

    def prefill_body(self, body: dict[str, Any], pair: PDPair) -> dict[str, Any]:
        return self._with_bootstrap(body, pair)

    def decode_body(
        self, body: dict[str, Any], pair: PDPair, prefill_response: dict[str, Any] | None
    ) -> dict[str, Any]:
        return self._with_bootstrap(body, pair)


@register_pd_adapter("vllm")
class VLLMPDAdapter(PDAdapter):
    sequential = True

    def prefill_body(self, body: dict[str, Any], pair: PDPair) -> dict[str, Any]:
        out = one_token_request(body)
        out["kv_transfer_params"] = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        }
        return out

    def decode_body(
        self, body: dict[str, Any], pair: PDPair, prefill_response: dict[str, Any] | None
    ) -> dict[str, Any]:
        out = dict(body)
        params = (prefill_response or {}).get("kv_transfer_params")
        if isinstance(params, dict):
            out["kv_transfer_params"] = params
        return out
