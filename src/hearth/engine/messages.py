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


class KVTransferParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """A request's part in a PD transfer: "decode" (its prompt's KV arrives under `transfer_id`) or
    "prefill" (send its prompt's KV to the decode server's transport endpoint `peer` when it ends)."""

    role: str
    transfer_id: str
    peer: str | None = None


class EngineRequest(msgspec.Struct, tag=True, omit_defaults=True):
    """Add a request. The core validates it (prompt length, token ids, grammar) and rejects it with a
    `CoreOutput` whose `rejected_param` names the offending parameter."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    kv_transfer: KVTransferParams | None = None


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
    error_code: str | None = None  # with "error": a code for clients, e.g. "kv_integrity_error"
    kv_transfer_status: str | None = None  # PD prefill side, last output: "sent" or "failed"
    prompt_logprobs: list[TokenLogprob] | None = None  # with the first output (hearth.engine.prompt_logprobs)
    queue_time_s: float | None = (
        None  # with the first output: seconds it waited before it was first scheduled
    )
    # Prompt tokens per source (hearth.engine.request.CACHE_SOURCES); device + tier + store = cached.
    cached_tokens_by_source: tuple[int, int, int, int] | None = None

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
    # Speculative decoding (hearth.engine.speculative): the method ("" when off) and its counters.
    spec_method: str = ""
    spec_num_drafts_total: int = 0  # verified rows that carried drafts
    spec_draft_tokens_total: int = 0
    spec_accepted_tokens_total: int = 0
    kv_integrity_failures_total: int = 0  # request-steps whose page tags did not match
    kv_transfer_failures_total: int = 0  # PD transfers that failed here (sends, or loads recomputed)
    kv_recomputed_tokens_total: int = 0  # tokens promised from elsewhere (peer, tier) and recomputed
    kv_transfer_pages_total: int = 0  # pages sent plus received
    kv_tokens_total: int = 0  # tokens the KV cache holds (pages x page size): doubles with FP8 KV
    kv_tiers: list[TierStats] = msgspec.field(default_factory=list)  # per tier below the device
    # Tool-pause retention (hearth.engine.retention)
    retained_pages: int = 0
    retained_sessions: int = 0
    retention_expired_total: int = 0
    retention_evicted_total: int = 0
    retention_replaced_total: int = 0
    retention_yielded_total: int = 0


class ShutdownCore(msgspec.Struct, tag=True):
    """Abort whatever is still running (with `reason`), send the last outputs, and exit 0."""

    reason: str = "server shutting down"


class CoreReady(msgspec.Struct, tag=True, array_like=True):
    """The core loaded the model and takes requests; what the API process needs to know of it."""

    max_model_len: int
    num_kv_tokens: int
    vocab_size: int
    stats: EngineStats
    kv_transfer_endpoint: str | None = None  # decode role: where prefill servers send KV


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
