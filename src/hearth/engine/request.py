"""A request's state inside the engine core: tokens, pages held, progress, and how it ended (no text: see
`hearth.engine.output_processor`)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from hearth.engine.messages import KVTransferParams
from hearth.engine.outputs import FinishReason, TokenLogprob
from hearth.engine.sampling_params import SamplingParams
from hearth.engine.structured_output import GrammarMatcher

# The order of `Request.cached_tokens_by_source`: this server's prefix cache, its local tiers (host
# memory, disk), a shared store (Redis, Mooncake), and a PD peer's transfer.
CACHE_SOURCES = ("device", "tier", "store", "peer")


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"  # pages allocated, KV arriving from a peer (PD) or a lower cache tier
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prefix_root: bytes
    arrival_index: int
    max_model_len: int
    grammar: GrammarMatcher | None = None  # set when the answer is constrained (structured output)
    kv_transfer: KVTransferParams | None = (
        None  # its part in a PD transfer (hearth.engine.kv_connectors.peer)
    )

    token_ids: list[int] = field(init=False)  # prompt + output, the sequence the KV cache holds
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    # Tokens proposed by a drafter (speculative decoding) before `Scheduler.schedule()`; the scheduler
    # verifies them with the request's next token when budget and pages allow; `update()` clears them.
    draft_token_ids: list[int] = field(default_factory=list)
    # KV state (see hearth.kv.manager.PageHolder)
    page_ids: list[int] = field(default_factory=list)
    page_generations: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    cached_page_count: int = 0
    # Prefix keys of the leading full pages of token_ids, extended as pages fill. Tokens are only ever
    # appended, so the keys stay valid across rollback and preemption and are never recomputed.
    page_keys: list[bytes] = field(default_factory=list)
    # KV from elsewhere (see Scheduler.add / kv_arrived)
    num_remote_kv_tokens: int = 0  # leading tokens whose KV a peer promised to send (PD decode side)
    num_pending_kv_tokens: int = 0  # while WAITING_FOR_KV: tokens past num_computed_tokens being loaded
    num_pending_tier_tokens: int = 0  # ...the leading ones of them from a lower cache tier (count as cached)
    # reporting
    cached_tokens: int | None = None  # prompt tokens served from the prefix cache at first admission
    # Where the prompt's KV came from at first admission: tokens per CACHE_SOURCES (usage reports it).
    cached_tokens_by_source: tuple[int, int, int, int] | None = None
    num_preemptions: int = 0
    num_kv_integrity_failures: int = 0  # steps whose page tags did not match (hearth.engine.kv_integrity)
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None  # the stop token id that ended it (stop strings end it on the API side)
    error: str | None = None
    # `params.prompt_logprobs`: entries for prompt positions 0.. so far, sent once (hearth.engine.prompt_logprobs)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    # Metrics (vLLM's request_queue_time_seconds): when it arrived, and how long it waited to be first scheduled.
    arrival_s: float = field(default_factory=time.monotonic)
    queue_time_s: float | None = None
    queue_time_sent: bool = False

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def max_output_tokens(self) -> int:
        room = self.max_model_len - self.num_prompt_tokens
        if self.params.max_tokens is None:
            return room
        return min(self.params.max_tokens, room)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
