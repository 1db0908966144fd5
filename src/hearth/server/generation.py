"""Shared by chat and completions: sampling params from a request, context checks, running n choices on the
engine as one merged stream, per-request bookkeeping (admission, load, metrics), usage and logprobs."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from hearth.engine.kv_integrity import KV_INTEGRITY_ERROR
from hearth.engine.messages import KVTransferParams
from hearth.engine.outputs import RequestOutput, TokenLogprob
from hearth.engine.request import CACHE_SOURCES
from hearth.engine.sampling_params import InvalidParamError, SamplingParams
from hearth.engine.structured_output import StructuredOutput
from hearth.server.errors import APIError, bad_request
from hearth.server.protocol import SamplingRequest
from hearth.server.state import ServerState

logger = logging.getLogger("hearth.server")


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def resolve_max_tokens(
    requested: int | None, prompt_tokens: int, max_model_len: int, default: int | None, prompt_param: str
) -> int:
    """The answer's token budget; a prompt or budget past the context is the client's error (400)."""
    room = max_model_len - prompt_tokens
    if room < 1:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens, and the prompt has {prompt_tokens} "
            "tokens, which leaves no room for an answer. Shorten the prompt.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if requested is None:
        return room if default is None else min(default, room)
    if requested > room:
        raise bad_request(
            f"max_tokens is {requested}, but the prompt has {prompt_tokens} tokens and this model's maximum "
            f"context length is {max_model_len} tokens; ask for at most {room}.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return requested


def _vllm_structured_output(request: SamplingRequest) -> tuple[str, StructuredOutput] | None:
    """vLLM's `structured_outputs` / `guided_*` as the engine's spec, with the field that asked for it."""
    given: list[tuple[str, str, Any]] = []
    if request.structured_outputs is not None:
        spec = request.structured_outputs
        for kind, value in (
            ("json", spec.json_),
            ("regex", spec.regex),
            ("choice", spec.choice),
            ("grammar", spec.grammar),
            ("json_object", spec.json_object or None),
        ):
            if value is not None:
                given.append(("structured_outputs", kind, value))
    for kind in ("json", "regex", "choice", "grammar"):
        value = getattr(request, f"guided_{kind}")
        if value is not None:
            given.append((f"guided_{kind}", kind, value))
    if not given:
        return None
    if len(given) > 1 or request.response_format is not None and request.response_format.type != "text":
        raise bad_request(
            "give one constraint: response_format, structured_outputs or one guided_* field", given[-1][0]
        )
    field_name, kind, value = given[0]
    if kind == "json_object":
        return field_name, StructuredOutput.json_object()
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise bad_request(f"{field_name}: not a JSON schema: {exc}", field_name) from exc
        if not isinstance(value, dict):
            raise bad_request(f"{field_name}: a JSON schema must be an object", field_name)
        return field_name, StructuredOutput.json_schema(value)
    if kind == "regex":
        return field_name, StructuredOutput.lark_grammar("start: /" + value.replace("/", "\\/") + "/")
    if kind == "choice":
        return field_name, StructuredOutput.lark_grammar("start: " + " | ".join(json.dumps(c) for c in value))
    return field_name, StructuredOutput.lark_grammar(value)


def structured_output(request: SamplingRequest) -> StructuredOutput | None:
    """The request's `response_format` (or vLLM's `structured_outputs`/`guided_*`) as the engine's spec (one
    per request: its choices share it)."""
    vllm_spec = _vllm_structured_output(request)
    if vllm_spec is not None:
        field_name, spec = vllm_spec
        try:
            spec.validate()
        except ValueError as exc:
            raise bad_request(f"{field_name}: {exc}", field_name) from exc
        return spec
    response_format = request.response_format
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredOutput.json_object()
    spec = response_format.json_schema
    assert spec is not None and spec.schema_ is not None  # the protocol model checks it
    return StructuredOutput.json_schema(spec.schema_, strict=bool(spec.strict), name=spec.name)


def sampling_params(
    request: SamplingRequest,
    max_tokens: int,
    logprobs: int | None,
    extra_stop: list[str] | None = None,
    skip_special_tokens: bool | None = None,
    choice_index: int = 0,
    structured: StructuredOutput | None = None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    try:
        logit_bias = request.logit_bias_ids
    except ValueError as exc:
        raise bad_request(str(exc), "logit_bias", code="invalid_value") from exc
    seed = request.seed
    if seed is not None and choice_index:
        seed += choice_index  # n seeded choices would otherwise all be the same answer
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            top_k=request.top_k or 0,
            min_p=request.min_p or 0.0,
            seed=seed,
            presence_penalty=request.presence_penalty or 0.0,
            frequency_penalty=request.frequency_penalty or 0.0,
            repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
            stop=stop + list(extra_stop or []),
            stop_token_ids=list(request.stop_token_ids or []),
            ignore_eos=request.ignore_eos,
            logprobs=logprobs,
            include_stop_str_in_output=request.include_stop_str_in_output,
            skip_special_tokens=request.skip_special_tokens
            if skip_special_tokens is None
            else skip_special_tokens,
            min_tokens=request.min_tokens,
            structured_output=structured,
            logit_bias=logit_bias,
            prompt_logprobs=request.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
        )
    except InvalidParamError as exc:
        raise bad_request(str(exc), param=exc.param, code="invalid_value") from exc


def check_logit_bias(request: SamplingRequest, vocab_size: int) -> None:
    """Every `logit_bias` key a token id of this model (400 naming the field otherwise)."""
    if not request.logit_bias:
        return
    try:
        bias = request.logit_bias_ids or {}
    except ValueError as exc:
        raise bad_request(str(exc), "logit_bias", code="invalid_value") from exc
    if max(bias) >= vocab_size:
        raise bad_request(
            f"logit_bias: token id {max(bias)} is not below the vocabulary size {vocab_size}",
            "logit_bias",
            code="invalid_value",
        )


def prompt_logprobs_entries(
    state: ServerState, prompt: list[int], entries: list[TokenLogprob] | None
) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: None for the first token, then {token id: {logprob, rank, decoded_token}}
    with the prompt token and its top alternatives."""
    result: list[dict[str, Any] | None] = [None]
    for item in entries or []:
        entry = {
            str(item.token_id): {
                "logprob": max(item.logprob, -9999.0),
                "rank": item.rank,
                "decoded_token": state.token_text(item.token_id),
            }
        }
        for rank, (token_id, logprob) in enumerate(item.top, start=1):
            entry.setdefault(
                str(token_id),
                {"logprob": max(logprob, -9999.0), "rank": rank, "decoded_token": state.token_text(token_id)},
            )
        result.append(entry)
    return result


def usage_dict(
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int,
    cached_tokens_by_source: dict[str, int] | None = None,
) -> dict[str, Any]:
    details: dict[str, Any] = {"cached_tokens": cached_tokens}
    if cached_tokens_by_source is not None:
        # A Hearth extension (docs/server.md "Cache accounting"); every API reports the same object.
        details["cached_tokens_by_source"] = cached_tokens_by_source
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": details,
    }


def _by_source(choices: Any) -> dict[str, int]:
    totals = [0] * len(CACHE_SOURCES)
    for choice in choices:
        for index, num_tokens in enumerate(choice.cached_tokens_by_source or ()):
            totals[index] += num_tokens
    return dict(zip(CACHE_SOURCES, totals, strict=True))


@dataclass
class _Choice:
    request_id: str
    prompt_tokens: int
    first_token_s: float | None = None
    last_token_s: float | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    cached_tokens_by_source: tuple[int, int, int, int] | None = None
    finished: bool = False
    queue_time_s: float = 0.0  # in the engine before it first ran (the engine reports it once)


@dataclass(eq=False)  # kept in a set (ServerState.live): identity, not field equality
class Generation:
    """One API request's engine requests (one per choice and prompt) and their bookkeeping.

    `close()` releases everything exactly once, whether the request finished, failed, or the client left.
    """

    state: ServerState
    request_id: str
    prompts: list[list[int]]  # one token list per choice
    params: list[SamplingParams]
    cache_salt: str | None
    prompt_index: list[int] | None = None  # which prompt each choice answers (n choices share one prompt)
    kv_transfer: KVTransferParams | None = None  # PD: this server's part (one choice only)
    arrival_s: float = field(default_factory=time.perf_counter)
    kv_transfer_status: str | None = None
    _choices: list[_Choice] = field(default_factory=list)
    _admitted: bool = False
    _closed: bool = False

    def __post_init__(self) -> None:
        many = len(self.prompts) > 1
        self._choices = [
            _Choice(f"{self.request_id}-{i}" if many else self.request_id, len(prompt))
            for i, prompt in enumerate(self.prompts)
        ]

    def admit(self) -> None:
        self.state.admission.check_can_ever_admit(len(self.prompts), "n")
        try:
            self.state.admission.acquire(len(self.prompts))
        except APIError:
            self.state.metrics.rejected.inc()
            raise
        self._admitted = True
        if self.state.config.log_requests:  # --enable-log-requests
            logger.info(
                "request %s: %d choice(s), prompt tokens %s, params %s",
                self.request_id,
                len(self.prompts),
                [len(prompt) for prompt in self.prompts],
                self.params[0],
            )
        self.state.live.add(self)
        metrics = self.state.metrics
        metrics.request_params_n.observe(len(self.prompts))
        if self.params[0].max_tokens is not None:
            metrics.request_params_max_tokens.observe(self.params[0].max_tokens)
        for choice in self._choices:
            self.state.load.start(choice.request_id, choice.prompt_tokens)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.state.live.discard(self)
        if self._admitted:
            self.state.admission.release(len(self.prompts))
        for choice in self._choices:
            self.state.load.finish(choice.request_id)
            if self._admitted and not choice.finished:
                # The client left (or the request failed) before the engine finished it: still a request.
                self.state.metrics.request_finished("abort")

    async def cancel(self, reason: str) -> None:
        """End every unfinished choice now with an "abort" output carrying `reason` (shutdown past its
        timeout): the handlers then answer with an error the client can read, not a cut connection."""
        engine = self.state.engine
        if engine is None:
            return
        for choice in self._choices:
            if not choice.finished:
                await engine.abort(choice.request_id, reason)

    def kv_transfer_answer(self) -> dict[str, Any] | None:
        """The prefill side's `kv_transfer` answer field (docs/pd-protocol.md), or None."""
        transfer = self.kv_transfer
        if transfer is None or transfer.role != "prefill":
            return None
        return {
            "transfer_id": transfer.transfer_id,
            "status": self.kv_transfer_status or "failed",
            "num_tokens": self._choices[0].prompt_tokens if self.kv_transfer_status == "sent" else 0,
        }

    def usage(self) -> dict[str, Any]:
        """Usage as OpenAI counts it: each prompt once (its first choice's cache hits), every answer token."""
        groups = self.prompt_index or [0] * len(self._choices)
        firsts = {}
        for group, choice in zip(groups, self._choices, strict=False):
            firsts.setdefault(group, choice)
        prompt_tokens = sum(choice.prompt_tokens for choice in firsts.values())
        cached_tokens = sum(choice.cached_tokens for choice in firsts.values())
        completion_tokens = sum(choice.completion_tokens for choice in self._choices)
        return usage_dict(prompt_tokens, completion_tokens, cached_tokens, _by_source(firsts.values()))

    def _observe(self, index: int, output: RequestOutput) -> None:
        choice = self._choices[index]
        now = time.perf_counter()
        metrics = self.state.metrics
        num_new = len(output.new_token_ids)
        if output.queue_time_s is not None:
            choice.queue_time_s = output.queue_time_s
            metrics.queue_time_s.observe(output.queue_time_s)
        if num_new:
            if choice.first_token_s is None:
                choice.first_token_s = now
                metrics.ttft_s.observe(now - self.arrival_s)
            elif choice.last_token_s is not None:
                gap_s = (now - choice.last_token_s) / num_new
                for _ in range(num_new):
                    metrics.inter_token_latency_s.observe(gap_s)
            choice.last_token_s = now
        choice.completion_tokens = output.completion_tokens
        choice.cached_tokens = output.cached_tokens
        if output.cached_tokens_by_source is not None:
            choice.cached_tokens_by_source = output.cached_tokens_by_source
        choice.prompt_tokens = output.prompt_tokens
        if output.kv_transfer_status is not None:
            self.kv_transfer_status = output.kv_transfer_status
        self.state.load.progress(choice.request_id, output.prompt_tokens + output.completion_tokens)
        if output.finished:
            choice.finished = True
            self.state.load.finish(choice.request_id)
            metrics.e2e_latency_s.observe(now - self.arrival_s)
            metrics.request_finished(output.finish_reason or "unknown")
            self._observe_phases(choice)

    def _observe_phases(self, choice: _Choice) -> None:
        """vLLM's per-request histograms, once a choice has finished: queue, prefill, decode, inference."""
        metrics = self.state.metrics
        metrics.request_prompt_tokens.observe(choice.prompt_tokens)
        metrics.request_generation_tokens.observe(choice.completion_tokens)
        if choice.first_token_s is not None and choice.last_token_s is not None:
            prefill_s = max(0.0, choice.first_token_s - self.arrival_s - choice.queue_time_s)
            decode_s = choice.last_token_s - choice.first_token_s
            metrics.prefill_time_s.observe(prefill_s)
            metrics.decode_time_s.observe(decode_s)
            metrics.inference_time_s.observe(prefill_s + decode_s)
            if choice.completion_tokens > 1:
                metrics.time_per_output_token_s.observe(decode_s / (choice.completion_tokens - 1))
        if all(other.finished for other in self._choices):
            metrics.request_max_num_generation_tokens.observe(max(c.completion_tokens for c in self._choices))

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Every choice's outputs, merged in arrival order, as (choice index, output).

        Leaving early (client gone, error) closes the engine streams, which aborts their requests.
        """
        engine = self.state.require_engine()
        kv_transfer = self.kv_transfer if len(self.prompts) == 1 else None
        streams = [
            engine.generate(prompt, params, choice.request_id, self.cache_salt, kv_transfer)
            for prompt, params, choice in zip(self.prompts, self.params, self._choices, strict=False)
        ]
        if len(streams) == 1:
            stream = streams[0]
            try:
                async for output in stream:
                    self._observe(0, output)
                    yield 0, output
            finally:
                await stream.aclose()
            return
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
            try:
                async for output in stream:
                    queue.put_nowait((index, output))
            except Exception as exc:  # delivered to the consumer, which decides
                queue.put_nowait((index, exc))
            finally:
                queue.put_nowait((index, None))

        tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
        try:
            remaining = len(tasks)
            while remaining:
                index, item = await queue.get()
                if item is None:
                    remaining -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                self._observe(index, item)
                yield index, item
        finally:
            for task in tasks:
                task.cancel()
            for task, stream in zip(tasks, streams, strict=False):
                with contextlib.suppress(BaseException):
                    await task
                with contextlib.suppress(BaseException):
                    await stream.aclose()  # type: ignore[attr-defined]


def engine_failure(output: RequestOutput) -> APIError | None:
    """An aborted or failed engine request, as the error the client should see."""
    if output.finish_reason == "error" and output.error_code == KV_INTEGRITY_ERROR:
        return APIError(
            f"the KV cache of this request failed its integrity check; retry it: {output.error}",
            500,
            "internal_error",
            code=KV_INTEGRITY_ERROR,
        )
    if output.finish_reason == "error":
        # The engine's reason may carry internal state (a grammar's dump): logged, and only its first
        # line goes to the client.
        logger.warning("request %s failed in the engine: %s", output.request_id, output.error)
        first_line = (output.error or "unknown error").splitlines()[0][:200]
        return APIError(f"the engine failed this request: {first_line}", 500, "internal_error")
    if output.finish_reason == "abort":
        return APIError(
            f"the request was aborted: {output.error or 'aborted'}",
            503,
            "service_unavailable",
            code="aborted",
        )
    return None


def engine_error(exc: Exception) -> APIError:
    """Errors the engine raises when a request is added (validation) as 400s; the rest as 500s."""
    if isinstance(exc, InvalidParamError):
        return bad_request(str(exc), param=exc.param, code="invalid_value")
    if isinstance(exc, ValueError):
        return bad_request(str(exc))
    logger.exception("engine error", exc_info=exc)
    return APIError(f"internal error: {exc}", 500, "internal_error")


# ---- logprobs ---------------------------------------------------------------------------------------


def _token_entry(state: ServerState, token_id: int, logprob: float) -> dict[str, Any]:
    text = state.token_text(token_id)
    return {"token": text, "logprob": max(logprob, -9999.0), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(state: ServerState, logprobs: list[TokenLogprob], num_top: int) -> list[dict[str, Any]]:
    entries = []
    for item in logprobs:
        entry = _token_entry(state, item.token_id, item.logprob)
        entry["top_logprobs"] = [_token_entry(state, tid, lp) for tid, lp in item.top[:num_top]]
        entries.append(entry)
    return entries


@dataclass
class CompletionLogprobs:
    """The legacy completions logprobs object, built up as tokens arrive."""

    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[str, float]] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def add(self, state: ServerState, logprobs: list[TokenLogprob], num_top: int, offset: int) -> int:
        for item in logprobs:
            text = state.token_text(item.token_id)
            self.tokens.append(text)
            self.token_logprobs.append(max(item.logprob, -9999.0))
            self.top_logprobs.append(
                {state.token_text(tid): max(lp, -9999.0) for tid, lp in item.top[:num_top]}
            )
            self.text_offset.append(offset)
            offset += len(text)
        return offset

    def add_prompt(
        self, state: ServerState, prompt: list[int], entries: list[TokenLogprob] | None, num_top: int
    ) -> int:
        """`echo` + `logprobs`: the prompt's tokens first, the first one with no logprob (OpenAI's shape)."""
        offset = 0
        for index, token_id in enumerate(prompt):
            text = state.token_text(token_id)
            self.tokens.append(text)
            self.text_offset.append(offset)
            offset += len(text)
            item = entries[index - 1] if index and entries and index - 1 < len(entries) else None
            if item is None:
                self.token_logprobs.append(None)  # type: ignore[arg-type]
                self.top_logprobs.append(None)  # type: ignore[arg-type]
                continue
            self.token_logprobs.append(max(item.logprob, -9999.0))
            top = {state.token_text(tid): max(lp, -9999.0) for tid, lp in item.top[:num_top]}
            self.top_logprobs.append(top)
        return offset

    def as_dict(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }
