"""Prompt logprobs in the engine: every prompt token but the first scored given the ones before it, through
chunked prefill and past the prefix cache, equal to transformers' log-softmax of the same forward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hearth.engine.llm import LLM
from hearth.engine.messages import EngineRequest
from hearth.engine.outputs import TokenLogprob
from hearth.engine.sampling_params import SamplingParams

PROMPT = [5 + (7 * i) % 200 for i in range(37)]


def _hf_prompt_logprobs(model_dir: Path, prompt: list[int]) -> torch.Tensor:
    from hf_oracle import _load

    with torch.no_grad():
        logits = _load(str(model_dir))(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]  # position p scores token p + 1


def _run(llm: LLM, request_id: str, prompt: list[int], params: SamplingParams) -> list[TokenLogprob] | None:
    engine = llm.engine
    engine.add_request(EngineRequest(request_id, prompt, params))
    found = None
    while engine.has_work:
        for output in engine.step():
            if output.request_id == request_id and output.prompt_logprobs is not None:
                assert found is None, "prompt logprobs come once"
                found = output.prompt_logprobs
    return found


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    # 8 tokens a step: the 37-token prompt is prefilled in 5 chunks.
    return LLM(
        str(tiny_llama), dtype="float32", kv_cache_memory_gib=0.01, max_num_batched_tokens=8, page_size=4
    )


def _check(entries: list[TokenLogprob], expected: torch.Tensor, prompt: list[int], num_top: int) -> None:
    assert [e.token_id for e in entries] == prompt[1:]
    for position, entry in enumerate(entries):
        row = expected[position]
        assert entry.logprob == pytest.approx(row[prompt[position + 1]].item(), abs=1e-4)
        assert entry.rank == int((row > row[prompt[position + 1]]).sum()) + 1
        top_ids = [token_id for token_id, _ in entry.top]
        assert len(top_ids) == num_top
        assert top_ids == row.topk(num_top).indices.tolist()


def test_every_prompt_token_but_the_first_matches_transformers(llm: LLM, tiny_llama: Path) -> None:
    entries = _run(llm, "a", PROMPT, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3))
    assert entries is not None and len(entries) == len(PROMPT) - 1
    _check(entries, _hf_prompt_logprobs(tiny_llama, PROMPT), PROMPT, 3)


def test_a_cached_prompt_is_still_scored_in_full(llm: LLM, tiny_llama: Path) -> None:
    prompt = PROMPT[::-1]
    assert _run(llm, "warm", prompt, SamplingParams(max_tokens=1, temperature=0.0)) is None
    entries = _run(llm, "scored", prompt, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))
    assert entries is not None
    _check(entries, _hf_prompt_logprobs(tiny_llama, prompt), prompt, 0)


def test_requests_without_prompt_logprobs_beside_one_with_them_are_unchanged(llm: LLM) -> None:
    plain = SamplingParams(max_tokens=6, temperature=0.0)
    alone = llm.generate([PROMPT[:20]], plain)[0].token_ids
    engine = llm.engine
    engine.add_request(EngineRequest("plain", PROMPT[:20], plain))
    engine.add_request(EngineRequest("scored", PROMPT, SamplingParams(max_tokens=2, prompt_logprobs=1)))
    tokens: list[int] = []
    while engine.has_work:
        for output in engine.step():
            if output.request_id == "plain":
                tokens += output.new_token_ids
                assert output.prompt_logprobs is None
    assert tokens == alone


def test_a_one_token_prompt_has_no_prompt_logprobs(llm: LLM) -> None:
    assert _run(llm, "one", [9], SamplingParams(max_tokens=1, prompt_logprobs=2)) == []
