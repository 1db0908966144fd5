"""The model runner: a scheduled batch -> input tensors and attention context -> forward -> logits."""

from __future__ import annotations

import torch

from hearth.engine.scheduler import ScheduledRequest
from hearth.kv.pool import KVPool
from hearth.model.decoder import CausalLM
from hearth.ops.attention import AttentionContext, PrefillChunk


class ModelRunner:
    def __init__(self, model: CausalLM, pool: KVPool, sliding_window: int | None = None) -> None:
        self.model = model
        self.pool = pool
        self.page_size = pool.layout.page_size
        self.sliding_window = sliding_window
        self.kv_layers = [pool.layer(i) for i in range(pool.layout.num_layers)]

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledRequest]) -> torch.Tensor:
        """Logits (float32) for the rows of `batch` whose `samples` is true, in batch order."""
        token_ids: list[int] = []
        positions: list[int] = []
        logits_indices: list[int] = []
        for item in batch:
            start = item.request.num_computed_tokens
            end = start + item.num_new_tokens
            token_ids.extend(item.request.token_ids[start:end])
            positions.extend(range(start, end))
            if item.samples:
                logits_indices.append(len(token_ids) - 1)
        ctx = self._attention_context(batch)
        return self.model(
            torch.tensor(token_ids, dtype=torch.long),
            torch.tensor(positions, dtype=torch.long),
            ctx,
            self.kv_layers,
            torch.tensor(logits_indices, dtype=torch.long),
        )

    def _attention_context(self, batch: list[ScheduledRequest]) -> AttentionContext:
        page_size = self.page_size
        decodes = [item for item in batch if item.num_new_tokens == 1]
        slot_parts: list[torch.Tensor] = []
        ctx = AttentionContext(
            slot_mapping=torch.empty(0, dtype=torch.long), page_size=page_size, num_decode_tokens=len(decodes)
        )
        if decodes:
            context_lens = torch.tensor(
                [item.request.num_computed_tokens + 1 for item in decodes], dtype=torch.long
            )
            max_pages = max(len(item.request.page_ids) for item in decodes)
            table = torch.zeros(len(decodes), max_pages, dtype=torch.long)
            for row, item in enumerate(decodes):
                table[row, : len(item.request.page_ids)] = torch.tensor(item.request.page_ids)
            ctx.decode_page_table = table
            ctx.decode_context_lens = context_lens
            ctx.decode_first_positions = (
                (context_lens - self.sliding_window).clamp_(min=0)
                if self.sliding_window is not None
                else torch.zeros_like(context_lens)
            )
            last = context_lens - 1
            slot_parts.append(
                table.gather(1, (last // page_size)[:, None]).squeeze(1) * page_size + last % page_size
            )
        row = len(decodes)
        for item in batch[len(decodes) :]:
            request = item.request
            start = request.num_computed_tokens
            end = start + item.num_new_tokens
            page_ids = torch.tensor(request.page_ids[: -(-end // page_size)], dtype=torch.long)
            positions = torch.arange(start, end)
            slot_parts.append(page_ids[positions // page_size] * page_size + positions % page_size)
            mask = None
            window_bites = self.sliding_window is not None and end > self.sliding_window
            if start > 0 or window_bites:
                query_pos = torch.arange(start, end)[:, None]
                key_pos = torch.arange(end)[None, :]
                mask = key_pos <= query_pos
                if window_bites:
                    mask &= key_pos > query_pos - self.sliding_window
            ctx.prefills.append(PrefillChunk(row, item.num_new_tokens, page_ids, end, mask))
            row += item.num_new_tokens
        ctx.slot_mapping = torch.cat(slot_parts) if slot_parts else ctx.slot_mapping
        return ctx
