"""Shutdown that ends every request with an answer the client can read.

uvicorn alone waits `timeout_graceful_shutdown`, then cancels what still runs: non-streamed requests got
a text/plain 500 and streams were cut with no error event and no `[DONE]` (and each cancelled task logged a
traceback). Here the server waits up to `--shutdown-timeout` for in-flight requests, then aborts the rest
in the engine with a reason, so each handler answers normally: a JSON 503 (`code: aborted`) for a
non-streamed request, an SSE error event and `data: [DONE]` for a stream. Only then does uvicorn close the
connections, with a few seconds for those last answers to be written.
"""

from __future__ import annotations

import asyncio
import logging
import socket

import uvicorn

from hearth.server.state import ServerState

logger = logging.getLogger("hearth.server")

SHUTDOWN_REASON = "the server is shutting down and this request did not finish within --shutdown-timeout"
# After the aborts, how long uvicorn waits for the error answers to go out before it cancels what is left.
FLUSH_TIMEOUT_S = 5


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_timeout_s: float) -> None:
        super().__init__(config)
        self._state = state
        self._shutdown_timeout_s = shutdown_timeout_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        state = self._state
        state.admission.draining = True  # new requests get 503 shutting_down
        for server in self.servers:
            server.close()  # and no new connections
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._shutdown_timeout_s
        if state.live:
            logger.info(
                "waiting up to %g s for %d requests to finish", self._shutdown_timeout_s, len(state.live)
            )
        while state.live and loop.time() < deadline and not self.force_exit:
            await asyncio.sleep(0.05)
        if state.live:
            logger.warning(
                "%d requests still running after --shutdown-timeout %g s; ending them with an error",
                len(state.live),
                self._shutdown_timeout_s,
            )
            for generation in list(state.live):
                await generation.cancel(SHUTDOWN_REASON)
        await super().shutdown(sockets)


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads so a port in use is reported at once (OSError)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock
