"""Verifying a sampled row's drafts without changing what the target samples: rejection sampling.

Draft i is accepted with probability min(1, p_i(d_i) / q_i(d_i)), where p_i is the target's distribution at
that position (everything the sampler applies: penalties counting the drafts before it, min_tokens,
temperature, min-p, top-k, top-p, the grammar mask). On the first rejection the token is drawn from
max(0, p_i - q_i) renormalized and the row ends; if every draft is accepted, one more token is drawn from
p_k. Every proposer here is deterministic, so q_i is one-hot at d_i: accept with probability p_i(d_i), and
on rejection draw from p_i with d_i removed. Each emitted token then has exactly the target's distribution
(Leviathan et al. 2023, Chen et al. 2023).

A row draws len(drafts) + 1 uniforms whatever happens, from its own generator when seeded, so a seeded
request's stream does not depend on where a rejection fell in earlier steps.
"""

from __future__ import annotations

import torch

from hearth.engine.outputs import TokenLogprob
from hearth.engine.sampler import Sampler, SamplingRow


def _draw(generator: torch.Generator | None, count: int) -> list[float]:
    if generator is None:
        return torch.rand(count, dtype=torch.float64).tolist()
    return torch.rand(count, generator=generator, device=generator.device, dtype=torch.float64).tolist()


def _inverse_cdf(probs: torch.Tensor, uniform: float) -> int:
    cdf = probs.double().cumsum(dim=0)
    target = max(uniform * float(cdf[-1]), torch.finfo(torch.float64).tiny)
    return min(int(torch.searchsorted(cdf, torch.tensor([target], dtype=torch.float64))), len(probs) - 1)


def rejection_sample(
    sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow], draft_token_ids: list[int]
) -> tuple[list[int], list[TokenLogprob] | None]:
    """One row: `logits` `[1 + k, vocab]` at its positions (masks applied), `rows` the per-position sampling
    rows (same params and generator). Returns the kept tokens (accepted drafts + one drawn) and, when the
    row asks for them, their logprobs."""
    num_drafts = len(draft_token_ids)
    probs = sampler.target_probs(logits, rows)
    uniforms = _draw(rows[0].generator, num_drafts + 1)
    positions = torch.arange(num_drafts, device=probs.device)
    drafts = torch.tensor(draft_token_ids, dtype=torch.long, device=probs.device)
    p_at_draft = probs[positions, drafts].tolist()
    tokens: list[int] = []
    for i, draft in enumerate(draft_token_ids):
        if uniforms[i] < p_at_draft[i]:
            tokens.append(draft)
            continue
        residual = probs[i].clone()
        residual[draft] = 0.0
        tokens.append(_inverse_cdf(residual, uniforms[num_drafts]))
        break
    else:
        tokens.append(_inverse_cdf(probs[num_drafts], uniforms[num_drafts]))
    params = rows[0].params
    if params.logprobs is None:
        return tokens, None
    raw_logprobs = torch.log_softmax(logits[: len(tokens), : sampler.vocab_size].float(), dim=-1)
    out: list[TokenLogprob | None] = [None] * len(tokens)
    Sampler._gather_logprobs(
        raw_logprobs,
        torch.tensor(tokens, device=raw_logprobs.device),
        [params] * len(tokens),
        list(range(len(tokens))),
        out,
    )
    return tokens, [lp for lp in out if lp is not None]
