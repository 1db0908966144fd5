"""The worker: one rank's device, model, KV pool, attention backend and sampler. `StepInput` in, tokens out.

The engine (scheduler, KV bookkeeping, grammar state) never touches a tensor; the worker never sees a
request object. It keeps a persistent batch (`hearth.engine.persistent_batch`: per request its tokens,
sampler parameters and page table) that each step's deltas update, and per-request seeded random
generators; all of a request's state is dropped when a step names its slot in `finished_slots`.

Rows with draft tokens: a row with k drafts has 1 + k logits positions, each processed with the row's
parameters (penalties and min_tokens counting the drafts before it). A greedy row keeps the longest run
that agrees with the drafts plus the token after it: `sampled[:j + 1]` where j is the number of leading
positions with `sampled[i] == draft[i]` (exact). A sampled row is verified by rejection sampling
(`hearth.engine.speculative.rejection`), which keeps the target's distribution.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable

import torch

from hearth.contracts.step import PageTagMismatch, StepInput, StepOutput, TokenLogprob
from hearth.engine import prompt_logprobs
from hearth.engine.config import EngineConfig
from hearth.engine.cuda_graphs import DEFAULT_MAX_CAPTURE_ROWS, DecodeGraphs, wants_decode_graphs
from hearth.engine.forward_batch import ForwardBatch, StepSamplingRow
from hearth.engine.fp8_kv_scales import init_fp8_kv_scales
from hearth.engine.kv_worker import build_kv_worker, rank_page_layout
from hearth.engine.persistent_batch import FlatBatch, PersistentBatch
from hearth.engine.ranks.microbatch import forward_micro_batches, resolve_micro_batches
from hearth.engine.ranks.pipeline import stage_layers
from hearth.engine.sampler import Sampler, SamplingRow, make_generator
from hearth.engine.speculative.rejection import rejection_sample
from hearth.engine.structured_output import apply_bitmask
from hearth.kv.integrity import make_page_tag_check
from hearth.kv.pool import KVLayout, KVPool, resolve_kv_dtype
from hearth.model.config import ModelConfig
from hearth.model.loader import load_model
from hearth.model.quantization.select import resolve_quantization
from hearth.ops import cpu_kernels
from hearth.ops.attention import AttentionBackend, AttentionContext, AttentionMetadata, select_backend
from hearth.ops.attention.backend import AttentionKind
from hearth.ops.prefill_math import prefill_math_scope, resolve_prefill_math
from hearth.parallel.state import parallel_state
from hearth.parallel.topology import rank_kv_heads

logger = logging.getLogger("hearth.worker")


__all__ = ["StepOutput", "Worker", "kv_layout_for", "resolve_device"]


def resolve_device(requested: str) -> torch.device:
    """`--device`: auto = cuda when a CUDA device is available, else cpu."""
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(requested)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device here; use --device cpu (or auto)")
    return device


def kv_layout_for(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype) -> KVLayout:
    """The KV layout a worker builds for this model and these options (the engine sizes the cache with it).
    Across ranks: one TP rank's KV heads, and the layers of the largest pipeline stage (every rank has
    the same number of pages; a smaller stage holds fewer layers of them). MLA models cache one latent
    vector per token and layer (kind "latent", whole on every TP rank), whatever their head count."""
    mla = model_config.mla
    num_layers = model_config.num_layers
    if config.pipeline_parallel_size > 1:
        stages = stage_layers(model_config, config.pipeline_parallel_size, config.pipeline_stage_layers)
        num_layers = max(len(s) for s in stages)
    return KVLayout(
        num_layers=num_layers,
        num_kv_heads=1
        if mla is not None
        else rank_kv_heads(model_config.num_kv_heads, config.tensor_parallel_size),
        head_dim=mla.latent_dim if mla is not None else model_config.head_dim,
        page_size=config.page_size,
        kv_dtype=resolve_kv_dtype(config.kv_cache_dtype, dtype),
        kind="latent" if mla is not None else "mha",
    )


class Worker:
    """Owns one rank's tensors. `execute(step_input) -> StepOutput` runs one step: model forward over the
    step's tokens, grammar masks, sampling and draft acceptance."""

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        dtype: torch.dtype,
        layout: KVLayout,
        num_pages: int,
        max_model_len: int,
        sample_vocab_size: int,
        eos_token_ids: Iterable[int],
        device: torch.device | None = None,
    ) -> None:
        self.device = device if device is not None else resolve_device(config.device)
        self.dtype = dtype
        if self.device.type == "cpu":
            torch.set_num_threads(config.resolved_num_threads)
        # This rank's place (one process alone: rank 0 of 1, every layer, the sampling rank).
        parallel = parallel_state()
        stage = stage_layers(model_config, parallel.pp_size, config.pipeline_stage_layers)[parallel.pp_rank]
        self.is_sampling_rank = parallel.is_sampling_rank
        # Pipeline stages overlap on micro-batches of each step (hearth.engine.ranks.microbatch).
        self.micro_batches = resolve_micro_batches(config.pipeline_micro_batches, parallel.pp_size)
        quantization, quant_config = resolve_quantization(config.quantization, config.model)
        self.model = load_model(
            config.model,
            model_config,
            dtype,
            max_model_len + 1,
            progress=config.load_progress,
            device=self.device,
            tp_rank=parallel.tp_rank,
            tp_size=parallel.tp_size,
            layers=stage if parallel.pp_size > 1 else None,
            quantization=quantization,
            quant_config=quant_config,
        )
        self.prefill_math = resolve_prefill_math(
            config.prefill_math,
            quantized=quantization != "unquantized",
            activations=dtype,
            device=self.device,
        )
        if config.speculative_method == "eagle3" and config.speculative_model is not None:
            # Every rank runs the layers the same way (the last layer over every row when its output is
            # captured), so the collectives of all ranks agree; the head itself runs on rank 0.
            from hearth.model.eagle3 import Eagle3Config

            head = Eagle3Config.from_dir(config.speculative_model, model_config.num_layers)
            self.model.aux_hidden_layers = head.aux_layer_ids
        full_layout, layout = layout, dataclasses.replace(layout, num_layers=len(stage))
        backend_cls = select_backend(self.device)
        # [i31] Decode CUDA graphs: their padding rows use one scratch page past the cache manager's (the
        # KV connectors never address it: their page ids come from the manager).
        graphs = wants_decode_graphs(config.enforce_eager, self.device, backend_cls, parallel)
        self.kv_pool = KVPool(
            layout, num_pages + int(graphs), self.device, rank_page_layout(layout, model_config, stage)
        )
        if self.kv_pool.quantized:
            # Sharded: the pool holds this stage's layers and this rank's KV heads, and so do its scales.
            sharded = parallel.pp_size > 1 or parallel.tp_size > 1
            source = init_fp8_kv_scales(
                self.kv_pool,
                self.model,
                config.model,
                max_model_len,
                stage=stage if sharded else None,
                model_shape=(model_config.num_layers, model_config.num_kv_heads) if sharded else None,
            )
            logger.info("FP8 KV cache: per (layer, KV head) scales from %s", source)
        self.page_tag_check = make_page_tag_check(config.kv_integrity)
        self.batch = PersistentBatch(layout.page_size, check_page_tags=config.kv_integrity)
        # A row's context is at most max_model_len tokens; one more page leaves room for a lookahead.
        max_pages_per_seq = -(-max_model_len // layout.page_size) + 1
        self.attention: AttentionBackend = backend_cls(
            device=self.device,
            page_size=layout.page_size,
            max_num_seqs=config.max_num_seqs,
            max_pages_per_seq=max_pages_per_seq,
            dtype=dtype,
            kv_dtype=layout.kv_dtype,
            sliding_window=model_config.sliding_window,
            layer_kinds=tuple(AttentionKind(*model_config.layer_attention(i)) for i in stage),
        )
        self.sampler = Sampler(sample_vocab_size, set(eos_token_ids))
        self._generators: dict[str, torch.Generator] = {}
        # Called with each step after the model's forward (an EAGLE-3 proposer takes the step's aux hidden states).
        self.after_forward: Callable[[ForwardBatch], None] | None = None
        # This rank's half of the KV connectors (tiers, PD transfer); None when KV stays in this pool.
        self.kv_worker = build_kv_worker(
            config,
            self.kv_pool.io,
            f"{full_layout.describe()}/{parallel.layout_tag}",
            parallel.global_rank(parallel.pp_rank, parallel.tp_rank),
            parallel.pp_size * parallel.tp_size,
        )
        torch.manual_seed(config.seed)
        self.decode_graphs: DecodeGraphs | None = None  # [i31]
        self._last_sampled: list[list[int]] = []  # [i31] the previous step's tokens, for overlap scheduling
        if graphs:
            self.decode_graphs = self._capture_decode_graphs(num_pages, config.max_num_seqs)
        if self.device.type == "cpu":
            # Compiled CPU kernels, loaded (or built, the first time on a machine) before the server is
            # ready: a compile never competes with serving. A failed build leaves the torch paths.
            cpu_kernels.build_before_ready()
        logger.info(
            "worker on %s: attention backend %s, KV %s, weights %s",
            self.device,
            self.attention.name,
            layout.describe(),
            quantization,
        )

    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepOutput:
        if self.kv_worker is not None:  # before the forward: pages saved, loads started or landed
            self.kv_worker.apply(step.kv_ops)
        output = self._execute(step)
        if step.slots:  # a step of KV ops alone samples nothing an overlapped step could continue
            self._last_sampled = (
                output.sampled_token_ids
            )  # [i31] overlap: the next step may continue its rows
        if self.kv_worker is not None:
            output.kv_events = self.kv_worker.report(step.kv_ops)
        return output

    def _execute(self, step: StepInput) -> StepOutput:
        for request_id in self.batch.apply(step, self._last_sampled):
            self._generators.pop(request_id, None)
        if step.tag_page_ids:
            self.kv_pool.set_page_tags(step.tag_page_ids, step.tag_values)
        if not step.slots:
            return StepOutput([])
        flat = self.batch.flatten(step)
        # Before anything reads or writes the cache: a row whose pages are no longer its own must not run.
        mismatches = self.page_tag_check.check(
            self.kv_pool.page_tags, flat.page_table, flat.page_table_width, flat.page_tags
        )
        if mismatches:
            return self._run_without(step, len(flat.sampling), mismatches)
        return self._run(flat)

    def _run(self, step: ForwardBatch) -> StepOutput:
        logits = self.forward(step)
        prompt_entries = None
        if step.prompt_logits_indices and logits is not None:  # issue 27: prompt logprobs, split off first
            num_sampled = len(step.logits_indices)
            prompt_entries = prompt_logprobs.compute(
                logits[num_sampled:],
                step.prompt_logprob_token_ids,
                step.prompt_logprob_top,
                self.sampler.vocab_size,
            )
            logits = logits[:num_sampled]
        if logits is None or not step.sampling or not self.is_sampling_rank:
            # Another rank samples (see hearth.engine.ranks.executor).
            return StepOutput([], prompt_logprobs=prompt_entries)
        if step.bitmask_rows:
            words = torch.frombuffer(bytearray(step.bitmask), dtype=torch.int32)
            apply_bitmask(logits, step.bitmask_rows, words.view(len(step.bitmask_rows), -1))
        output = self._sample(logits, step.sampling)
        output.prompt_logprobs = prompt_entries
        return output

    def _run_without(
        self, step: StepInput, num_sampled: int, mismatches: list[PageTagMismatch]
    ) -> StepOutput:
        """The step with the failing rows masked out; their sampling rows get no tokens."""
        kept: FlatBatch = self.batch.flatten(step, frozenset(mismatch.row for mismatch in mismatches))
        output = self._run(kept) if kept.token_ids else StepOutput([])
        if len(output.sampled_token_ids) != len(kept.kept_sampling):  # a rank that does not sample
            return StepOutput([], None, mismatches, prompt_logprobs=output.prompt_logprobs)
        sampled: list[list[int]] = [[] for _ in range(num_sampled)]
        logprobs: list[list[TokenLogprob]] | None = (
            [[] for _ in range(num_sampled)] if output.logprobs else None
        )
        for index, tokens in zip(kept.kept_sampling, output.sampled_token_ids, strict=True):
            sampled[index] = tokens
        if logprobs is not None and output.logprobs is not None:
            for index, row_logprobs in zip(kept.kept_sampling, output.logprobs, strict=True):
                logprobs[index] = row_logprobs
        return StepOutput(sampled, logprobs, mismatches, prompt_logprobs=output.prompt_logprobs)

    @torch.inference_mode()
    def forward(self, step: ForwardBatch) -> torch.Tensor | None:
        """float32 logits `[len(step.logits_indices), vocab]` (the KV of the step's tokens is written);
        None on a pipeline stage other than the last."""
        with prefill_math_scope(self.prefill_math):
            if parallel_state().pp_size > 1:
                return forward_micro_batches(self._forward_one, step, self.micro_batches)
            return self._forward_one(step)

    def _forward_one(self, step: ForwardBatch) -> torch.Tensor | None:
        graphs = self.decode_graphs
        if graphs is not None and self.after_forward is None and not step.prompt_logits_indices:
            logits = graphs.run(step)  # [i31] a captured plain decode step (None: this one runs eagerly)
            if logits is not None:
                return logits
        num_tokens = len(step.token_ids)
        # Prompt-logprob rows (issue 27) ride after the sampled ones; `_run` splits them off.
        logits_indices = (
            step.logits_indices + step.prompt_logits_indices
            if step.prompt_logits_indices
            else step.logits_indices
        )
        ids = torch.tensor(step.token_ids + step.positions + logits_indices, dtype=torch.long)
        if self.device.type == "cuda":  # pinned, so the copy is asynchronous
            ids = ids.pin_memory().to(self.device, non_blocking=True)
        elif self.device.type != "cpu":
            ids = ids.to(self.device)
        metadata = self.attention.prepare(step)
        ctx = AttentionContext(self.attention, metadata, self.kv_pool)
        logits = self.model(ids[:num_tokens], ids[num_tokens : 2 * num_tokens], ctx, ids[2 * num_tokens :])
        if self.after_forward is not None:
            self.after_forward(step)
        return logits

    # [i31] decode CUDA graphs (hearth.engine.cuda_graphs)
    def _capture_decode_graphs(self, scratch_page: int, max_num_seqs: int) -> DecodeGraphs | None:
        graphs = DecodeGraphs(
            self._graph_forward,
            self.attention,
            scratch_page=scratch_page,
            max_rows=min(max_num_seqs, DEFAULT_MAX_CAPTURE_ROWS),
            capture=self.device.type == "cuda",  # elsewhere (tests) the same steps, run eagerly
        )
        try:
            graphs.capture()
        except Exception:  # a model with a host sync in its forward: eager steps still work
            logger.warning("decode graphs could not be captured; every step runs eagerly", exc_info=True)
            return None
        return graphs

    def _graph_forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        ctx = AttentionContext(self.attention, metadata, self.kv_pool)
        logits = self.model(ids, positions, ctx, logits_indices)
        assert logits is not None  # graphs are captured on a single stage only
        return logits

    def _sample(self, logits: torch.Tensor, sampling: list[StepSamplingRow]) -> StepOutput:
        """Greedy rows and rows without drafts go through the sampler in one batch (a greedy row keeps the run
        of drafts that agree with its argmax: exact); sampled rows with drafts are verified by rejection
        sampling, which keeps the target's distribution (`hearth.engine.speculative.rejection`)."""
        if all(
            not row.draft_token_ids
            and row.params.logprobs is None
            and row.params.greedy
            and not row.params.needs_penalties
            and not row.params.logit_bias
            and row.num_output_tokens >= row.params.min_tokens
            for row in sampling
        ):  # the common decode step: the sampler's own shortcut, without building its rows
            scores = logits[:, : self.sampler.vocab_size]
            # NumPy's argmax is ~10x torch's on the CPU (one thread) and picks the same (first) index on ties.
            best = scores.numpy().argmax(axis=-1) if scores.device.type == "cpu" else scores.argmax(dim=-1)
            return StepOutput([[token] for token in best.tolist()])
        rows: list[SamplingRow] = []  # the batched sampler's rows, one per logits position it samples
        plain_positions: list[int] = []
        verified: dict[int, tuple[list[int], list[TokenLogprob] | None]] = {}
        position = 0
        for index, row in enumerate(sampling):
            params = row.params
            generator = None
            if params.seed is not None:
                generator = self._generators.get(row.request_id)
                if generator is None:
                    # On the CPU whatever the device: one draw per row, and the same stream on every device.
                    generator = self._generators[row.request_id] = make_generator(params.seed)
            prompt = row.prompt_token_ids or []
            output = row.output_token_ids
            drafts = row.draft_token_ids
            row_positions = [
                SamplingRow(
                    params=params,
                    prompt_token_ids=prompt,
                    output_token_ids=(output + drafts[:i] if i else output) if output is not None else [],
                    generator=generator,
                    num_output_tokens=row.num_output_tokens + i,
                )
                for i in range(1 + len(drafts))
            ]
            if drafts and not params.greedy:
                row_logits = logits[position : position + 1 + len(drafts)]
                verified[index] = rejection_sample(self.sampler, row_logits, row_positions, drafts)
            else:
                rows.extend(row_positions)
                plain_positions.extend(range(position, position + 1 + len(drafts)))
            position += 1 + len(drafts)
        plain_logits = logits if not verified else logits[plain_positions]
        sampled = self.sampler(plain_logits, rows)
        token_lists: list[list[int]] = []
        logprob_lists: list[list[TokenLogprob]] | None = (
            [] if any(row.params.logprobs is not None for row in sampling) else None
        )
        position = 0
        for index, row in enumerate(sampling):
            if index in verified:
                tokens, logprobs = verified[index]
                token_lists.append(tokens)
                if logprob_lists is not None:
                    logprob_lists.append(logprobs or [])
                continue
            drafts = row.draft_token_ids
            tokens = sampled.token_ids[position : position + 1 + len(drafts)]
            kept = 0
            while kept < len(drafts) and tokens[kept] == drafts[kept]:
                kept += 1
            token_lists.append(tokens[: kept + 1])
            if logprob_lists is not None:
                row_logprobs = sampled.logprobs[position : position + kept + 1]
                logprob_lists.append([lp for lp in row_logprobs if lp is not None])
            position += 1 + len(drafts)
        return StepOutput(token_lists, logprob_lists)
