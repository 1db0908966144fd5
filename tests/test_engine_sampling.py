"""Sampling through the whole engine: seeds, stop strings, stop tokens, logprobs, penalties."""

from __future__ import annotations

import math

import pytest

from hearth import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), dtype="float32")


def test_seed_gives_same_output_whatever_the_batch(llm):
    prompt = list(range(20, 40))
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([prompt], seeded)[0].token_ids
    noise = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    batched = llm.generate([list(range(3, 9)), prompt, list(range(100, 140))], [noise, seeded, noise])[
        1
    ].token_ids
    assert alone == batched
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=4321, max_tokens=16, ignore_eos=True)
    assert llm.generate([prompt], other_seed)[0].token_ids != alone


def test_stop_string_ends_output_and_never_leaks(llm):
    prompt = list(range(40, 60))
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    assert len(free.text) > 6
    stop = free.text[3:6]  # a stop string that appears in the greedy text, likely across tokens
    result = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop])
    )[0]
    assert result.finish_reason == "stop" and result.stop_reason == stop
    assert result.text == free.text[: free.text.index(stop)]
    included = llm.generate(
        [prompt],
        SamplingParams(
            temperature=0, max_tokens=30, ignore_eos=True, stop=[stop], include_stop_str_in_output=True
        ),
    )[0]
    assert included.text == free.text[: free.text.index(stop)] + stop


def test_stop_token_ids_and_max_tokens(llm):
    prompt = list(range(60, 80))
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 10
    stop_id = free.token_ids[4]
    first = free.token_ids.index(stop_id)
    result = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop_token_ids=[stop_id])
    )[0]
    assert result.finish_reason == "stop" and result.stop_reason == stop_id
    assert result.token_ids == free.token_ids[: first + 1]


def test_logprobs_of_sampled_and_top_tokens(llm):
    result = llm.generate(
        [list(range(5, 25))], SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True)
    )[0]
    assert len(result.logprobs) == 5
    for token_id, entry in zip(result.token_ids, result.logprobs):
        assert entry.token_id == token_id
        assert len(entry.top) == 3
        assert entry.top[0][0] == token_id  # greedy picks the most likely token
        assert math.isclose(entry.logprob, entry.top[0][1], rel_tol=1e-5)
        assert entry.top[0][1] >= entry.top[1][1] >= entry.top[2][1]


def test_repetition_penalty_changes_greedy_output(llm):
    prompt = [7] * 30
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].token_ids
    penalized = llm.generate(
        [prompt],
        SamplingParams(
            temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=5.0, frequency_penalty=2.0
        ),
    )[0].token_ids
    assert penalized != plain
    assert len(set(penalized)) >= len(set(plain))


def test_min_tokens_and_ignore_eos(llm):
    eos = next(iter(llm.engine.eos_token_ids))
    result = llm.generate(
        [list(range(9, 19))], SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[], ignore_eos=True)
    )[0]
    assert len(result.token_ids) == 6
    result = llm.generate([list(range(9, 19))], SamplingParams(temperature=0, max_tokens=6, min_tokens=6))[0]
    assert len(result.token_ids) == 6 and eos not in result.token_ids[:-1]


def test_bad_requests_raise_and_leave_nothing_behind(llm):
    from hearth.engine.sampling_params import InvalidParamError

    with pytest.raises(InvalidParamError):
        llm.generate([[1] * (llm.engine.max_model_len + 5)], SamplingParams())
    with pytest.raises(InvalidParamError):
        llm.generate([[10**9]], SamplingParams())
    with pytest.raises(InvalidParamError):
        SamplingParams(temperature=float("nan"))
    assert llm.engine.stats().kv_pages_used == 0 and not llm.engine.has_work
