"""`suffix`: suffix decoding. Agents re-emit what they have seen: tool arguments from the prompt, file
contents and code they wrote a turn ago, the same tool-call envelope answer after answer. For each request
this proposer looks up the longest suffix of its tokens (up to `max_depth`) in two places and drafts what
most often followed there:

- the request's own prompt + output (`RequestCorpus`): what an answer copies from its context;
- the earlier answers of the same tenant (`TenantCorpora`, keyed by the request's prefix-cache root, which
  covers the tenant's `cache_salt`): what answers to similar requests said, bounded in tokens per tenant,
  oldest answers evicted first, least recently used tenants dropped.

The draft's length adapts to the match (`suffix_index.draft_length`: `tokens_per_match` tokens per matched
token, at most the K the speculator allows) and to its confidence (the walk stops where fewer than
`min_probability` of the matched places agree on the path); of the two lookups the one with more expected
accepted tokens wins. It needs only token ids, so it lives wholly on the scheduler's side, and a draft is a
function of the tokens and the tenant's earlier answers only (a one-hot proposal: the rejection sampler's
assumption holds, so sampling stays exact).
"""

from __future__ import annotations

from dataclasses import dataclass

from hearth.engine.speculative.proposer import ProposalRequest, Proposer
from hearth.engine.speculative.suffix_index import Draft, RequestCorpus, TenantCorpora


@dataclass(frozen=True, slots=True)
class SuffixOptions:
    max_depth: int = 32  # longest suffix matched (tokens)
    tokens_per_match: float = 2.0  # draft length per matched token (the confidence of a match)
    min_probability: float = 0.1  # stop drafting where fewer matched places agree on the path
    prompt_tail_tokens: int = 16  # of each prompt kept with its answer in the shared corpus
    max_tokens_per_tenant: int = 1 << 16  # 256 KiB of int32 per tenant
    max_tenants: int = 64

    def __post_init__(self) -> None:
        if self.max_depth < 1 or self.tokens_per_match <= 0 or not 0 < self.min_probability <= 1:
            raise ValueError(f"invalid suffix decoding options: {self}")


class SuffixProposer(Proposer):
    name = "suffix"
    sizes_own_drafts = True

    def __init__(self, options: SuffixOptions | None = None) -> None:
        self.options = options or SuffixOptions()
        self.shared = TenantCorpora(self.options.max_tokens_per_tenant, self.options.max_tenants)
        self._requests: dict[str, RequestCorpus] = {}

    def propose(self, batch: list[ProposalRequest]) -> list[list[int]]:
        return [self._propose_one(request) for request in batch]

    def _propose_one(self, request: ProposalRequest) -> list[int]:
        opts = self.options
        corpus = self._requests.get(request.request_id)
        if corpus is None:
            corpus = self._requests[request.request_id] = RequestCorpus()
        corpus.sync(request.token_ids)
        best: Draft | None = corpus.draft(
            opts.max_depth, request.num_tokens, opts.tokens_per_match, opts.min_probability
        )
        shared = self.shared.get(request.tenant)
        if shared is not None:
            other = shared.draft(
                corpus.context,
                opts.max_depth,
                request.num_tokens,
                opts.tokens_per_match,
                opts.min_probability,
            )
            if other is not None and (best is None or other.score > best.score):
                best = other
        return best.token_ids if best is not None else []

    def forget(self) -> None:
        """Drop every tenant's earlier answers (a benchmark replaying a trace starts each round afresh)."""
        self.shared = TenantCorpora(self.options.max_tokens_per_tenant, self.options.max_tenants)

    def request_done(self, request: ProposalRequest) -> None:
        """Index the finished answer (with its prompt's tail) for the tenant's later requests."""
        num_prompt = request.num_prompt_tokens
        if len(request.token_ids) <= num_prompt:
            return
        start = max(0, num_prompt - self.options.prompt_tail_tokens)
        self.shared.add(request.tenant, request.token_ids[start:])

    def request_finished(self, request_id: str) -> None:
        self._requests.pop(request_id, None)


def build(**_context: object) -> SuffixProposer:
    return SuffixProposer()
