"""The servers' side of prefill/decode disaggregation (docs/pd-protocol.md), in the API process.

The router's `kv_transfer` field becomes the engine request's `KVTransferParams` when it matches this
server's `--role`; otherwise it is ignored and the server computes the prompt itself. It is followed only
if the router signed it with the deployment's secret (`hearth.kv_transfer.auth`): a client that writes
its own `kv_transfer` (say, a `decode_url` of its own "decode server") gets a 403 and nothing moves. A prefill server
finds where to send the KV by asking the decode server (`GET {decode_url}/kv_transfer/endpoint`, cached
per decode server); the engine core does the transfer itself.
"""

from __future__ import annotations

import logging
import time
from urllib.parse import urlsplit

import httpx

from hearth.engine.messages import KVTransferParams
from hearth.kv_transfer.auth import MissingSecretError, deployment_secret, instruction_refusal
from hearth.server.errors import APIError
from hearth.server.protocol import SamplingRequest
from hearth.server.state import ServerState

logger = logging.getLogger("hearth.server")

ENDPOINT_PATH = "/kv_transfer/endpoint"
LOOKUP_TIMEOUT_S = 5.0
# A decode server that restarts listens on a new port: answers are trusted this long, then asked again.
ENDPOINT_TTL_S = 30.0


class KVPeers:
    """Decode servers' KV transport endpoints, by their base URL."""

    def __init__(self, transport: str) -> None:
        self.transport = transport
        self._endpoints: dict[str, tuple[str, float]] = {}  # decode URL -> (endpoint, when asked)
        self._client: httpx.AsyncClient | None = None

    async def endpoint(self, decode_url: str) -> str | None:
        known = self._endpoints.get(decode_url)
        if known is not None and time.monotonic() - known[1] < ENDPOINT_TTL_S:
            return known[0]
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=LOOKUP_TIMEOUT_S)
        try:
            response = await self._client.get(decode_url.rstrip("/") + ENDPOINT_PATH)
            response.raise_for_status()
            answer = response.json()
        except (httpx.HTTPError, ValueError) as exc:
            logger.warning("no KV endpoint from decode server %s: %s", decode_url, exc)
            return None
        if answer.get("transport") != self.transport or not answer.get("endpoint"):
            logger.warning(
                "decode server %s uses KV transport %r, this server %r: nothing is sent",
                decode_url,
                answer.get("transport"),
                self.transport,
            )
            return None
        endpoint = reachable(str(answer["endpoint"]), decode_url)
        self._endpoints[decode_url] = (endpoint, time.monotonic())
        return endpoint

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()


def reachable(endpoint: str, decode_url: str) -> str:
    """A decode server bound to every address (0.0.0.0) is reached at its HTTP host. A parallel decode
    server advertises one endpoint per rank, comma-separated, then `;` and its parallel layout."""
    endpoints, sep, layout = endpoint.partition(";")
    parts = []
    for part in endpoints.split(","):
        scheme, _, address = part.partition("://")
        host, _, port = address.rpartition(":")
        if host in ("0.0.0.0", "[::]", "::"):
            host = urlsplit(decode_url).hostname or "127.0.0.1"
        parts.append(f"{scheme}://{host}:{port}")
    return ",".join(parts) + sep + layout


async def engine_kv_transfer(
    state: ServerState, request: SamplingRequest, num_choices: int
) -> KVTransferParams | None:
    """This server's part in the request's PD transfer, or None (then it computes everything itself)."""
    spec = request.kv_transfer
    if spec is None:
        return None
    role = state.config.role
    if spec.role != role or num_choices != 1:
        logger.info(
            "kv_transfer role %r ignored (this server's role is %r, %d choices): computing the prompt here",
            spec.role,
            role,
            num_choices,
        )
        return None
    peer_url = (spec.decode_url if role == "prefill" else spec.prefill_url) or ""
    try:
        refusal = instruction_refusal(
            deployment_secret(), role, spec.transfer_id, peer_url, spec.expires, spec.signature
        )
    except MissingSecretError as exc:
        refusal = str(exc)
    if refusal is not None:
        raise APIError(refusal, 403, "permission_error", "kv_transfer", "kv_transfer_unauthenticated")
    if role == "decode":
        return KVTransferParams("decode", spec.transfer_id)
    peers: KVPeers | None = state.kv_peers
    endpoint = await peers.endpoint(spec.decode_url) if peers is not None and spec.decode_url else None
    return KVTransferParams("prefill", spec.transfer_id, endpoint)
