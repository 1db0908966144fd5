"""What the engine hands back: incremental outputs for streaming, whole results for `LLM.generate`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hearth.contracts.step import TokenLogprob

__all__ = ["FinishReason", "RequestOutput", "TokenLogprob"]

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass
class RequestOutput:
    """One step's worth of a request: what is new since the previous output, and the usage so far.

    `finish_reason` is set on the last output only. `stop_reason` is the matched stop string or
    stop token id when `finish_reason == "stop"` (None for EOS). `error` explains "error"/"abort".
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    new_logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    error_code: str | None = None  # with "error": what clients see as the error's `code`
    # With the first output of a request that asked (`prompt_logprobs`): prompt tokens 1..n-1.
    prompt_logprobs: list[TokenLogprob] | None = None
    queue_time_s: float | None = None  # with the first output: seconds waiting in the engine before it ran
    kv_transfer_status: str | None = None  # PD prefill side, last output: "sent" or "failed"
    # Prompt tokens per source (hearth.engine.request.CACHE_SOURCES); device + tier + store = cached.
    cached_tokens_by_source: tuple[int, int, int, int] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class CompletionResult:
    """A finished request, as `LLM.generate` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    prompt_tokens: int
    cached_tokens: int
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None
