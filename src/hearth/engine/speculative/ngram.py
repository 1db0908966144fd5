"""`ngram`: prompt lookup. Match the request's last n tokens earlier in its prompt + output and propose what
followed there. No model: it shines where the answer copies the request (tool-call arguments, JSON keys,
code edits) and costs a vectorized scan per request when it does not.
"""

from __future__ import annotations

import numpy as np

from hearth.engine.speculative.proposer import ProposalRequest, Proposer


def lookup(token_ids: list[int] | np.ndarray, num_tokens: int, min_n: int = 2, max_n: int = 4) -> list[int]:
    """The tokens that followed the most recent earlier occurrence of the longest suffix n-gram
    (max_n down to min_n) that occurs earlier; [] when none does."""
    tokens = np.asarray(token_ids)
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        # Start positions i < length - n where tokens[i : i + n] == suffix (the suffix itself excluded).
        candidates = np.flatnonzero(tokens[: length - n] == suffix[0])
        if n > 1 and len(candidates):
            windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
            candidates = candidates[(windows[candidates] == suffix).all(axis=1)]
        if len(candidates):
            start = int(candidates[-1]) + n  # the most recent match: in an answer, the closest context
            return tokens[start : start + num_tokens].tolist()
    return []


class NgramProposer(Proposer):
    name = "ngram"

    # min_n=1: on the demo model's tool calls a single matching token still predicts well (1.79 vs 1.59
    # tokens per verified step with min_n=2, greedy replay of 8 held-out prompts at K=4); adaptive K quiets it
    # where it does not.
    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, batch: list[ProposalRequest]) -> list[list[int]]:
        return [lookup(r.token_ids, r.num_tokens, self.min_n, self.max_n) for r in batch]


def build(**context: object) -> NgramProposer:
    lookup = getattr(context.get("config"), "ngram_lookup", None)  # vLLM's prompt_lookup_min/max
    return NgramProposer(*lookup) if lookup else NgramProposer()
