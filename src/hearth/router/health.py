"""Health checks and load-report polling, one loop for the whole pool.

Every `interval_s` each worker gets `GET /health` (timeout `timeout_s`); one failure takes it
out, one success puts it back. A probe that only timed out does not take out a worker that
answered proxied traffic within the last round: a busy worker (or a busy router loop) is slow to
answer probes, not dead. A refused connection or a bad status always counts. Healthy workers that offer `GET /load` are polled in the same
round; a 404 means no report is offered, and the worker is not asked again until it restarts.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

from hearth.router.workers import LoadReport, Worker, WorkerPool

log = logging.getLogger(__name__)


class HealthChecker:
    def __init__(
        self, pool: WorkerPool, session: aiohttp.ClientSession, interval_s: float, timeout_s: float
    ) -> None:
        self.pool = pool
        self.session = session
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            workers = list(self.pool.workers.values())
            if workers:
                await asyncio.gather(*(self.check(w) for w in workers))
            await asyncio.sleep(self.interval_s)

    async def check(self, worker: Worker) -> None:
        outcome = await self._probe_health(worker)
        alive = outcome == "ok"
        if (
            outcome == "timeout"
            and time.monotonic() - worker.last_ok_s < self.interval_s + 2 * self.timeout_s
        ):
            alive = worker.healthy
        if worker.url not in self.pool.workers:
            return  # removed while we were asking
        if self.pool.set_healthy(worker, alive):
            log.warning("worker %s is %s", worker.url, "back" if alive else "down")
        if alive and worker.offers_load_report is not False:
            await self._poll_load(worker)

    async def _probe_health(self, worker: Worker) -> str:
        """ "ok", "timeout" or "failed"."""
        try:
            async with self.session.get(worker.url + "/health", timeout=self.timeout) as resp:
                await resp.read()
                return "ok" if resp.status == 200 else "failed"
        except asyncio.TimeoutError:
            return "timeout"
        except (aiohttp.ClientError, OSError):
            return "failed"

    async def _poll_load(self, worker: Worker) -> None:
        try:
            async with self.session.get(worker.url + "/load", timeout=self.timeout) as resp:
                if resp.status == 404:
                    worker.offers_load_report = False
                    return
                if resp.status != 200:
                    return
                data = await resp.json(content_type=None)
            worker.load.report = LoadReport.from_json(
                data, worker.load.prefill_tokens, worker.load.decode_tokens
            )
            worker.offers_load_report = True
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError, AttributeError) as exc:
            log.debug("load report from %s unusable: %s", worker.url, exc)
