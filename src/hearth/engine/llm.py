"""`LLM`: the offline Python API. Add every prompt, step until all are done, return results in order."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hearth.engine.config import EngineConfig
from hearth.engine.engine import Engine
from hearth.engine.outputs import CompletionResult
from hearth.engine.sampling_params import SamplingParams
from hearth.model.tokenizer import Tokenizer

Prompt = str | Sequence[int]


class LLM:
    def __init__(self, model: str, **engine_options: Any) -> None:
        self.engine = Engine(EngineConfig(model=str(model), **engine_options))

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
        ids = []
        try:
            for tokens, sampling in zip(token_lists, params_list):
                ids.append(self.engine.add_request(tokens, sampling, cache_salt=cache_salt))
        except Exception:
            for request_id in ids:
                self.engine.abort(request_id)
            raise
        requests = {request_id: self.engine.get_request(request_id) for request_id in ids}
        finished: dict[str, CompletionResult] = {}
        while len(finished) < len(ids):
            for output in self.engine.step():
                if output.finished and output.request_id in requests:
                    request = requests[output.request_id]
                    finished[output.request_id] = CompletionResult(
                        request_id=request.request_id,
                        prompt_token_ids=request.prompt_token_ids,
                        token_ids=list(request.output_token_ids),
                        text=request.output_text,
                        finish_reason=request.finish_reason or "abort",
                        prompt_tokens=request.num_prompt_tokens,
                        cached_tokens=request.cached_tokens or 0,
                        stop_reason=request.stop_reason,
                        logprobs=request.logprobs,
                        error=request.error,
                    )
        return [finished[request_id] for request_id in ids]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # one prompt given as token ids
    return items
