"""The engine core: requests in, token ids out; `step()` is schedule -> run -> process outputs.

Built by `hearth.engine.factory.build_engine`. It owns the bookkeeping (scheduler, KV cache manager,
grammars); tensors live in the worker. It never sees text: detokenization and stop strings are the
`OutputProcessor`'s, on the client's side (`LLM`, or the API process of `hearth serve`).
"""

from __future__ import annotations

import logging
from itertools import count

import torch

from hearth.contracts.kv_ops import KVOps
from hearth.engine import prompt_logprobs
from hearth.engine.config import EngineConfig
from hearth.engine.kv_connector import KVConnector, KVLoadCoordinator, KVOpQueue
from hearth.engine.kv_connectors.tiers import TierConnector
from hearth.engine.kv_integrity import KV_INTEGRITY_ERROR, KVIntegrityPolicy
from hearth.engine.messages import CoreOutput, EngineRequest, EngineStats
from hearth.engine.outputs import FinishReason, TokenLogprob
from hearth.engine.overlap import LaunchedStep, StepRunner, continuation, continues
from hearth.engine.request import Request, RequestStatus
from hearth.engine.sampling_params import InvalidParamError, SamplingParams
from hearth.engine.scheduler import ScheduledRequest, Scheduler
from hearth.engine.speculative import Speculator
from hearth.engine.step_input import StepInputBuilder
from hearth.engine.structured_output import GrammarMatcher, StructuredOutputManager
from hearth.engine.worker import StepOutput, Worker
from hearth.kv.integrity import PageTagMismatch
from hearth.kv.manager import KVCacheManager
from hearth.kv.prefix_keys import root_key
from hearth.model.config import ModelConfig
from hearth.model.tokenizer import Tokenizer

logger = logging.getLogger("hearth.engine")


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        tokenizer: Tokenizer,
        kv: KVCacheManager,
        scheduler: Scheduler,
        worker: Worker,
        structured: StructuredOutputManager,
        eos_token_ids: set[int],
        kv_layout_tag: str,
        max_model_len: int,
        num_kv_tokens: int,
        kv_connectors: list[KVConnector] | None = None,
        speculator: Speculator | None = None,
        kv_ops: KVOpQueue | None = None,
    ) -> None:
        self.config = config
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.kv = kv
        self.scheduler = scheduler
        self.worker = worker
        self.step_inputs = StepInputBuilder(config.page_size, check_page_tags=config.kv_integrity)
        self.integrity = KVIntegrityPolicy(scheduler, config.kv_integrity_action)  # type: ignore[arg-type]
        self.kv_loads = KVLoadCoordinator(scheduler, kv_connectors or [], config.page_size, kv_ops)
        self.structured = structured
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.num_kv_tokens = num_kv_tokens
        self._kv_layout_tag = kv_layout_tag
        self.speculator = speculator  # speculative decoding (None: off)
        self._requests: dict[str, Request] = {}
        self._arrivals = count()
        self._totals = {"prompt": 0, "cached": 0, "generated": 0, "preempted": 0}
        # Last outputs of PD prefill requests whose KV is still being sent (see PeerKVConnector).
        self._deferred: dict[str, CoreOutput] = {}
        self._prompt_logprobs = 0  # live requests that asked for prompt logprobs (issue 27): 0 costs nothing
        self.kv_transfer_endpoint: str | None = None  # decode role: set by the factory
        # Overlap scheduling (hearth.engine.overlap): one process's own worker, no drafts, no KV from elsewhere.
        overlap = config.async_scheduling
        if overlap is None:
            overlap = isinstance(worker, Worker) and worker.device.type != "cpu"
        overlap = overlap and isinstance(worker, Worker) and speculator is None and not kv_connectors
        # Through `self.worker` at call time: a wrapped or replaced `worker.execute` is what runs.
        self.runner = StepRunner(
            lambda step: self.worker.execute(step), overlap, worker.device if overlap else None
        )
        self._in_flight: LaunchedStep | None = None  # overlap: the step on the worker, launched last step()
        self.num_overlapped_steps = 0

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def model(self) -> torch.nn.Module:
        return self.worker.model

    @property
    def dtype(self) -> torch.dtype:
        """What the model computes in (benchmarks report it)."""
        return self.worker.dtype

    @property
    def has_work(self) -> bool:
        in_flight = self._in_flight is not None
        kv_busy = self.kv_loads.busy or self.kv_loads.has_ops
        return self.scheduler.has_work or bool(self._deferred) or kv_busy or in_flight

    @property
    def has_runnable_work(self) -> bool:
        """Requests a step would compute; without them the loop sleeps until KV news or a message."""
        return bool(self.scheduler.waiting or self.scheduler.running or self._in_flight)

    @property
    def only_waiting_for_kv(self) -> bool:
        """Nothing can run until KV arrives from elsewhere: a loop should wait a little, not spin."""
        scheduler = self.scheduler
        if not scheduler.waiting_for_kv or scheduler.running:
            return False
        return not scheduler.waiting or len(scheduler.waiting_for_kv) >= scheduler.max_num_seqs

    @property
    def has_kv_connectors(self) -> bool:
        """KV comes from (and goes to) elsewhere: tiers or peers work in the background."""
        return bool(self.kv_loads.connectors)

    def flush_kv_ops(self) -> None:
        """Hand the KV ops decided since the last step (write-backs, spills) to the ranks now."""
        if self.kv_loads.ops:
            self._run_kv_ops(self.kv_loads.take_ops())

    def _run_kv_ops(self, kv_ops: KVOps | None) -> None:
        """A step with no rows: the ranks' KV halves move pages and report."""
        if kv_ops is not None:
            step = self.step_inputs.build([], self.structured)
            step.kv_ops = kv_ops
            # Through the runner: in order with any step it runs on its thread.
            self.kv_loads.on_events(self.runner.launch([], step).result().kv_events)

    def close(self) -> None:
        """Stop the KV connectors' threads (queued tier writes get a moment to finish)."""
        self.flush_kv_ops()
        self.kv_loads.close()
        kv_worker = getattr(self.worker, "kv_worker", None)  # rank 0's half; other ranks close theirs at exit
        if kv_worker is not None:
            kv_worker.close()
        self.runner.close()

    # ---- requests -------------------------------------------------------------------------------

    def add_request(self, request: EngineRequest) -> None:
        """Validates and queues a request; raises InvalidParamError (nothing is kept) if it cannot run."""
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        prompt, params = request.prompt_token_ids, request.params
        check_request(prompt, params, self.model_config.vocab_size, self.max_model_len)
        if params.prompt_logprobs is not None:
            if (
                self.config.tensor_parallel_size * self.config.pipeline_parallel_size > 1
                or self.config.role != "mixed"
            ):
                raise InvalidParamError(
                    "prompt_logprobs",
                    "prompt logprobs are not supported with tensor/pipeline parallelism or a PD role yet",
                )
        self._requests[request.request_id] = state = Request(
            request_id=request.request_id,
            prompt_token_ids=list(prompt),
            params=params,
            prefix_root=root_key(self.config.model_name, self._kv_layout_tag, request.cache_salt),
            arrival_index=next(self._arrivals),
            max_model_len=self.max_model_len,
            grammar=self._new_grammar(params),
            kv_transfer=request.kv_transfer,
        )
        self.scheduler.add(state, self.kv_loads.request_added(state))
        if params.prompt_logprobs is not None:
            self._prompt_logprobs += 1  # counted once queued: `_finish` uncounts it

    def _new_grammar(self, params: SamplingParams) -> GrammarMatcher | None:
        if params.structured_output is None:
            return None
        try:
            return self.structured.new_matcher(params.structured_output)
        except ValueError as exc:
            raise InvalidParamError("response_format", str(exc)) from exc

    def abort(self, request_ids: list[str], reason: str = "aborted") -> list[CoreOutput]:
        """Ends the named requests wherever they are and frees their pages; unknown ids are ignored."""
        outputs = []
        for request_id in request_ids:
            request = self._requests.get(request_id)
            if request is not None:
                outputs.append(self._finish(request, [], None, "abort", error=reason))
        return outputs

    # ---- the step -------------------------------------------------------------------------------

    def step(self) -> list[CoreOutput]:
        self.kv_loads.poll()  # requests whose KV arrived from elsewhere become runnable
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)  # drafts for the scheduler to add to decode rows
        sent = self._sent_outputs() if self._deferred else []
        # Step N: launched by the previous step() when overlapping, else scheduled and run now.
        step = self._in_flight or self._schedule_and_launch()
        if step is None:
            return sent
        self._in_flight = self._launch_continuation(step.batch) if self.runner.overlaps else None
        step_output = step.result()
        self.kv_loads.on_events(step_output.kv_events)
        if step.prompt_chunks:
            skipped = {mismatch.row for mismatch in step_output.kv_mismatches}
            prompt_logprobs.collect(step.prompt_chunks, step_output.prompt_logprobs, skipped)
        outputs = self._process_outputs(step.batch, step_output, step.samples)
        if self.speculator is not None:  # what the step cost decides whether drafts pay at this batch size
            self.speculator.step_finished(step.batch, sum(len(o.new_token_ids) for o in outputs))
        return sent + outputs

    def _schedule_and_launch(self) -> LaunchedStep | None:
        scheduled = self.scheduler.schedule()
        self._totals["preempted"] += len(scheduled.preempted)
        self.step_inputs.pages_allocated(*self.kv.take_allocated())  # the pool's tags, from the allocator
        self.kv_loads.start(scheduled.kv_loads)
        kv_ops = self.kv_loads.take_ops() if self.kv_loads.connectors else None
        if not scheduled.scheduled:
            self._run_kv_ops(kv_ops)  # the ranks' KV halves still move pages and report
            return None
        step_input = self.step_inputs.build(scheduled.scheduled, self.structured)
        if kv_ops is not None:
            step_input.kv_ops = kv_ops  # overlap is off with KV connectors: this step runs serially
        # Prompt logprobs ride on the step's own forward: the rows are added before it launches.
        prompt_chunks = (
            prompt_logprobs.plan(step_input, scheduled.scheduled) if self._prompt_logprobs else None
        )
        launched = self.runner.launch(scheduled.scheduled, step_input)
        launched.prompt_chunks = prompt_chunks
        return launched

    def _launch_continuation(self, batch: list[ScheduledRequest]) -> LaunchedStep | None:
        """Overlap: step N+1 launched before N's tokens are read, when it is N's decode rows one further."""
        if not continues(batch, self.scheduler):
            return None
        built = continuation(batch, self.kv, self.step_inputs)
        if built is None:
            return None
        self.num_overlapped_steps += 1
        return self.runner.launch(*built)

    def _sent_outputs(self) -> list[CoreOutput]:
        """The held-back last outputs of prefill requests whose KV send just ended."""
        outputs = []
        for request_id, ok in self.kv_loads.poll_sent():
            output = self._deferred.pop(request_id, None)
            if output is not None:
                output.kv_transfer_status = "sent" if ok else "failed"
                outputs.append(output)
        return outputs

    def _process_outputs(
        self, batch: list[ScheduledRequest], step_output: StepOutput, samples: list[bool] | None = None
    ) -> list[CoreOutput]:
        """Stop the rows that failed the KV integrity check, cut each other row's tokens where the request
        ends, advance the scheduler, and report."""
        if samples is None:  # read before a failure resets a request's progress
            samples = [item.samples for item in batch]
        failed = self._stop_failed_rows(batch, step_output.kv_mismatches) if step_output.kv_mismatches else []
        kept_tokens: list[list[int]] = []
        endings: list[tuple[Request, list[int], list[TokenLogprob] | None, FinishReason | None]] = []
        logprob_lists = step_output.logprobs or [None] * len(step_output.sampled_token_ids)
        sampled = iter(zip(step_output.sampled_token_ids, logprob_lists, strict=True))
        for item, item_samples in zip(batch, samples, strict=True):
            if not item_samples:
                kept_tokens.append([])
                continue
            tokens, logprobs = next(sampled)
            if item.request.status is not RequestStatus.RUNNING:  # failed the integrity check just now
                kept_tokens.append([])
                continue
            if item.draft_token_ids and self.speculator is not None:
                self.speculator.observe(item.request.request_id, len(item.draft_token_ids), len(tokens) - 1)
            num_kept, finish_reason = self._check_stop(item.request, tokens)
            kept_tokens.append(tokens[:num_kept])
            endings.append(
                (item.request, tokens[:num_kept], logprobs[:num_kept] if logprobs else None, finish_reason)
            )
        self.scheduler.update(batch, kept_tokens)
        return failed + [
            self._output(request, tokens, logprobs)
            if finish_reason is None
            else self._finish(request, tokens, logprobs, finish_reason, error=request.error)
            for request, tokens, logprobs, finish_reason in endings
        ]

    def _stop_failed_rows(
        self, batch: list[ScheduledRequest], mismatches: list[PageTagMismatch]
    ) -> list[CoreOutput]:
        """Rows whose pages were not theirs: recomputed (back to waiting) or ended with an error; none of
        this step's tokens is kept for them."""
        # Overlap scheduling: a launched row of a request that the previous step's check ended or sent back
        # (or an abort took) keeps none of its tokens anyway, and is not handled twice.
        mismatches = [m for m in mismatches if batch[m.row].request.status is RequestStatus.RUNNING]
        return [
            self._finish(request, [], None, "error", error=message, error_code=KV_INTEGRITY_ERROR)
            for request, message in self.integrity.handle(batch, mismatches)
        ]

    def _check_stop(self, request: Request, tokens: list[int]) -> tuple[int, FinishReason | None]:
        """How many of `tokens` the request keeps, and why it ends (None: it goes on)."""
        params = request.params
        num_output = len(request.output_token_ids)
        for index, token_id in enumerate(tokens):
            num_output += 1
            if request.grammar is not None and not request.grammar.accept(token_id):
                request.error = f"structured output: {request.grammar.error}"
                return index, "error"
            past_min = num_output > params.min_tokens
            if past_min and token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return index + 1, "stop"
            if past_min and token_id in self.eos_token_ids and not params.ignore_eos:
                return index + 1, "stop"
            if request.grammar is not None and request.grammar.is_terminated:
                return index + 1, "stop"  # the JSON is complete; only EOS could follow
            if num_output >= request.max_output_tokens:
                return index + 1, "length"
        return len(tokens), None

    def _output(self, request: Request, tokens: list[int], logprobs: list[TokenLogprob] | None) -> CoreOutput:
        queue_time_s = None
        if not request.queue_time_sent and request.queue_time_s is not None:
            request.queue_time_sent = True
            queue_time_s = request.queue_time_s
        return CoreOutput(
            request_id=request.request_id,
            new_token_ids=tokens,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.cached_tokens or 0,
            cached_tokens_by_source=request.cached_tokens_by_source,
            new_logprobs=logprobs,
            prompt_logprobs=prompt_logprobs.take(request)
            if request.params.prompt_logprobs is not None
            else None,
            queue_time_s=queue_time_s,
        )

    def _finish(
        self,
        request: Request,
        tokens: list[int],
        logprobs: list[TokenLogprob] | None,
        finish_reason: FinishReason,
        error: str | None = None,
        error_code: str | None = None,
    ) -> CoreOutput:
        output = self._output(request, tokens, logprobs)
        output.finish_reason = finish_reason
        output.stop_reason = request.stop_reason
        output.error = error
        output.error_code = error_code
        output.ends_with_stop_token = (
            finish_reason == "stop"
            and bool(tokens)
            and (tokens[-1] == request.stop_reason or tokens[-1] in self.eos_token_ids)
        )
        request.finish_reason = finish_reason
        request.grammar = None
        self.kv_loads.request_finished(request)  # before its pages are freed
        self.scheduler.finish(request)
        self.step_inputs.request_finished(request.request_id)  # the worker drops its state for it
        if self.speculator is not None:
            self.speculator.request_finished(request.request_id)
        del self._requests[request.request_id]
        if request.params.prompt_logprobs is not None:
            self._prompt_logprobs -= 1
        self._totals["prompt"] += request.num_prompt_tokens
        self._totals["cached"] += request.cached_tokens or 0
        self._totals["generated"] += len(request.output_token_ids)
        if finish_reason in ("stop", "length") and self.kv_loads.is_sending(request.request_id):
            # A PD prefill answer says whether its KV was sent: it goes out when the send ends.
            self._deferred[request.request_id] = output
            return CoreOutput(request.request_id, [], request.num_prompt_tokens, request.cached_tokens or 0)
        return output

    def _retention_stats(self) -> dict[str, int]:
        retention = self.scheduler.retention
        if retention is None:
            return {}
        stats = retention.stats
        return {
            "retained_pages": stats.retained_pages,
            "retained_sessions": stats.retained_sessions,
            "retention_expired_total": stats.expired_total,
            "retention_evicted_total": stats.evicted_total,
            "retention_replaced_total": stats.replaced_total,
            "retention_yielded_total": stats.yielded_total,
        }

    def stats(self) -> EngineStats:
        spec = self.speculator.stats if self.speculator is not None else None
        transfer = self.kv_loads.counters()
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
            kv_integrity_failures_total=self.integrity.num_failures,
            spec_method=spec.method if spec else "",
            spec_num_drafts_total=spec.num_drafts if spec else 0,
            spec_draft_tokens_total=spec.num_draft_tokens if spec else 0,
            spec_accepted_tokens_total=spec.num_accepted_tokens if spec else 0,
            kv_transfer_failures_total=transfer.get("transfer_failures", 0),
            kv_recomputed_tokens_total=self.scheduler.num_kv_recomputed_tokens,
            kv_transfer_pages_total=transfer.get("transfer_pages_received", 0)
            + transfer.get("transfer_pages_sent", 0),
            kv_tokens_total=self.num_kv_tokens,
            **self._retention_stats(),
            kv_tiers=tier.tier_stats()
            if isinstance(tier := self.kv_loads.connectors.get("tier"), TierConnector)
            else [],
        )


def check_request(
    prompt_token_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int
) -> None:
    """The checks a request must pass before it is queued; raises InvalidParamError naming the parameter."""
    if not prompt_token_ids:
        raise InvalidParamError("prompt", "the prompt is empty")
    if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab_size:
        raise InvalidParamError("prompt", f"prompt token ids must be in [0, {vocab_size})")
    if params.logit_bias and max(params.logit_bias) >= vocab_size:
        raise InvalidParamError("logit_bias", f"logit_bias token ids must be in [0, {vocab_size})")
    if len(prompt_token_ids) >= max_model_len:
        raise InvalidParamError(
            "prompt",
            f"the prompt has {len(prompt_token_ids)} tokens; this model's context is {max_model_len} "
            "tokens including the answer",
        )
    if params.max_tokens is not None and len(prompt_token_ids) + params.max_tokens > max_model_len:
        raise InvalidParamError(
            "max_tokens",
            f"max_tokens {params.max_tokens} plus the prompt's {len(prompt_token_ids)} tokens exceeds the "
            f"context of {max_model_len} tokens",
        )
