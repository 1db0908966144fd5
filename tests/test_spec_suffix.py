"""`suffix` decoding: drafts from the request's own tokens and from its tenant's earlier answers (never another
tenant's), learned when requests end; greedy output through the engine is the output without speculation,
and sampled tokens keep the target's distribution."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from demo_prompts import weather_tool_prompts
from tiny_models import make_tiny_model

from hearth import LLM, SamplingParams
from hearth.engine.request import Request
from hearth.engine.speculative.proposer import ProposalRequest
from hearth.engine.speculative.speculator import Speculator
from hearth.engine.speculative.suffix import SuffixOptions, SuffixProposer
from hearth.kv.prefix_keys import root_key

DEMO = Path(__file__).resolve().parent.parent / "models" / "demo"


def ask(
    proposer: SuffixProposer, request_id: str, tokens: list[int], k: int, tenant: bytes = b"t"
) -> list[int]:
    return proposer.propose([ProposalRequest(request_id, tokens, len(tokens), k, tenant)])[0]


def test_drafts_what_the_request_itself_said_after_its_latest_context():
    proposer = SuffixProposer()
    prompt = [50, 51, 52, 53, 54, 55, 56, 57, 60, 50, 51]
    assert ask(proposer, "r", prompt, 4) == [52, 53, 54, 55]
    assert ask(proposer, "r", prompt + [52, 53], 8) == [54, 55, 56, 57, 60, 50, 51, 52]
    assert ask(proposer, "other", [1, 2, 3], 4) == []  # nothing to match: no draft, no guess


def test_a_short_match_earns_a_short_draft():
    proposer = SuffixProposer(SuffixOptions(tokens_per_match=1.0))
    assert ask(proposer, "r", [7, 1, 2, 3, 4, 5, 6, 9, 7], 8) == [1]  # one matched token: one draft
    assert ask(proposer, "q", [7, 1, 2, 3, 4, 5, 6, 9, 7, 1, 2], 8) == [3, 4, 5]


def decoding(request_id: str, prompt: list[int], salt: str | None) -> Request:
    request = Request(request_id, prompt, SamplingParams(max_tokens=50), root_key("m", tenant=salt), 0, 200)
    request.num_computed_tokens = len(prompt) - 1
    return request


def test_finished_answers_teach_later_requests_of_the_same_tenant_only():
    proposer = SuffixProposer()
    speculator = Speculator(proposer, max_num_tokens=8, max_batch_size=8, adaptive=False)
    first = decoding("a", [9, 30, 31], salt="alice")
    speculator.propose([first])
    first.token_ids += [70, 71, 72, 73, 74, 75]  # its answer
    first.output_token_ids = [70, 71, 72, 73, 74, 75]
    speculator.request_finished("a")
    later = decoding("b", [8, 30, 31], salt="alice")
    speculator.propose([later])
    assert later.draft_token_ids == [70, 71, 72, 73]  # matched "30 31" (2 tokens x 2 per match)
    stranger = decoding("c", [8, 30, 31], salt="mallory")
    speculator.propose([stranger])
    assert stranger.draft_token_ids == []
    assert speculator.stats.num_drafts == 0  # observe() was never called: proposing counts nothing


def test_the_more_confident_source_wins():
    proposer = SuffixProposer()
    for i in range(3):  # the tenant answered "5 6 -> 7 8 9" three times
        proposer.request_done(ProposalRequest(f"old{i}", [1, 5, 6, 7, 8, 9], 1, 0, b"t"))
    # The request itself split: "5 6 -> 40" once, "5 6 -> 41" once (each path half sure: 2.0 expected
    # tokens over 4) against the tenant's three agreeing answers (3.0 over 3).
    assert ask(proposer, "r", [5, 6, 40, 2, 5, 6, 41, 3, 5, 6], 4) == [7, 8, 9]
    assert ask(SuffixProposer(), "r", [5, 6, 40, 2, 5, 6, 41, 3, 5, 6], 4) == [41, 3, 5, 6]


@pytest.fixture(scope="module", autouse=True)
def compiled_kernels() -> None:
    from hearth.ops import cpu_kernels

    cpu_kernels.start_build()
    cpu_kernels.paged_decode_attention_kernel(wait=True)


def generate(model_dir: Path, prompts, params, salt: str | None = None, **options):
    llm = LLM(str(model_dir), dtype="float32", num_threads=1, **options)
    if llm.engine.speculator is not None:
        llm.engine.speculator.adaptive = False  # drafts on every step, whatever the machine's load
    return llm, llm.generate(prompts, params, cache_salt=salt)


def test_demo_tool_calls_are_unchanged_and_earlier_answers_are_used():
    prompts = weather_tool_prompts(DEMO)
    params = SamplingParams(temperature=0.0, max_tokens=48)
    _, expected = generate(DEMO, prompts, params)
    llm, first = generate(DEMO, prompts, params, speculative_method="suffix", num_speculative_tokens=8)
    assert [r.token_ids for r in first] == [r.token_ids for r in expected]
    stats = llm.engine.speculator.stats
    accepted_first = stats.num_accepted_tokens
    assert accepted_first > 0
    again = llm.generate(prompts, params)  # the same tenant: the first round's answers are drafted from
    assert [r.token_ids for r in again] == [r.token_ids for r in expected]
    assert stats.num_accepted_tokens - accepted_first > accepted_first
    assert llm.engine.stats().kv_pages_used == 0


def test_greedy_output_is_unchanged_through_chunking_and_preemption(tmp_path):
    target = make_tiny_model(tmp_path / "target", "llama", seed=0)
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7, 3, 4] * 3, list(range(3, 30)), [9, 9, 9, 9, 9, 9]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for options in (
        dict(page_size=4, max_num_batched_tokens=9),
        dict(page_size=4, kv_cache_memory_gib=18 * 4 * 512 / 2**30),
    ):
        _, expected = generate(target, prompts, params, **options)
        llm, got = generate(target, prompts, params, speculative_method="suffix", **options)
        assert [r.token_ids for r in got] == [r.token_ids for r in expected]
        assert llm.engine.speculator.stats.num_drafts > 0
        assert llm.engine.stats().kv_pages_used == 0


def test_sampled_tokens_after_suffix_drafts_keep_the_target_distribution(tmp_path):
    """Token 2 of each answer comes from a verify row carrying a suffix draft (the tenant's earlier answers
    to the same prompt supply one whenever token 1 was seen before); summed over the answers, the counts of
    token 2 must fit the target's softmax(logits / T) given each answer's token 1 (chi-square, p = 0.001)."""
    from transformers import AutoModelForCausalLM

    target = make_tiny_model(tmp_path / "target", "llama", seed=0)
    prompt = [11, 12, 13, 14] * 6
    temperature = 0.3
    num_samples = 600
    # max_tokens 3: after token 1 there is room for one draft (a row never drafts past max_tokens).
    params = [
        SamplingParams(temperature=temperature, max_tokens=3, ignore_eos=True, seed=s)
        for s in range(num_samples)
    ]
    llm, results = generate(
        target,
        [prompt] * num_samples,
        params,
        speculative_method="suffix",
        num_speculative_tokens=3,
        max_num_seqs=64,
        speculative_max_batch_size=64,
    )
    stats = llm.engine.speculator.stats
    assert stats.num_drafts >= num_samples // 2 and stats.num_accepted_tokens > 0
    firsts = sorted({r.token_ids[0] for r in results})
    hf = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + [first] for first in firsts])).logits[:, -1]
    probs = dict(zip(firsts, torch.softmax(logits.double() / temperature, dim=-1), strict=True))
    expected = torch.stack([probs[r.token_ids[0]] for r in results]).sum(dim=0)
    counts = torch.bincount(torch.tensor([r.token_ids[1] for r in results]), minlength=len(expected)).double()
    # Pool the tokens expected fewer than 5 times into one cell, as chi-square needs.
    small = expected < 5
    observed_cells = torch.cat([counts[~small], counts[small].sum().reshape(1)])
    expected_cells = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    statistic = float(((observed_cells - expected_cells) ** 2 / expected_cells).sum())
    dof = len(observed_cells) - 1
    # The 0.999 quantile of chi-square(dof) by Wilson-Hilferty (within 1% for dof >= 3); z(0.999) = 3.0902.
    critical = dof * (1 - 2 / (9 * dof) + 3.0902 * (2 / (9 * dof)) ** 0.5) ** 3
    assert dof >= 3 and statistic < critical, (statistic, critical, dof)
    # The test has teeth: the drafted token always kept would not fit.
    drafted = counts.clone()
    drafted[counts.argmax()] += 200
    biased = torch.cat([drafted[~small], drafted[small].sum().reshape(1)])
    assert float(((biased - expected_cells) ** 2 / expected_cells).sum()) > critical


def test_the_cli_offers_suffix_and_needs_no_model():
    import argparse

    from hearth.engine.config import EngineConfig

    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_arguments(parser)
    args = parser.parse_args(["--speculative-method", "suffix", "--num-speculative-tokens", "8"])
    config = EngineConfig.from_cli_args(args, model="m")
    assert config.speculative_method == "suffix" and config.num_speculative_tokens == 8
    with pytest.raises(ValueError, match="invalid suffix decoding options"):
        SuffixOptions(min_probability=0.0)
