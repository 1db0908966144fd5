"""Batched sampling: penalties, min_tokens, temperature, min-p, top-k, top-p, seeds and logprobs.

Semantics follow vLLM. Order per step: logprobs of the raw logits -> repetition, frequency and
presence penalties -> min_tokens masking -> greedy rows take the argmax; the other rows get
temperature -> min-p -> top-k -> top-p and are sampled by inverse CDF: one uniform number per row
from the row's own generator when seeded, so a seeded row gives the same tokens whatever else is
in the batch.

The common step (all greedy, no penalties, no logprobs) is one argmax over the batch.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from hearth.engine.outputs import TokenLogprob
from hearth.engine.sampling_params import SamplingParams

# Up to this k, top-k (and top-p after it) work on topk's candidates instead of sorting the vocabulary.
_MAX_TOP_K_CANDIDATES = 2048


@dataclass
class SamplingRow:
    """One row of the batch: the request's parameters and its tokens so far."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated before this step (may be left empty when no penalty reads it)
    generator: torch.Generator | None = None  # set for seeded requests, see make_generator
    num_output_tokens: int | None = None  # generated before this step, when output_token_ids is not given

    @property
    def num_outputs(self) -> int:
        return len(self.output_token_ids) if self.num_output_tokens is None else self.num_output_tokens


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]  # None for rows whose params.logprobs is None


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A request's own random stream. Create it once per request and pass it in every step."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def _flat_index(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """`row * vocab + token` for every in-range token of every row, as one tensor (no per-token Python)."""
    lengths = torch.tensor([len(tokens) for tokens in token_lists])
    tokens = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.long)
    row_of = torch.repeat_interleave(torch.arange(len(token_lists)), lengths)
    valid = (tokens >= 0) & (tokens < vocab)
    return (row_of[valid] * vocab + tokens[valid]).to(device)


def _finite_or_forbidden(logits: torch.Tensor) -> torch.Tensor:
    """+inf (a tiny repetition penalty or temperature overflowing float32) becomes the largest finite value
    and NaN becomes -inf, in place. Two +inf logits make softmax NaN, and a NaN row's inverse CDF picks the
    last column, which a grammar mask (-inf) forbids: the client would get a 500 for its own parameters.
    -inf stays -inf: it is what a grammar mask or a stop-token ban wrote."""
    return logits.nan_to_num_(nan=float("-inf"), posinf=torch.finfo(logits.dtype).max, neginf=float("-inf"))


def _add_logit_bias(logits: torch.Tensor, rows: list[SamplingRow], bias_rows: list[int]) -> None:
    """OpenAI's `logit_bias` (issue 27): {token id: bias} added to the raw logits, first, as vLLM does.
    Ids are checked against the vocabulary when the request is added."""
    flat_rows: list[int] = []
    flat_cols: list[int] = []
    values: list[float] = []
    for i in bias_rows:
        bias = rows[i].params.logit_bias
        assert bias is not None
        flat_rows.extend([i] * len(bias))
        flat_cols.extend(bias)
        values.extend(bias.values())
    logits.index_put_(
        (torch.tensor(flat_rows, device=logits.device), torch.tensor(flat_cols, device=logits.device)),
        torch.tensor(values, dtype=logits.dtype, device=logits.device),
        accumulate=True,
    )


class Sampler:
    """Picks one token per row. `vocab_size` bounds the ids (the logits may be padded wider)."""

    def __init__(self, vocab_size: int, eos_token_ids: set[int]) -> None:
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(t for t in eos_token_ids if 0 <= t < vocab_size)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [len(rows)={len(rows)}, vocab], got {tuple(logits.shape)}")
        if logits.shape[1] < self.vocab_size:
            raise ValueError(
                f"logits have {logits.shape[1]} columns, fewer than vocab_size={self.vocab_size}"
            )
        if not rows:
            return SamplerOutput([], [])
        logits = logits[:, : self.vocab_size]
        params = [row.params for row in rows]

        random_rows: list[int] = []
        penalty_rows: list[int] = []
        logprob_rows: list[int] = []
        min_token_rows: list[int] = []
        bias_rows: list[int] = []
        for i, row in enumerate(rows):
            p = row.params
            if not p.greedy:
                random_rows.append(i)
            if p.needs_penalties:
                penalty_rows.append(i)
            if p.logit_bias:
                bias_rows.append(i)
            if p.logprobs is not None:
                logprob_rows.append(i)
            if row.num_outputs < p.min_tokens:
                min_token_rows.append(i)

        if not (random_rows or penalty_rows or logprob_rows or min_token_rows or bias_rows):
            return SamplerOutput(logits.argmax(dim=-1).tolist(), [None] * len(rows))

        raw_logprobs = torch.log_softmax(logits[logprob_rows].float(), dim=-1) if logprob_rows else None
        logits = self._process(logits, rows, penalty_rows, min_token_rows, bias_rows)

        token_ids = logits.argmax(dim=-1)
        if random_rows:
            index = torch.tensor(random_rows, device=logits.device)
            sampled = self._sample(logits[index], [rows[i] for i in random_rows])
            token_ids = token_ids.index_copy(0, index, sampled)

        token_list: list[int] = token_ids.tolist()
        logprobs: list[TokenLogprob | None] = [None] * len(rows)
        if raw_logprobs is not None:
            self._gather_logprobs(raw_logprobs, token_ids, params, logprob_rows, logprobs)
        return SamplerOutput(token_list, logprobs)

    # ---- logit processing -------------------------------------------------------------------

    def processed_logits(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """The logits after penalties and min_tokens masking (a new tensor): what greedy rows argmax."""
        logits = logits[:, : self.vocab_size]
        penalty_rows = [i for i, row in enumerate(rows) if row.params.needs_penalties]
        min_token_rows = [i for i, row in enumerate(rows) if row.num_outputs < row.params.min_tokens]
        bias_rows = [i for i, row in enumerate(rows) if row.params.logit_bias]
        processed = self._process(logits, rows, penalty_rows, min_token_rows, bias_rows)
        return processed.clone() if processed.data_ptr() == logits.data_ptr() else processed

    def _process(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        penalty_rows: list[int],
        min_token_rows: list[int],
        bias_rows: list[int] | None = None,
    ) -> torch.Tensor:
        if not (penalty_rows or min_token_rows or bias_rows):
            return logits.float()  # nothing to change in place, so no copy
        logits = logits.float().clone()
        if bias_rows:
            _add_logit_bias(logits, rows, bias_rows)
        if penalty_rows:
            self._apply_penalties(logits, [rows[i] for i in penalty_rows], penalty_rows)
        if min_token_rows:
            self._mask_stop_tokens(logits, [rows[i] for i in min_token_rows], min_token_rows)
        return _finite_or_forbidden(logits)

    def _apply_penalties(self, logits: torch.Tensor, rows: list[SamplingRow], row_index: list[int]) -> None:
        """Repetition (prompt + output, HF/CTRL style), then frequency and presence (output only)."""
        vocab = self.vocab_size
        device = logits.device
        num_rows = len(rows)
        output_index = _flat_index([row.output_token_ids for row in rows], vocab, device)
        counts = torch.bincount(output_index, minlength=num_rows * vocab).view(num_rows, vocab)
        output_mask = counts > 0
        sub = logits[row_index]

        if any(row.params.repetition_penalty != 1.0 for row in rows):
            seen = torch.zeros(num_rows * vocab, dtype=torch.bool, device=device)
            seen[_flat_index([row.prompt_token_ids for row in rows], vocab, device)] = True
            seen = seen.view(num_rows, vocab) | output_mask
            penalty = torch.tensor([row.params.repetition_penalty for row in rows], device=device)[:, None]
            penalized = torch.where(sub > 0, sub / penalty, sub * penalty)
            sub = torch.where(seen, penalized, sub)

        frequency = torch.tensor([row.params.frequency_penalty for row in rows], device=device)[:, None]
        presence = torch.tensor([row.params.presence_penalty for row in rows], device=device)[:, None]
        sub = sub - frequency * counts - presence * output_mask
        logits[row_index] = sub

    def _mask_stop_tokens(self, logits: torch.Tensor, rows: list[SamplingRow], row_index: list[int]) -> None:
        """Before min_tokens are out, neither EOS (unless ignored) nor a stop token may be picked."""
        flat_rows: list[int] = []
        flat_cols: list[int] = []
        for r, row in zip(row_index, rows, strict=True):
            banned = {t for t in row.params.stop_token_ids if t < self.vocab_size}
            if not row.params.ignore_eos:
                banned.update(self.eos_token_ids)
            flat_rows.extend([r] * len(banned))
            flat_cols.extend(banned)
        if flat_rows:
            logits[flat_rows, flat_cols] = float("-inf")

    def target_probs(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """The distribution each (non-greedy) row samples from: penalties, min_tokens, temperature, min-p,
        top-k, top-p applied; float32 `[len(rows), vocab_size]`. Speculative decoding's rejection sampler
        verifies drafts against it."""
        logits = self.processed_logits(logits, rows)
        return self._probs(logits, rows)

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        return self._inverse_cdf_draw(self._probs(logits, rows), rows)

    def _probs(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        device = logits.device
        params = [row.params for row in rows]
        temperature = torch.tensor([p.temperature for p in params], device=device)[:, None]
        logits = _finite_or_forbidden(logits / temperature)

        min_p = [p.min_p for p in params]
        if any(v > 0.0 for v in min_p):
            probs = torch.softmax(logits, dim=-1)
            threshold = torch.tensor(min_p, device=device)[:, None] * probs.amax(dim=-1, keepdim=True)
            logits = logits.masked_fill(probs < threshold, float("-inf"))

        vocab = logits.shape[1]
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        top_p = [p.top_p for p in params]
        wants_top_p = any(v < 1.0 for v in top_p)
        if max(top_k) < vocab and max(top_k) <= _MAX_TOP_K_CANDIDATES:
            # Every row keeps at most k tokens: work on topk's candidates, no sort of the vocabulary.
            logits = self._top_k_candidates(logits, top_k, top_p if wants_top_p else None)
        elif wants_top_p:
            logits = self._top_k_top_p_sorted(logits, top_k, top_p)
        elif any(k < vocab for k in top_k):
            logits = self._top_k_threshold(logits, top_k)

        return torch.softmax(logits, dim=-1)

    @staticmethod
    def _top_k_candidates(logits: torch.Tensor, top_k: list[int], top_p: list[float] | None) -> torch.Tensor:
        device = logits.device
        values, ids = logits.topk(max(top_k), dim=-1)  # sorted, most likely first
        beyond_k = (
            torch.arange(values.shape[1], device=device)[None, :]
            >= torch.tensor(top_k, device=device)[:, None]
        )
        values = values.masked_fill(beyond_k, float("-inf"))
        if top_p is not None:
            probs = torch.softmax(values, dim=-1)
            # Keep a token while the mass before it is below top_p, so the most likely one always stays.
            mass_before = probs.cumsum(dim=-1) - probs
            values.masked_fill_(mass_before >= torch.tensor(top_p, device=device)[:, None], float("-inf"))
        return torch.full_like(logits, float("-inf")).scatter_(1, ids, values)

    @staticmethod
    def _top_k_threshold(logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
        # Some rows have no top-k: take the k-th value from topk over the largest k in use only.
        vocab = logits.shape[1]
        device = logits.device
        max_k = max(k for k in top_k if k < vocab)
        top_values = logits.topk(max_k, dim=-1).values
        position = torch.tensor([min(k, max_k) - 1 for k in top_k], device=device)[:, None]
        has_k = torch.tensor([k < vocab for k in top_k], device=device)[:, None]
        kth_value = torch.where(has_k, top_values.gather(1, position), float("-inf"))
        return logits.masked_fill(logits < kth_value, float("-inf"))

    @staticmethod
    def _top_k_top_p_sorted(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
        vocab = logits.shape[1]
        sorted_logits, order = logits.sort(dim=-1, descending=False)
        if any(k < vocab for k in top_k):
            kth_position = torch.tensor([vocab - k for k in top_k], device=logits.device)[:, None]
            kth_value = sorted_logits.gather(1, kth_position)
            sorted_logits.masked_fill_(sorted_logits < kth_value, float("-inf"))
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # Drop the low tail whose total stays within 1 - top_p; the most likely token always stays.
        drop = cumulative <= 1.0 - torch.tensor(top_p, device=logits.device)[:, None]
        drop[:, -1] = False
        sorted_logits.masked_fill_(drop, float("-inf"))
        return torch.empty_like(sorted_logits).scatter_(1, order, sorted_logits)

    @staticmethod
    def _inverse_cdf_draw(probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """One uniform number per row, looked up in the row's cumulative distribution.

        A race over the whole vocabulary (Gumbel / exponential) needs a random number per token,
        which on CPU costs more than everything else in the step at a 150k vocabulary; this needs
        one per row, so seeded rows stay cheap and independent of the batch.
        """
        cdf = probs.cumsum(dim=-1)
        uniform = torch.empty(probs.shape[0], 1, dtype=cdf.dtype, device=probs.device)
        seeded = [i for i, row in enumerate(rows) if row.generator is not None]
        if len(seeded) < len(rows):
            uniform.uniform_()  # unseeded rows share the global stream
        for i in seeded:
            generator = rows[i].generator
            assert generator is not None
            draw = torch.rand(1, device=generator.device, generator=generator, dtype=cdf.dtype)
            uniform[i] = draw.to(probs.device)
        # Scale into the row's total mass; a floor above zero keeps zero-probability leading tokens out.
        target = (uniform * cdf[:, -1:]).clamp_(min=torch.finfo(cdf.dtype).tiny)
        return torch.searchsorted(cdf, target).squeeze(1).clamp_(max=probs.shape[1] - 1)

    # ---- logprobs ---------------------------------------------------------------------------

    @staticmethod
    def _gather_logprobs(
        raw_logprobs: torch.Tensor,
        token_ids: torch.Tensor,
        params: list[SamplingParams],
        logprob_rows: list[int],
        out: list[TokenLogprob | None],
    ) -> None:
        index = torch.tensor(logprob_rows, device=raw_logprobs.device)
        chosen = raw_logprobs.gather(1, token_ids[index][:, None]).squeeze(1).tolist()
        chosen_ids = token_ids[index].tolist()
        counts = [params[i].logprobs or 0 for i in logprob_rows]
        top_values: list[list[float]] = [[] for _ in logprob_rows]
        top_ids: list[list[int]] = [[] for _ in logprob_rows]
        if max(counts) > 0:
            values, ids = raw_logprobs.topk(max(counts), dim=-1)
            top_values, top_ids = values.tolist(), ids.tolist()
        for j, row in enumerate(logprob_rows):
            n = counts[j]
            top = list(zip(top_ids[j][:n], top_values[j][:n], strict=True))
            out[row] = TokenLogprob(token_id=chosen_ids[j], logprob=chosen[j], top=top)
