"""Vocabulary-parallel embedding and LM head: each tensor-parallel rank holds a contiguous block of
rows of the `[vocab, hidden]` matrix (the vocabulary padded up to a multiple of the TP size).

- The embedding looks up the ids in its block (zeros elsewhere) and all-reduces: every rank ends with
  every token's row.
- The LM head computes logits for its block and all-gathers them into the whole vocabulary (the
  padding columns are cut off), so the sampling rank sees what one rank would.

With one rank both are exactly `nn.Embedding` / `nn.Linear(bias=False)` over the whole vocabulary.
Their weight loaders read only this rank's rows of the checkpoint tensor (lazily, when it is a
`hearth.model.lazy_tensor.LazyTensor`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hearth.model.lazy_tensor import materialize
from hearth.model.weights import ShardId, TPRank, WeightShapeError, set_weight_attrs
from hearth.parallel.state import all_gather_tp, all_reduce_tp


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TPRank = TPRank()) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.tp = tp
        self.rows_per_rank = -(-vocab_size // tp.size)
        self.vocab_start = tp.rank * self.rows_per_rank
        # Rows of the checkpoint this rank holds (the last rank's block may run past the vocabulary).
        self.num_real_rows = max(0, min(vocab_size - self.vocab_start, self.rows_per_rank))
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, hidden_size), requires_grad=False)
        set_weight_attrs(self.weight, weight_loader=self.weight_loader, lazy_loading=True)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId | None = None
    ) -> None:
        if tuple(loaded_weight.shape) != (self.vocab_size, self.hidden_size):
            raise WeightShapeError(loaded_weight.shape, (self.vocab_size, self.hidden_size))
        rows = loaded_weight.narrow(0, self.vocab_start, self.num_real_rows)
        param.data[: self.num_real_rows].copy_(materialize(rows))
        param.data[self.num_real_rows :].zero_()

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(token_ids, self.weight)
        local = token_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_real_rows)
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)
        hidden.masked_fill_(outside.unsqueeze(-1), 0)
        return all_reduce_tp(hidden)

    def extra_repr(self) -> str:
        return f"rows {self.vocab_start}..{self.vocab_start + self.num_real_rows} of {self.vocab_size}, hidden={self.hidden_size}"


class ParallelLMHead(VocabParallelEmbedding):
    """The LM head's weight, block-split like the embedding (so a tied head *is* the embedding's block).
    `gather(local_logits)` turns this rank's `[rows, rows_per_rank]` logits into the whole vocabulary's."""

    def gather(self, local_logits: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return local_logits
        return all_gather_tp(local_logits, dim=-1)[:, : self.vocab_size]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.gather(F.linear(hidden, self.weight))
