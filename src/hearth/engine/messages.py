"""What crosses the boundary between the API side and the engine core: typed, self-serializing messages.

The engine core (scheduler, KV, workers) never sees text: it takes `EngineRequest`s and aborts and
gives back `CoreOutput`s, token ids only. Detokenization and stop strings happen on the API side
(`hearth.engine.output_processor`), which asks the core to abort a request once a stop string ends it.
Every message is a msgspec Struct, so the same objects are passed by reference in one process (`LLM`)
and encoded once per batch between processes (`hearth serve`).
"""

from __future__ import annotations

import msgspec

from hearth.engine.outputs import FinishReason, TokenLogprob
from hearth.engine.sampling_params import SamplingParams


class EngineRequest(msgspec.Struct, omit_defaults=True):
    """Add a request. The core validates it (prompt length, token ids, grammar) and rejects it with a
    `CoreOutput` whose `rejected_param` names the offending parameter."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None


class CoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """One step's new tokens of one request (any number: speculative decoding appends several).

    `finish_reason` is set on the request's last output: "stop" for EOS, a stop token, or a completed
    grammar (`stop_reason` is the stop token id, else None), "length", "abort" or "error" (`error` says why).
    `rejected_param` is set when `add` refused the request before it ran (then `error` is the message).
    """

    request_id: str
    new_token_ids: list[int]
    num_prompt_tokens: int
    num_cached_tokens: int
    new_logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None
    error: str | None = None
    rejected_param: str | None = None
    ends_with_stop_token: bool = False  # the last token is EOS or a stop token: counted, not shown as text

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class AbortRequests(msgspec.Struct, omit_defaults=True):
    request_ids: list[str]
    reason: str = "aborted"
