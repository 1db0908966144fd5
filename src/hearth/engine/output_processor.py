"""Token ids from the engine core -> the outputs a client sees: text deltas, stop strings, logprobs, usage.

Runs where the client is (the API process for `hearth serve`, the caller's process for `LLM`), so the
engine core never spends its time on text. A core output may carry several tokens (speculative decoding
verifies several per step); they are detokenized one at a time, so a stop string that completes in the
middle cuts the list there, and the tokens after it are neither shown nor counted. A request that a stop
string ends is still running in the core: the caller aborts it there (`ProcessedOutputs.abort_request_ids`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hearth.engine.detokenizer import IncrementalDetokenizer
from hearth.engine.messages import CoreOutput
from hearth.engine.outputs import RequestOutput, TokenLogprob
from hearth.engine.sampling_params import SamplingParams
from hearth.engine.stop_checker import StopStringMatcher
from hearth.model.tokenizer import Tokenizer


@dataclass
class _RequestText:
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    stop_matcher: StopStringMatcher | None
    num_output_tokens: int = 0


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput] = field(default_factory=list)
    abort_request_ids: list[str] = field(
        default_factory=list
    )  # ended here by a stop string; abort in the core


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, _RequestText] = {}

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._requests[request_id] = _RequestText(
            params=params,
            detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens),
            stop_matcher=StopStringMatcher(params.stop, params.include_stop_str_in_output)
            if params.stop
            else None,
        )

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def process(self, outputs: list[CoreOutput]) -> ProcessedOutputs:
        processed = ProcessedOutputs()
        for core in outputs:
            state = self._requests.get(core.request_id)
            if state is None:  # already ended here (stop string, abort); the core's late tokens are dropped
                continue
            output = self._process_one(state, core)
            if output.finished:
                del self._requests[core.request_id]
                if core.finish_reason is None:
                    processed.abort_request_ids.append(core.request_id)
            processed.request_outputs.append(output)
        return processed

    def abort(self, request_id: str, reason: str) -> RequestOutput | None:
        """Drop a request's state; its final output (what was held back is not shown), or None if unknown."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return None
        return RequestOutput(
            request_id=request_id,
            new_token_ids=[],
            new_text="",
            prompt_tokens=0,
            cached_tokens=0,
            completion_tokens=state.num_output_tokens,
            finish_reason="abort",
            error=reason,
        )

    def _process_one(self, state: _RequestText, core: CoreOutput) -> RequestOutput:
        params = state.params
        token_ids = core.new_token_ids
        text_parts: list[str] = []
        matched: str | None = None
        num_kept = len(token_ids)
        for index, token_id in enumerate(token_ids):
            is_last = index == len(token_ids) - 1
            if is_last and core.ends_with_stop_token and not params.include_stop_str_in_output:
                break  # EOS / a stop token: counted, never shown
            delta = state.detokenizer.add([token_id])
            if state.stop_matcher is not None:
                delta, matched = state.stop_matcher.feed(delta)
            text_parts.append(delta)
            if matched is not None:
                num_kept = index + 1
                break
        state.num_output_tokens += num_kept
        finish_reason, stop_reason = core.finish_reason, core.stop_reason
        if matched is not None:
            finish_reason, stop_reason = "stop", matched
        elif finish_reason is not None:
            tail, matched = self._flush(state)
            text_parts.append(tail)
            if matched is not None and finish_reason != "abort":
                finish_reason, stop_reason = "stop", matched
        logprobs: list[TokenLogprob] | None = core.new_logprobs[:num_kept] if core.new_logprobs else None
        return RequestOutput(
            request_id=core.request_id,
            new_token_ids=token_ids[:num_kept],
            new_text="".join(text_parts),
            prompt_tokens=core.num_prompt_tokens,
            cached_tokens=core.num_cached_tokens,
            completion_tokens=state.num_output_tokens,
            new_logprobs=logprobs,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            error=core.error,
            error_code=core.error_code,
            kv_transfer_status=core.kv_transfer_status,
            prompt_logprobs=core.prompt_logprobs,
            queue_time_s=core.queue_time_s,
            cached_tokens_by_source=core.cached_tokens_by_source,
        )

    @staticmethod
    def _flush(state: _RequestText) -> tuple[str, str | None]:
        """What was held back (an incomplete character, a possible start of a stop string), at the end,
        and the stop string that the released text completes, if any."""
        tail = state.detokenizer.flush()
        if state.stop_matcher is None:
            return tail, None
        emitted, matched = state.stop_matcher.feed(tail)
        return (emitted, matched) if matched is not None else (emitted + state.stop_matcher.flush(), None)
