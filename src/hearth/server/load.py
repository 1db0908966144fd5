"""In-flight token load, reported at `GET /load` for the router's token-aware balancing."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _Sequence:
    prefill_tokens: int  # prompt tokens not yet past their first token (uncached share unknown until then)
    decode_tokens: int  # context held by a running decode


class LoadTracker:
    """Server-side estimate of prefill and decode tokens in flight, from the server's own requests."""

    def __init__(self) -> None:
        self._sequences: dict[str, _Sequence] = {}
        self.prefill_tokens = 0
        self.decode_tokens = 0

    def start(self, request_id: str, prompt_tokens: int) -> None:
        self._sequences[request_id] = _Sequence(prompt_tokens, 0)
        self.prefill_tokens += prompt_tokens

    def progress(self, request_id: str, context_tokens: int) -> None:
        seq = self._sequences.get(request_id)
        if seq is None:
            return
        self.prefill_tokens -= seq.prefill_tokens
        self.decode_tokens += context_tokens - seq.decode_tokens
        seq.prefill_tokens = 0
        seq.decode_tokens = context_tokens

    def finish(self, request_id: str) -> None:
        seq = self._sequences.pop(request_id, None)
        if seq is not None:
            self.prefill_tokens -= seq.prefill_tokens
            self.decode_tokens -= seq.decode_tokens
