"""Admission control: a bounded number of sequences in flight; beyond it the server answers 429."""

from __future__ import annotations

from hearth.server.errors import APIError


class AdmissionController:
    """Admits up to `max_running_seqs + max_waiting_seqs` sequences (a request with `n` choices counts n).

    The engine runs `max_running_seqs` at once; the rest wait in its queue. Refusing past the bound keeps
    queueing delay bounded and tells clients (and the router) to back off or go elsewhere.
    """

    def __init__(self, max_running_seqs: int, max_waiting_seqs: int, retry_after_s: int = 1) -> None:
        self.max_in_flight = max_running_seqs + max_waiting_seqs
        self.retry_after_s = retry_after_s
        self.in_flight = 0
        self.draining = False

    def check_can_ever_admit(self, num_seqs: int, param: str) -> None:
        """400, not a retryable 429, for a request with more sequences than the server ever admits at once:
        a client that retries it would retry forever."""
        if num_seqs > self.max_in_flight:
            raise APIError(
                f"the request needs {num_seqs} sequences (prompts x n); this server admits at most "
                f"{self.max_in_flight} at once (--max-num-seqs + --max-queued-requests); split it",
                400,
                "invalid_request_error",
                param=param,
                code="too_many_sequences",
            )

    def acquire(self, num_seqs: int) -> None:
        if self.draining:
            raise APIError(
                "the server is shutting down",
                503,
                "service_unavailable",
                code="shutting_down",
                headers={"Retry-After": str(self.retry_after_s)},
            )
        if self.in_flight + num_seqs > self.max_in_flight:
            raise APIError(
                f"server busy: {self.in_flight} sequences in flight, limit {self.max_in_flight}; retry later",
                429,
                "rate_limit_error",
                code="queue_full",
                headers={"Retry-After": str(self.retry_after_s)},
            )
        self.in_flight += num_seqs

    def release(self, num_seqs: int) -> None:
        self.in_flight = max(0, self.in_flight - num_seqs)
