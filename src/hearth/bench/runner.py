"""Drives jobs at a load shape (fixed concurrency and/or Poisson arrivals) and collects results.

Concurrency counts jobs: concurrent requests for single-request workloads, concurrent agent
sessions (clients) for agentic ones. Ctrl-C (SIGINT) or SIGTERM stops the run; what finished is kept.
"""

from __future__ import annotations

import asyncio
import math
import random
import signal
import sys
import time
from dataclasses import dataclass, field

import aiohttp

from hearth.bench.client import ClientOptions, RequestResult, RequestSpec, send_request
from hearth.bench.workloads import Job


@dataclass(frozen=True)
class LoadShape:
    max_concurrency: int | None = None  # None: unbounded
    request_rate: float = math.inf  # job arrivals per second; inf sends everything at once

    def label(self) -> str:
        parts = []
        if self.max_concurrency is not None:
            parts.append(f"c{self.max_concurrency}")
        if math.isfinite(self.request_rate):
            parts.append(f"r{self.request_rate:g}")
        return "-".join(parts) or "unbounded"


@dataclass
class RunOutcome:
    results: list[RequestResult] = field(default_factory=list)
    duration_s: float = 0.0
    interrupted: bool = False
    max_concurrent_requests: int = 0
    client_cpu_s: float = 0.0


def arrival_times_s(num_jobs: int, request_rate: float, seed: int) -> list[float]:
    """Poisson process: exponential gaps with mean 1/rate; all zero for an infinite rate."""
    if math.isinf(request_rate):
        return [0.0] * num_jobs
    if request_rate <= 0:
        raise ValueError("request rate must be positive")
    rng = random.Random(seed)
    times, now_s = [], 0.0
    for _ in range(num_jobs):
        times.append(now_s)
        now_s += rng.expovariate(request_rate)
    return times


class _Progress:
    """tqdm on stderr when wanted; imported lazily and skipped when output is not a terminal."""

    def __init__(self, total: int, enabled: bool, description: str) -> None:
        self._bar = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=description, unit="req", file=sys.stderr, leave=False)

    def update(self) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


async def run_jobs(
    jobs: list[Job],
    shape: LoadShape,
    options: ClientOptions,
    *,
    seed: int = 0,
    progress: bool = False,
    description: str = "",
    stop_event: asyncio.Event | None = None,
) -> RunOutcome:
    """Run all jobs; returns early (interrupted) on SIGINT/SIGTERM or when `stop_event` is set."""
    outcome = RunOutcome()
    if not jobs:
        return outcome
    if shape.max_concurrency is not None and shape.max_concurrency < 1:
        raise ValueError("max concurrency must be at least 1")
    semaphore = asyncio.Semaphore(shape.max_concurrency) if shape.max_concurrency else None
    fixed = [job.arrival_s for job in jobs]
    if all(t is not None for t in fixed):
        arrivals = [float(t) for t in fixed]  # type: ignore[arg-type]
    else:
        arrivals = arrival_times_s(len(jobs), shape.request_rate, seed)
    order = sorted(range(len(jobs)), key=lambda i: arrivals[i])
    bar = _Progress(sum(job.num_requests for job in jobs), progress, description)
    in_flight = 0
    stop = stop_event or asyncio.Event()
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)

    async with aiohttp.ClientSession(connector=connector, trust_env=False) as session:

        async def send(spec: RequestSpec) -> RequestResult:
            nonlocal in_flight
            in_flight += 1
            outcome.max_concurrent_requests = max(outcome.max_concurrent_requests, in_flight)
            try:
                result = await send_request(session, spec, options)
            finally:
                in_flight -= 1
            outcome.results.append(result)
            bar.update()
            return result

        async def run_job(job: Job) -> None:
            if semaphore is None:
                await job.run(send)
                return
            async with semaphore:
                await job.run(send)

        job_tasks: list[asyncio.Task[None]] = []

        async def dispatch() -> None:
            for i in order:
                delay_s = start_s + arrivals[i] - time.perf_counter()
                if delay_s > 0:
                    await asyncio.sleep(delay_s)
                job_tasks.append(asyncio.create_task(run_job(jobs[i])))
            await asyncio.gather(*job_tasks)

        loop = asyncio.get_running_loop()
        handled_signals = []
        for signum in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(signum, stop.set)
                handled_signals.append(signum)
            except (NotImplementedError, RuntimeError, ValueError):
                pass  # not the main thread (e.g. inside tests): the stop event still works
        cpu_start_s = time.process_time()
        start_s = time.perf_counter()
        dispatcher = asyncio.create_task(dispatch())
        stopper = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({dispatcher, stopper}, return_when=asyncio.FIRST_COMPLETED)
            if not dispatcher.done():
                outcome.interrupted = True
                # Requests still in flight are dropped: only finished ones are reported.
                for task in [dispatcher, *job_tasks]:
                    task.cancel()
                await asyncio.gather(dispatcher, *job_tasks, return_exceptions=True)
            else:
                dispatcher.result()
        finally:
            stopper.cancel()
            outcome.duration_s = time.perf_counter() - start_s
            outcome.client_cpu_s = time.process_time() - cpu_start_s
            for signum in handled_signals:
                loop.remove_signal_handler(signum)
            bar.close()
    return outcome
