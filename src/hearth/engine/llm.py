"""`LLM`: the offline Python API. The engine core and the output processor in the caller's process:
add every prompt, step until all are done, return results in order."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import count
from typing import Any

from hearth.engine import memory_defaults
from hearth.engine.config import EngineConfig
from hearth.engine.engine import Engine
from hearth.engine.factory import build_engine
from hearth.engine.messages import EngineRequest
from hearth.engine.output_processor import OutputProcessor
from hearth.engine.outputs import CompletionResult, RequestOutput, TokenLogprob
from hearth.engine.sampling_params import SamplingParams
from hearth.model.tokenizer import Tokenizer

Prompt = str | Sequence[int]

# While the only requests wait for KV from elsewhere, the loop sleeps this long between polls.
KV_WAIT_S = 0.0005


@dataclass
class _Collected:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None

    def result(self, request_id: str, last: RequestOutput) -> CompletionResult:
        return CompletionResult(
            request_id=request_id,
            prompt_token_ids=self.prompt_token_ids,
            token_ids=self.token_ids,
            text="".join(self.text_parts),
            finish_reason=last.finish_reason or "abort",
            prompt_tokens=len(self.prompt_token_ids),
            cached_tokens=last.cached_tokens,
            stop_reason=last.stop_reason,
            logprobs=self.logprobs,
            error=last.error,
        )


class LLM:
    def __init__(self, model: str, **engine_options: Any) -> None:
        memory_defaults.apply_in_process()
        self.engine: Engine = build_engine(EngineConfig(model=str(model), **engine_options))
        self.output_processor = OutputProcessor(self.engine.tokenizer)
        self._ids = count()

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        cache_salt: str | None = None,
    ) -> list[CompletionResult]:
        prompt_list = _as_prompt_list(prompts)
        if params is None:
            params = SamplingParams()
        params_list = [params] * len(prompt_list) if isinstance(params, SamplingParams) else list(params)
        if len(params_list) != len(prompt_list):
            raise ValueError(f"got {len(prompt_list)} prompts but {len(params_list)} SamplingParams")
        token_lists = [
            self.tokenizer.encode(p) if isinstance(p, str) else [int(t) for t in p] for p in prompt_list
        ]
        collected: dict[str, _Collected] = {}
        try:
            for tokens, sampling in zip(token_lists, params_list):
                request_id = f"llm-{next(self._ids)}"
                self.engine.add_request(EngineRequest(request_id, tokens, sampling, cache_salt))
                self.output_processor.add_request(request_id, tokens, sampling)
                collected[request_id] = _Collected(
                    tokens, logprobs=[] if sampling.logprobs is not None else None
                )
        except Exception:
            self._abort(list(collected), "a prompt of this batch was rejected")
            raise
        finished: dict[str, CompletionResult] = {}
        while len(finished) < len(collected):
            if not self.engine.has_work:
                raise RuntimeError("the engine stopped with requests unfinished")
            if self.engine.only_waiting_for_kv:
                time.sleep(KV_WAIT_S)  # let the tier/peer threads work instead of spinning on the GIL
            processed = self.output_processor.process(self.engine.step())
            if processed.abort_request_ids:  # stop strings ended them; free their pages in the core
                self.engine.abort(processed.abort_request_ids, "finished by a stop string")
            for output in processed.request_outputs:
                entry = collected.get(output.request_id)
                if entry is None:
                    continue
                entry.token_ids.extend(output.new_token_ids)
                entry.text_parts.append(output.new_text)
                if entry.logprobs is not None and output.new_logprobs:
                    entry.logprobs.extend(output.new_logprobs)
                if output.finished:
                    finished[output.request_id] = entry.result(output.request_id, output)
        self.engine.flush_kv_ops()  # the last requests' write-backs go to the ranks now, not with a later step
        return [finished[request_id] for request_id in collected]

    def _abort(self, request_ids: list[str], reason: str) -> None:
        self.output_processor.process(self.engine.abort(request_ids, reason))


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # one prompt given as token ids
    return items
