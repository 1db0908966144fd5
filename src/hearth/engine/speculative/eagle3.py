"""`eagle3`: an EAGLE-3 head (`hearth.model.eagle3`) proposes K tokens from the target's own hidden states.

The target keeps the residual stream of three of its layers for every token it computes
(`CausalLM.aux_hidden_layers`); after each target forward the worker hands the step to this proposer
(`Worker.after_forward`), and once the step's outputs are known (`target_step_done`) it keeps, per request,
the aux vectors of the positions whose tokens the request kept (a rejected draft's are dropped).

Head position p reads (token p+1, the target's aux vectors at p), so when a request has L tokens the head can
consume positions up to L-2: before proposing, one catch-up row feeds the positions it has not consumed yet
(the whole prompt the first time); its last output predicts token L, the first draft. The head then chains
K-1 one-token steps on its own pre-norm output. Its KV is paged (a one-layer pool and a `KVCacheManager` of
its own); the chained positions were computed from the head's guesses, not the target's states, so the next
proposal truncates them (the rollback) and the catch-up row rewrites them from the target's states.

Positions whose target states never came (a prefix-cache hit skips computing them) get zero vectors: the
head still runs, and guesses worse there. Verification keeps the output exact whatever the head guesses.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hearth.engine.config import EngineConfig
from hearth.engine.forward_batch import ForwardBatch
from hearth.engine.request import RequestStatus
from hearth.engine.scheduler import ScheduledRequest
from hearth.engine.speculative.paged_rows import decode_rows_first, proposer_step_input
from hearth.engine.speculative.proposer import ProposalRequest, Proposer
from hearth.kv.manager import KVCacheManager
from hearth.kv.pool import KVLayout, KVPool, resolve_kv_dtype
from hearth.model.config import ModelConfig, ModelLoadError
from hearth.model.eagle3 import Eagle3Config, Eagle3Head, load_eagle3_head
from hearth.ops.attention import AttentionBackend, AttentionContext, select_backend
from hearth.parallel.state import parallel_state, single_rank

logger = logging.getLogger("hearth.spec")


@dataclass(eq=False)
class HeadSequence:
    """A request's state in the head's KV (a `PageHolder` for the head's `KVCacheManager`)."""

    num_consumed: int = 0  # positions computed from the target's states (their KV is final)
    features: list[torch.Tensor] = field(default_factory=list)  # aux vectors of positions num_consumed...
    num_features: int = 0
    tail_hidden: torch.Tensor | None = None  # fc(aux) of position num_consumed - 1 (to re-feed it)
    page_ids: list[int] = field(default_factory=list)
    page_generations: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    cached_page_count: int = 0
    page_keys: list[bytes] = field(default_factory=list)
    prefix_root: bytes = b""

    @property
    def all_token_ids(self) -> list[int]:  # the head's KV is never prefix-cached
        return []

    def add_features(self, start: int, aux: torch.Tensor) -> None:
        """The target's aux vectors of positions `start ...`; a gap before them gets zeros."""
        if start + len(aux) <= self.num_consumed:
            return
        if start < self.num_consumed:
            aux, start = aux[self.num_consumed - start :], self.num_consumed
        held_end = self.num_consumed + self.num_features
        if start < held_end:  # recomputed (preemption): the new vectors replace the held ones from `start`
            self._keep_features(start - self.num_consumed)
        elif start > held_end:
            self.features.append(aux.new_zeros(start - held_end, aux.shape[1]))
        self.features.append(aux)
        self.num_features = start + len(aux) - self.num_consumed

    def take_features(self, count: int, width: int, like: torch.Tensor) -> torch.Tensor:
        """The aux vectors of the next `count` positions (zeros for any never received); consumes them."""
        held = (
            torch.cat(self.features)
            if len(self.features) > 1
            else (self.features[0] if self.features else None)
        )
        if held is None:
            held = like.new_zeros(0, width)
        if len(held) < count:
            held = torch.cat([held, held.new_zeros(count - len(held), width)])
        out, rest = held[:count], held[count:]
        self.features = [rest] if len(rest) else []
        self.num_features = len(rest)
        self.num_consumed += count
        return out

    def _keep_features(self, count: int) -> None:
        held = torch.cat(self.features)[:count] if self.features else None
        self.features = [held] if held is not None and len(held) else []
        self.num_features = count if held is not None else 0


class Eagle3Proposer(Proposer):
    name = "eagle3"

    def __init__(
        self,
        head: Eagle3Head,
        target_model: Any,
        attention: AttentionBackend,
        kv_pool: KVPool,
        num_pages: int,
        page_size: int,
        vocab_size: int,
    ) -> None:
        self.head = head
        self.target_model = target_model  # its `aux_hidden` holds the last forward's aux vectors
        self.attention = attention
        self.kv_pool = kv_pool
        self.page_size = page_size
        self.vocab_size = vocab_size
        self.kv = KVCacheManager(num_pages, page_size, enable_prefix_caching=False)
        self._sequences: dict[str, HeadSequence] = {}
        self._last_step: tuple[ForwardBatch, torch.Tensor] | None = None
        self._aux_width = 3 * head.config.target_hidden_size

    # ---- the target's side ---------------------------------------------------------------------------

    def on_target_forward(self, step: ForwardBatch) -> None:
        aux = self.target_model.aux_hidden
        self._last_step = (step, aux) if aux is not None else None

    def target_step_done(self, batch: list[ScheduledRequest]) -> None:
        """Keep the aux vectors of each row's positions that its request kept (rows are in batch order)."""
        if self._last_step is None:
            return
        step, aux = self._last_step
        self._last_step = None
        if len(batch) != step.num_rows:
            return  # a step the integrity check cut rows from: its rows no longer match the batch
        starts = step.query_start_loc
        for row, item in enumerate(batch):
            request = item.request
            if request.status is RequestStatus.FINISHED:
                continue
            begin, end = starts[row], starts[row + 1]
            position = step.positions[begin]
            fed = step.token_ids[begin:end]
            tokens = request.token_ids
            kept = tokens[position : position + len(fed)]
            num_valid = len(fed) if kept == fed else _common_prefix(fed, kept)
            if num_valid:
                sequence = self._sequences.setdefault(request.request_id, HeadSequence())
                sequence.add_features(position, aux[begin : begin + num_valid])

    # ---- proposing -----------------------------------------------------------------------------------

    def request_finished(self, request_id: str) -> None:
        sequence = self._sequences.pop(request_id, None)
        if sequence is not None:
            self.kv.free(sequence)

    @torch.inference_mode()
    def propose(self, batch: list[ProposalRequest]) -> list[list[int]]:
        with single_rank():  # the head is whole on this rank, whatever the target's parallelism
            return self._propose(batch)

    def _propose(self, batch: list[ProposalRequest]) -> list[list[int]]:
        proposals: list[list[int]] = [[] for _ in batch]
        rows: list[tuple[int, HeadSequence, list[int], torch.Tensor]] = []
        wanted = {r.request_id for r in batch}
        catch_up: list[tuple[int, HeadSequence, list[int], int]] = []
        for index, request in enumerate(batch):
            sequence = self._sequences.setdefault(request.request_id, HeadSequence())
            tokens = request.token_ids
            if sequence.num_consumed > len(tokens) - 1:  # cannot happen unless tokens shrank: start over
                self.request_finished(request.request_id)
                sequence = self._sequences.setdefault(request.request_id, HeadSequence())
            count = len(tokens) - 1 - sequence.num_consumed
            refeed = count == 0 and sequence.tail_hidden is not None  # no target step since the last proposal
            if count == 0 and not refeed:
                continue
            start = sequence.num_consumed - 1 if refeed else sequence.num_consumed
            self.kv.truncate(sequence, start)  # the rollback: chained positions are recomputed
            needed = (len(tokens) - 1 - start) + request.num_tokens - 1
            if not self.kv.allocate_slots(sequence, needed):
                self._free_others(wanted)
                if not self.kv.allocate_slots(sequence, needed):
                    continue
            catch_up.append((index, sequence, tokens[start + 1 :], count))
        if not catch_up:
            return proposals
        # The fc of every catch-up row's aux vectors in one matmul.
        like = self.head.norm.weight
        pending = [seq.take_features(count, self._aux_width, like) for _, seq, _, count in catch_up if count]
        combined = (
            self.head.combine(torch.cat(pending).to(self.head.d2t.device, like.dtype)) if pending else None
        )
        offset = 0
        for index, sequence, feed, count in catch_up:
            parts = []
            if count == 0 or (sequence.tail_hidden is not None and len(feed) > count):
                parts.append(sequence.tail_hidden)
            if count:
                assert combined is not None
                parts.append(combined[offset : offset + count])
                offset += count
            hidden = parts[0] if len(parts) == 1 else torch.cat(parts)
            sequence.tail_hidden = hidden[-1:]
            rows.append((index, sequence, feed, hidden))
        while rows:
            tokens_out, outputs = self._forward([(seq, feed, hidden) for _, seq, feed, hidden in rows])
            survivors = []
            for k, ((index, sequence, _, _), token) in enumerate(zip(rows, tokens_out, strict=True)):
                if token >= self.vocab_size:  # outside what the target samples: stop guessing
                    continue
                proposals[index].append(token)
                if len(proposals[index]) < batch[index].num_tokens:
                    survivors.append((index, sequence, [token], outputs[k : k + 1]))
            rows = survivors
        return proposals

    def _free_others(self, keep_ids: set[str]) -> None:
        for request_id in [r for r in self._sequences if r not in keep_ids]:
            self.request_finished(request_id)

    def _forward(
        self, rows: list[tuple[HeadSequence, list[int], torch.Tensor]]
    ) -> tuple[list[int], torch.Tensor]:
        """One head step over the rows (each feeds its tokens after its computed ones with their hidden
        vectors); each row's guess (a target token id) and pre-norm output at its last position. One-token
        rows go first: the attention backend takes them as one decode batch."""
        order = decode_rows_first([feed for _, feed, _ in rows])
        step = proposer_step_input([(sequence, feed) for sequence, feed, _ in rows], order, self.page_size)
        hiddens = [rows[i][2] for i in order]
        device = self.head.d2t.device
        ids = torch.tensor(
            step.token_ids + step.positions + step.logits_indices, dtype=torch.long, device=device
        )
        n = len(step.token_ids)
        ctx = AttentionContext(self.attention, self.attention.prepare(step), self.kv_pool)
        hidden = hiddens[0] if len(hiddens) == 1 else torch.cat(hiddens)
        guesses, outputs = self.head(ids[:n], ids[n : 2 * n], hidden, ctx, ids[2 * n :])
        guessed = guesses.tolist()
        tokens = [0] * len(rows)
        inverse = [0] * len(rows)
        for position, i in enumerate(order):
            tokens[i] = guessed[position]
            inverse[i] = position
        return tokens, outputs[inverse] if order != sorted(order) else outputs


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def load_whole_embedding(model_dir: str, dtype: torch.dtype, device: torch.device) -> torch.nn.Embedding:
    """The target's whole input embedding table, read from its checkpoint (safetensors)."""
    from safetensors import safe_open

    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in ("model.embed_tokens.weight", "embed_tokens.weight", "model.embed.weight"):
                if name in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                    weight = handle.get_tensor(name).to(dtype=dtype, device=device)
                    return torch.nn.Embedding.from_pretrained(weight, freeze=True)
    raise ModelLoadError(f"{model_dir}: no embedding table found for the EAGLE-3 head")


def build(
    config: EngineConfig,
    model_config: ModelConfig,
    target_worker: Any,
    dtype: torch.dtype,
    num_pages: int,
    max_model_len: int,
    sample_vocab_size: int,
    device: torch.device,
    **_context: Any,
) -> Eagle3Proposer:
    assert config.speculative_model is not None
    # Rank 0's worker (the executor's own, under tensor parallelism): its target shard's residual stream is
    # whole after every layer's all-reduce, so the head reads the aux states here and runs whole on rank 0.
    worker = getattr(target_worker, "worker", target_worker)
    target_model = getattr(worker, "model", None)
    if target_model is None or not hasattr(target_model, "aux_hidden_layers"):
        raise ModelLoadError("--speculative-method eagle3: the target model keeps no aux hidden states")
    if parallel_state().pp_size > 1:
        raise ModelLoadError(
            "--speculative-method eagle3 with pipeline parallelism is not built yet: the head reads hidden states "
            "of layers on other stages (use --speculative-method draft or ngram, or tensor parallelism)"
        )
    head_config = Eagle3Config.from_dir(config.speculative_model, model_config.num_layers)
    if head_config.vocab_size != model_config.vocab_size:
        raise ModelLoadError(
            f"--speculative-model {config.speculative_model}: the head's vocab_size ({head_config.vocab_size}) "
            f"differs from the target's ({model_config.vocab_size})"
        )
    if head_config.target_hidden_size != model_config.hidden_size:
        raise ModelLoadError(
            f"--speculative-model {config.speculative_model}: the head reads hidden states of size "
            f"{head_config.target_hidden_size}, the target's are {model_config.hidden_size}"
        )
    max_positions = max_model_len + config.num_speculative_tokens + 1
    embed_tokens = target_model.model.embed_tokens
    if parallel_state().tp_size > 1:  # the target's table is split over the ranks: the head reads it whole
        embed_tokens = load_whole_embedding(config.model, dtype, device)
    with single_rank():
        head = load_eagle3_head(
            config.speculative_model, head_config, embed_tokens, dtype, max_positions, device
        )
    target_model.aux_hidden_layers = head_config.aux_layer_ids
    layout = KVLayout(
        num_layers=1,
        num_kv_heads=head_config.num_kv_heads,
        head_dim=head_config.head_dim,
        page_size=config.page_size,
        kv_dtype=resolve_kv_dtype("auto", dtype),
        kind="mha",
    )
    num_head_pages = (
        num_pages + config.max_num_seqs
    )  # the target's tokens plus a page per sequence of guesses
    kv_pool = KVPool(layout, num_head_pages, device)
    attention = select_backend(device)(
        device=device,
        page_size=config.page_size,
        max_num_seqs=config.max_num_seqs,
        max_pages_per_seq=-(-max_positions // config.page_size) + 1,
        dtype=dtype,
        kv_dtype=layout.kv_dtype,
        sliding_window=None,
    )
    proposer = Eagle3Proposer(
        head, target_model, attention, kv_pool, num_head_pages, config.page_size, sample_vocab_size
    )
    worker.after_forward = proposer.on_target_forward
    logger.info(
        "EAGLE-3 head %s: aux layers %s, draft vocab %d, %d KV pages",
        config.speculative_model,
        list(head_config.aux_layer_ids),
        head_config.draft_vocab_size,
        num_head_pages,
    )
    return proposer
