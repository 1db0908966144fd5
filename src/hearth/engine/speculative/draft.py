"""`draft`: a small model with the target's tokenizer proposes K tokens greedily.

It runs through Hearth's own model and paged-KV code: a second `Worker` (model, KV pool, attention backend)
in the same process, and a `KVCacheManager` of its own (no prefix caching) for its pages. Each request's
draft KV is kept in step with the target lazily: before proposing, the draft compares the tokens its KV
holds with the request's, truncates at the first difference (a rejected draft, or nothing yet), and
computes the rest in one catch-up row (the whole prompt the first time) whose last logits give the first
proposal; K-1 one-token steps give the others. The draft sees a request's tokens from its last
`CONTEXT_WINDOW_TOKENS` at the first proposal on (`lean_draft`: as good a predictor on tool calls, at a
fraction of the catch-up). A greedy proposal is a one-hot proposal distribution, which
is what the rejection sampler assumes.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from hearth.engine.config import EngineConfig
from hearth.engine.speculative.lean_draft import CONTEXT_WINDOW_TOKENS, LeanDraftRunner, LeanSequence
from hearth.engine.speculative.paged_rows import decode_rows_first, proposer_step_input
from hearth.engine.speculative.proposer import ProposalRequest, Proposer
from hearth.kv.manager import KVCacheManager
from hearth.model.config import ModelConfig, ModelLoadError
from hearth.parallel.state import single_rank

logger = logging.getLogger("hearth.spec")

# Up to this many requests a step, each runs its own lean chain (per-request ops); more share the paged
# path's batched forwards, whose per-op cost is spread over the batch.
LEAN_MAX_ROWS = 4


@dataclass(eq=False)
class DraftSequence:
    """A request's state in the draft's KV (a `PageHolder` for the draft's `KVCacheManager`)."""

    token_ids: list[int] = field(default_factory=list)  # the tokens whose KV the draft holds, in order
    num_matching: int = 0  # leading token_ids known equal to the request's (they never change)
    page_ids: list[int] = field(default_factory=list)
    page_generations: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    cached_page_count: int = 0
    page_keys: list[bytes] = field(default_factory=list)
    prefix_root: bytes = b""
    offset: int = -1  # first token of the request the draft sees (`CONTEXT_WINDOW_TOKENS`); -1: not yet set

    @property
    def all_token_ids(self) -> list[int]:
        return self.token_ids


class DraftModelProposer(Proposer):
    name = "draft"

    def __init__(
        self, worker: Any, num_pages: int, page_size: int, vocab_size: int, lean: bool = True
    ) -> None:
        self.worker = worker  # hearth.engine.worker.Worker running the draft model
        self.page_size = page_size
        self.vocab_size = vocab_size  # proposals stay within the target's sampled vocabulary
        self.kv = KVCacheManager(num_pages, page_size, enable_prefix_caching=False)
        self._sequences: dict[str, DraftSequence] = {}
        self.context_window = CONTEXT_WINDOW_TOKENS  # both paths see the same tokens, so propose alike
        self.lean: LeanDraftRunner | None = None  # built once the compiled kernels are loaded
        self._try_lean = lean and worker.device.type == "cpu"
        self._lean_sequences: dict[str, LeanSequence] = {}

    def request_finished(self, request_id: str) -> None:
        sequence = self._sequences.pop(request_id, None)
        if sequence is not None:
            self.kv.free(sequence)
        self._lean_sequences.pop(request_id, None)

    def propose(self, batch: list[ProposalRequest]) -> list[list[int]]:
        with single_rank():  # the draft model is whole on this rank, whatever the target's parallelism
            return self._propose(batch)

    def _propose(self, batch: list[ProposalRequest]) -> list[list[int]]:
        if self._try_lean and self.lean is None and LeanDraftRunner.kernels_ready():
            self._try_lean = False
            self.lean = LeanDraftRunner.build(self.worker.model, self.vocab_size, self.context_window)
            logger.info(
                "draft model: lean chain for batches of <= %d: %s", LEAN_MAX_ROWS, self.lean is not None
            )
        lean = self.lean
        if lean is not None and len(batch) <= LEAN_MAX_ROWS:
            sequences = self._lean_sequences
            return [
                lean.propose(
                    sequences.setdefault(r.request_id, lean.new_sequence()), r.token_ids, r.num_tokens
                )
                for r in batch
            ]
        return self._propose_paged(batch)

    def _propose_paged(self, batch: list[ProposalRequest]) -> list[list[int]]:
        proposals: list[list[int]] = [[] for _ in batch]
        rows: list[tuple[int, DraftSequence, list[int]]] = []  # (index in batch, sequence, tokens to feed)
        wanted = {r.request_id for r in batch}
        for index, request in enumerate(batch):
            sequence = self._sequences.setdefault(request.request_id, DraftSequence())
            if sequence.offset < 0:
                sequence.offset = max(0, len(request.token_ids) - self.context_window)
            feed = self._reconcile(sequence, request.token_ids[sequence.offset :])
            if not self.kv.allocate_slots(sequence, len(feed) + request.num_tokens - 1):
                self._free_others(wanted)  # requests not proposed for now (preempted, waiting) give way
                if not self.kv.allocate_slots(sequence, len(feed) + request.num_tokens - 1):
                    continue
            rows.append((index, sequence, feed))
        while rows:
            tokens = self._forward([(sequence, feed) for _, sequence, feed in rows])
            survivors = []
            for (index, sequence, _), token in zip(rows, tokens, strict=True):
                proposals[index].append(token)
                if len(proposals[index]) < batch[index].num_tokens:
                    survivors.append((index, sequence, [token]))
            rows = survivors
        return proposals

    def _reconcile(self, sequence: DraftSequence, token_ids: list[int]) -> list[int]:
        """Drop the draft KV past the first token that differs from the request's; the tokens left to feed."""
        held = sequence.token_ids
        limit = min(len(held), len(token_ids))
        matching = sequence.num_matching
        while matching < limit and held[matching] == token_ids[matching]:
            matching += 1
        keep = min(matching, len(token_ids) - 1)  # the last token is always fed: its logits propose
        sequence.num_matching = keep
        if len(held) > keep:
            del held[keep:]
            self.kv.truncate(sequence, keep)
        return token_ids[keep:]

    def _free_others(self, keep_ids: set[str]) -> None:
        for request_id in [r for r in self._sequences if r not in keep_ids]:
            self.request_finished(request_id)

    def _forward(self, rows: list[tuple[DraftSequence, list[int]]]) -> list[int]:
        """One draft forward over the rows (each feeds its tokens after its computed ones); the greedy next token
        of each row. One-token rows go first: the attention backend takes them as one decode batch."""
        order = decode_rows_first([feed for _, feed in rows])
        step = proposer_step_input(rows, order, self.page_size)
        for sequence, feed in rows:
            sequence.token_ids.extend(feed)
        next_tokens = self.worker.forward(step)[:, : self.vocab_size].argmax(dim=-1).tolist()
        out = [0] * len(rows)
        for position, i in enumerate(order):
            out[i] = next_tokens[position]
        return out


def build(
    config: EngineConfig,
    model_config: ModelConfig,
    dtype: torch.dtype,
    num_pages: int,
    max_model_len: int,
    sample_vocab_size: int,
    eos_token_ids: set[int],
    device: torch.device,
    **_context: Any,
) -> DraftModelProposer:
    from hearth.engine.worker import Worker, kv_layout_for

    assert config.speculative_model is not None
    draft_config = ModelConfig.from_dir(config.speculative_model)
    if draft_config.vocab_size < sample_vocab_size:
        raise ModelLoadError(
            f"--speculative-model {config.speculative_model}: its vocabulary ({draft_config.vocab_size}) is "
            f"smaller than the target's ({sample_vocab_size}); a draft model must share the target's tokenizer"
        )
    # With tensor or pipeline parallelism the draft model still lives whole on rank 0, beside its shard of
    # the target: it needs only token ids, and a small model gains nothing from collectives.
    # The draft's KV stays in its own pool: no tiers, no PD transfer of its own (the target's worker has them).
    worker_config = dataclasses.replace(
        config,
        model=config.speculative_model,
        speculative_method=None,
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        pipeline_stage_layers=None,
        expert_parallel=False,
        role="mixed",
        kv_offload_memory_gib=0.0,
        kv_disk_dir=None,
        kv_store=None,
    )
    layout = kv_layout_for(worker_config, draft_config, dtype)
    # As many tokens as the target's cache, plus a page per sequence for the drafts past the target's tokens.
    num_draft_pages = num_pages + config.max_num_seqs
    with single_rank():
        worker = Worker(
            worker_config,
            draft_config,
            dtype,
            layout,
            num_draft_pages,
            max_model_len + config.num_speculative_tokens,
            sample_vocab_size,
            eos_token_ids,
            device=device,
        )
    logger.info("draft model %s: %d KV pages", config.speculative_model, num_draft_pages)
    return DraftModelProposer(worker, num_draft_pages, config.page_size, sample_vocab_size)
