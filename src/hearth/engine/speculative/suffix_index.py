"""Token corpora searched by suffix: the bookkeeping behind `suffix` decoding (plain NumPy, no model).

`longest_match` finds every earlier place where the longest suffix of a context (up to `max_depth` tokens)
occurs in a corpus; `continuation` walks forward from those places, taking at each step the token most of
them continue with, and stops when the share of places that agree on the whole path (the draft's estimated
probability) drops below `min_probability`. That is what a suffix tree's node below the matched path holds
(its subtree counts), found here by a vectorized scan over the corpus instead of a tree: a tree costs
`max_depth` dict operations per indexed token in Python (a 4,000-token prompt: ~50 ms), the scan ~10-50 us
per lookup at the sizes kept here.

`RequestCorpus` is one request's tokens (prompt + output), appended as they come. `SharedCorpus` holds the
finished outputs of one tenant's earlier requests (each with the tail of its prompt, so an answer's first
tokens can match the assistant header), separated by `SEPARATOR`, bounded in tokens: the oldest answers are
evicted first. `TenantCorpora` keeps one per tenant (least recently used evicted), so one tenant's answers
never shape another's drafts (nor their timing).
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from dataclasses import dataclass

import numpy as np

SEPARATOR = -1  # between answers in a shared corpus: matches no token, ends every continuation
_MAX_CANDIDATES = 512  # most recent places kept once a match is this common (recency predicts best)
_MAX_SCANNED = 4096  # most recent places of the last token compared further


@dataclass(slots=True)
class Draft:
    token_ids: list[int]
    probabilities: list[float]  # of each prefix of the draft: the share of matched places agreeing on it
    match_length: int

    @property
    def score(self) -> float:
        """Expected accepted tokens if the probabilities held: what two drafts are compared by."""
        return float(sum(self.probabilities))


def longest_match(
    corpus: np.ndarray, end: int, context: np.ndarray, max_depth: int
) -> tuple[np.ndarray, int]:
    """Positions p < end - 1 where corpus[p - n + 1 : p + 1] equals the last n tokens of `context`, for the
    largest such n <= max_depth, and n; (empty, 0) when even the last token occurs nowhere before `end - 1`.
    Every returned p has a next token at p + 1 < end."""
    if len(context) == 0 or end < 2:
        return np.empty(0, dtype=np.int64), 0
    candidates = np.flatnonzero(corpus[: end - 1] == context[-1])[-_MAX_SCANNED:]
    if len(candidates) == 0:
        return candidates, 0
    depth = min(max_depth, len(context))
    # Each candidate's window backwards against the context's tail reversed, all in one gather: the
    # length of the leading run of agreement is the match length at that place.
    back = candidates[:, None] - np.arange(depth)[None, :]
    agree = (corpus[np.maximum(back, 0)] == context[::-1][None, :depth]) & (back >= 0)
    lengths = np.where(agree.all(axis=1), depth, agree.argmin(axis=1))
    best = int(lengths.max())
    return candidates[lengths == best][-_MAX_CANDIDATES:], best


def draft_length(match_length: int, max_tokens: int, tokens_per_match: float) -> int:
    """Adaptive length by confidence: a longer matched suffix earns a longer draft (at least one token)."""
    return max(1, min(max_tokens, int(match_length * tokens_per_match)))


def continuation(
    corpus: np.ndarray, end: int, positions: np.ndarray, max_tokens: int, min_probability: float
) -> tuple[list[int], list[float]]:
    """From matched `positions`, the most common path forward (ties: the most recent place's token), token by
    token while the share of places agreeing on the whole path stays >= min_probability."""
    tokens: list[int] = []
    probabilities: list[float] = []
    total = len(positions)
    following = positions + 1
    while len(tokens) < max_tokens and total:
        following = following[following < end]
        if len(following) == 0:
            break
        if len(following) == 1:  # one place left: its tokens up to the end or a separator, in one slice
            start = int(following[0])
            run = corpus[start : min(end, start + max_tokens - len(tokens))]
            stops = np.flatnonzero(run == SEPARATOR)
            run = run[: stops[0]] if len(stops) else run
            if 1 / total >= min_probability:
                tokens.extend(run.tolist())
                probabilities.extend([1 / total] * len(run))
            break
        nexts = corpus[following]
        if len(nexts) <= 64:  # few places: counting in Python beats np.unique's sort
            listed = nexts.tolist()
            counts = Counter(listed)
            best = max(counts.values())
            # Ties: the most recent place's token (places are in corpus order).
            token = next(t for t in reversed(listed) if counts[t] == best)
        else:
            values, value_counts = np.unique(nexts, return_counts=True)
            best = int(value_counts.max())
            winners = values[value_counts == best]
            token = int(winners[0]) if len(winners) == 1 else int(nexts[np.isin(nexts, winners)][-1])
        probability = best / total
        if token == SEPARATOR or probability < min_probability:
            break
        tokens.append(token)
        probabilities.append(probability)
        following = following[nexts == token] + 1
    return tokens, probabilities


class RequestCorpus:
    """One request's tokens as a growing int32 array (tokens are only ever appended to a request)."""

    __slots__ = ("tokens", "length")

    def __init__(self) -> None:
        self.tokens = np.empty(256, dtype=np.int32)
        self.length = 0

    def sync(self, token_ids: list[int]) -> None:
        """Catch up with the request's tokens (a shorter list, which a request never has, starts over)."""
        if len(token_ids) < self.length:
            self.length = 0
        new = token_ids[self.length :]
        if not new:
            return
        needed = self.length + len(new)
        if needed > len(self.tokens):
            grown = np.empty(max(needed, 2 * len(self.tokens)), dtype=np.int32)
            grown[: self.length] = self.tokens[: self.length]
            self.tokens = grown
        self.tokens[self.length : needed] = new
        self.length = needed

    @property
    def context(self) -> np.ndarray:
        return self.tokens[: self.length]

    def draft(
        self, max_depth: int, max_tokens: int, tokens_per_match: float, min_probability: float
    ) -> Draft | None:
        end = self.length
        context = self.tokens[max(0, end - max_depth) : end]
        positions, depth = longest_match(self.tokens, end, context, max_depth)
        if depth == 0:
            return None
        limit = draft_length(depth, max_tokens, tokens_per_match)
        tokens, probabilities = continuation(self.tokens, end, positions, limit, min_probability)
        return Draft(tokens, probabilities, depth) if tokens else None


class SharedCorpus:
    """Earlier answers of one tenant, oldest evicted first once `max_tokens` would be exceeded."""

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 2:
            raise ValueError(f"a shared corpus needs room for at least 2 tokens, got {max_tokens}")
        self.max_tokens = max_tokens
        self.tokens = np.full(min(max_tokens, 4096), SEPARATOR, dtype=np.int32)
        self.length = 0
        self._spans: deque[int] = deque()  # length of each held answer (with its separator), oldest first

    def add(self, token_ids: list[int]) -> None:
        """One finished answer (with its prompt's tail); a longer one than fits keeps its last tokens."""
        token_ids = token_ids[-(self.max_tokens - 1) :]
        span = len(token_ids) + 1
        if not token_ids:
            return
        while self.length + span > self.max_tokens:
            self._evict_oldest()
        needed = self.length + span
        if needed > len(self.tokens):
            grown = np.full(min(self.max_tokens, max(needed, 2 * len(self.tokens))), SEPARATOR, np.int32)
            grown[: self.length] = self.tokens[: self.length]
            self.tokens = grown
        self.tokens[self.length : needed - 1] = token_ids
        self.tokens[needed - 1] = SEPARATOR
        self.length = needed
        self._spans.append(span)

    def _evict_oldest(self) -> None:
        span = self._spans.popleft()
        self.tokens[: self.length - span] = self.tokens[span : self.length]
        self.length -= span

    @property
    def num_answers(self) -> int:
        return len(self._spans)

    def draft(
        self,
        context: np.ndarray,
        max_depth: int,
        max_tokens: int,
        tokens_per_match: float,
        min_probability: float,
    ) -> Draft | None:
        """Where the tail of `context` (a request's tokens) occurs in earlier answers, what followed."""
        # Every held answer ends with a separator, so each matched place has a next entry to look at.
        positions, depth = longest_match(self.tokens, self.length + 1, context[-max_depth:], max_depth)
        if depth == 0:
            return None
        limit = draft_length(depth, max_tokens, tokens_per_match)
        tokens, probabilities = continuation(self.tokens, self.length, positions, limit, min_probability)
        return Draft(tokens, probabilities, depth) if tokens else None


class TenantCorpora:
    """A `SharedCorpus` per tenant key, at most `max_tenants` of them (least recently used evicted)."""

    def __init__(self, max_tokens_per_tenant: int, max_tenants: int) -> None:
        if max_tenants < 1:
            raise ValueError(f"max_tenants must be >= 1, got {max_tenants}")
        self.max_tokens_per_tenant = max_tokens_per_tenant
        self.max_tenants = max_tenants
        self._corpora: OrderedDict[bytes, SharedCorpus] = OrderedDict()

    def get(self, tenant: bytes) -> SharedCorpus | None:
        corpus = self._corpora.get(tenant)
        if corpus is not None:
            self._corpora.move_to_end(tenant)
        return corpus

    def add(self, tenant: bytes, token_ids: list[int]) -> None:
        corpus = self.get(tenant)
        if corpus is None:
            corpus = self._corpora[tenant] = SharedCorpus(self.max_tokens_per_tenant)
            while len(self._corpora) > self.max_tenants:
                self._corpora.popitem(last=False)
        corpus.add(token_ids)

    def __len__(self) -> int:
        return len(self._corpora)
