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
from hearth.kv.tiers.stats import TierStats


class EngineRequest(msgspec.Struct, tag=True, omit_defaults=True):
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


class AbortRequests(msgspec.Struct, tag=True, omit_defaults=True):
    request_ids: list[str]
    reason: str = "aborted"


# ---- between the API process and the engine-core process (`hearth serve`) ---------------------------


class EngineStats(msgspec.Struct):
    """The engine's gauges and counters, pushed by the core with its outputs (`/metrics`, `/load`)."""

    num_running: int
    num_waiting: int
    kv_pages_used: int
    kv_pages_total: int
    prefix_cache_queries_tokens: int
    prefix_cache_hit_tokens: int
    prompt_tokens_total: int
    cached_tokens_total: int
    generation_tokens_total: int
    num_preemptions_total: int
    kv_tiers: list[TierStats] = msgspec.field(default_factory=list)  # per tier below the device


class ShutdownCore(msgspec.Struct, tag=True):
    """Abort whatever is still running (with `reason`), send the last outputs, and exit 0."""

    reason: str = "server shutting down"


class CoreReady(msgspec.Struct, tag=True, array_like=True):
    """The core loaded the model and takes requests; what the API process needs to know of it."""

    max_model_len: int
    num_kv_tokens: int
    vocab_size: int
    stats: EngineStats


class CoreFailed(msgspec.Struct, tag=True, array_like=True):
    """The core could not start (the model did not load); it exits 1 after sending this."""

    error: str


class CoreOutputs(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    """Everything one pass of the core's loop produced, in one message: the step's outputs, answers to
    adds it rejected and aborts it applied, and the engine's stats as of the end of that pass."""

    outputs: list[CoreOutput]
    stats: EngineStats | None = None


ToCore = EngineRequest | AbortRequests | ShutdownCore
FromCore = CoreOutputs | CoreReady | CoreFailed
