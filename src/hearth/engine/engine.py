"""The engine: load a checkpoint, own the KV cache and scheduler, and step.

`step()` is three visible calls: schedule -> run -> process outputs. Everything else here is
request bookkeeping around it (adding, aborting, finishing).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from itertools import count

from hearth.engine.config import EngineConfig
from hearth.engine.detokenizer import IncrementalDetokenizer
from hearth.engine.outputs import RequestOutput, TokenLogprob
from hearth.engine.request import Request
from hearth.engine.sampling_params import InvalidParamError, SamplingParams
from hearth.engine.scheduler import ScheduledRequest, Scheduler
from hearth.engine.step_input import StepInputBuilder
from hearth.engine.stop_checker import StopStringMatcher
from hearth.engine.structured_output import GrammarMatcher, StructuredOutputManager
from hearth.engine.worker import StepOutput, Worker, kv_layout_for
from hearth.kv.manager import KVCacheManager
from hearth.kv.pool import KVPool
from hearth.kv.prefix_keys import root_key
from hearth.model.config import ModelConfig, ModelLoadError
from hearth.model.device import resolve_dtype
from hearth.model.tokenizer import Tokenizer

logger = logging.getLogger("hearth.engine")

GIB = 1 << 30


@dataclass
class EngineStats:
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


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        started = time.perf_counter()
        self.config = config
        self.model_config = ModelConfig.from_dir(config.model)
        self.tokenizer = Tokenizer.from_dir(config.model)
        self.dtype = resolve_dtype(config.dtype, self.model_config.checkpoint_dtype)
        layout = kv_layout_for(config, self.model_config, self.dtype)
        num_pages = KVPool.num_pages_for_budget(layout, int(config.kv_cache_memory_gib * GIB))
        if num_pages < 2:
            raise ModelLoadError(
                f"--kv-cache-memory {config.kv_cache_memory_gib} GiB holds {num_pages} pages of "
                f"{layout.bytes_per_page} bytes; give the KV cache more memory"
            )
        self.num_kv_tokens = num_pages * config.page_size
        self.max_model_len = self._max_model_len(self.num_kv_tokens)
        self.eos_token_ids = set(self.tokenizer.eos_token_ids) | set(self.model_config.eos_token_ids)
        # The embedding may be padded past the tokenizer's ids; those columns are never sampled.
        sample_vocab = min(self.model_config.vocab_size, self.tokenizer.vocab_size)
        self.worker = Worker(
            config,
            self.model_config,
            self.dtype,
            layout,
            num_pages,
            self.max_model_len,
            sample_vocab,
            self.eos_token_ids,
        )
        self.model = self.worker.model
        self.kv = KVCacheManager(num_pages, config.page_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_batched_tokens, config.max_num_seqs)
        self.step_inputs = StepInputBuilder(config.page_size)
        self.structured = StructuredOutputManager(self.tokenizer, self.eos_token_ids)
        self._kv_layout_tag = layout.describe()
        self._requests: dict[str, Request] = {}
        self._arrivals = count()
        self._ids = count()
        self._totals = {"prompt": 0, "cached": 0, "generated": 0, "preempted": 0}
        logger.info(
            "KV cache: %d pages x %d tokens = %d tokens (%.2f GiB, %s); max model len %d; ready in %.1f s",
            num_pages,
            config.page_size,
            self.num_kv_tokens,
            num_pages * layout.bytes_per_page / GIB,
            str(layout.kv_dtype).removeprefix("torch."),
            self.max_model_len,
            time.perf_counter() - started,
        )

    def _max_model_len(self, num_kv_tokens: int) -> int:
        limit = self.model_config.max_position_embeddings
        if self.model_config.rope_scaling.get("rope_type") in ("yarn", "dynamic", "linear", "llama3"):
            factor = float(self.model_config.rope_scaling.get("factor", 1.0))
            original = self.model_config.rope_scaling.get("original_max_position_embeddings", limit)
            limit = max(limit, int(original * factor))
        if self.config.max_model_len is not None:
            if self.config.max_model_len > limit:
                raise ModelLoadError(
                    f"--max-model-len {self.config.max_model_len} exceeds the model's {limit} positions"
                )
            limit = self.config.max_model_len
        return min(limit, num_kv_tokens)

    # ---- requests -------------------------------------------------------------------------------

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> str:
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise InvalidParamError("prompt", "the prompt is empty")
        if any(not 0 <= t < self.model_config.vocab_size for t in prompt_token_ids):
            raise InvalidParamError(
                "prompt", f"prompt token ids must be in [0, {self.model_config.vocab_size})"
            )
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidParamError(
                "prompt",
                f"the prompt has {len(prompt_token_ids)} tokens; this model's context is {self.max_model_len} "
                "tokens including the answer",
            )
        if params.max_tokens is not None and len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise InvalidParamError(
                "max_tokens",
                f"max_tokens {params.max_tokens} plus the prompt's {len(prompt_token_ids)} tokens exceeds the "
                f"context of {self.max_model_len} tokens",
            )
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            prefix_root=root_key(self.config.model_name, self._kv_layout_tag, cache_salt),
            arrival_index=next(self._arrivals),
            max_model_len=self.max_model_len,
            detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens),
            stop_matcher=StopStringMatcher(params.stop, params.include_stop_str_in_output)
            if params.stop
            else None,
            grammar=self._new_grammar(params),
        )
        self._requests[request_id] = request
        self.scheduler.add(request)
        return request_id

    def _new_grammar(self, params: SamplingParams) -> GrammarMatcher | None:
        if params.structured_output is None:
            return None
        try:
            return self.structured.new_matcher(params.structured_output)
        except ValueError as exc:
            raise InvalidParamError("response_format", str(exc)) from exc

    def abort(self, request_id: str, reason: str = "aborted") -> RequestOutput | None:
        request = self._requests.get(request_id)
        if request is None or request.finished:
            return None
        request.finish_reason = "abort"
        request.error = reason
        return self._finish(request, [], "")

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    # ---- the step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        scheduled = self.scheduler.schedule()
        self._totals["preempted"] += len(scheduled.preempted)
        if not scheduled.scheduled:
            return []
        step_output = self.worker.execute(self.step_inputs.build(scheduled.scheduled, self.structured))
        return self._process_outputs(scheduled.scheduled, step_output)

    def _process_outputs(self, batch: list[ScheduledRequest], step_output: StepOutput) -> list[RequestOutput]:
        sampling = [item for item in batch if item.samples]
        for item in batch:
            item.request.num_computed_tokens += item.num_new_tokens
            self.kv.cache_full_pages(item.request)
        outputs = []
        logprobs = step_output.logprobs
        for i, (item, token_ids) in enumerate(zip(sampling, step_output.sampled_token_ids, strict=True)):
            logprob = logprobs[i][0] if logprobs is not None and logprobs[i] else None
            output = self._append_token(item.request, token_ids[0], logprob)
            if output is not None:
                outputs.append(output)
        return outputs

    def _append_token(
        self, request: Request, token_id: int, logprob: TokenLogprob | None
    ) -> RequestOutput | None:
        params = request.params
        request.token_ids.append(token_id)
        request.output_token_ids.append(token_id)
        new_logprobs = [logprob] if logprob is not None else None
        if request.logprobs is not None and logprob is not None:
            request.logprobs.append(logprob)
        num_output = len(request.output_token_ids)
        if request.grammar is not None and not request.grammar.accept(token_id):
            request.finish_reason, request.error = "error", f"structured output: {request.grammar.error}"
            return self._finish(request, [], "")
        stopped_by_token = False
        if token_id in params.stop_token_ids and num_output > params.min_tokens:
            request.finish_reason, request.stop_reason, stopped_by_token = "stop", token_id, True
        elif token_id in self.eos_token_ids and not params.ignore_eos and num_output > params.min_tokens:
            request.finish_reason, stopped_by_token = "stop", True
        text = ""
        if not stopped_by_token or params.include_stop_str_in_output:
            text = request.detokenizer.add([token_id]) if request.detokenizer else ""
        if request.stop_matcher is not None:
            text, matched = request.stop_matcher.feed(text)
            if matched is not None and request.finish_reason is None:
                request.finish_reason, request.stop_reason = "stop", matched
        if request.finish_reason is None and request.grammar is not None and request.grammar.is_terminated:
            request.finish_reason = "stop"  # the JSON is complete; only EOS could follow
        if request.finish_reason is None and num_output >= request.max_output_tokens:
            request.finish_reason = "length"
        if request.finish_reason is not None:
            return self._finish(request, [token_id], text, new_logprobs)
        request.output_text += text
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=[token_id],
            new_text=text,
            prompt_tokens=request.num_prompt_tokens,
            cached_tokens=request.cached_tokens or 0,
            completion_tokens=num_output,
            new_logprobs=new_logprobs,
        )

    def _finish(
        self,
        request: Request,
        new_token_ids: list[int],
        text: str,
        new_logprobs: list[TokenLogprob] | None = None,
    ) -> RequestOutput:
        if not (request.finish_reason == "stop" and isinstance(request.stop_reason, str)):
            # Release what was held back: an incomplete character, or a possible start of a stop string.
            tail = request.detokenizer.flush() if request.detokenizer is not None else ""
            if request.stop_matcher is not None:
                emitted, matched = request.stop_matcher.feed(tail)
                text += emitted if matched is not None else emitted + request.stop_matcher.flush()
                if matched is not None and request.finish_reason != "abort":
                    request.finish_reason, request.stop_reason = "stop", matched
            else:
                text += tail
        request.output_text += text
        request.grammar = None
        self.scheduler.finish(request)
        self.step_inputs.request_finished(request.request_id)
        del self._requests[request.request_id]
        self._totals["prompt"] += request.num_prompt_tokens
        self._totals["cached"] += request.cached_tokens or 0
        self._totals["generated"] += len(request.output_token_ids)
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            new_text=text,
            prompt_tokens=request.num_prompt_tokens,
            cached_tokens=request.cached_tokens or 0,
            completion_tokens=len(request.output_token_ids),
            new_logprobs=new_logprobs,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            error=request.error,
        )

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_pages_used=self.kv.num_used_pages,
            kv_pages_total=self.kv.num_pages,
            prefix_cache_queries_tokens=self.kv.stats.queried_tokens,
            prefix_cache_hit_tokens=self.kv.stats.hit_tokens,
            prompt_tokens_total=self._totals["prompt"],
            cached_tokens_total=self._totals["cached"],
            generation_tokens_total=self._totals["generated"],
            num_preemptions_total=self._totals["preempted"],
        )
