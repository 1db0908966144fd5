"""Speculative decoding is lossless: with `ngram` and `draft`, greedy output is token-for-token the output
without speculation, through batching, chunked prefill, prefix caching, preemption, stop strings, logprobs,
penalties and structured output; seeded sampling is reproducible; the counters add up."""

from __future__ import annotations

import json
import random
from pathlib import Path

import jsonschema
import pytest
from demo_prompts import weather_tool_prompts
from tiny_models import make_tiny_model

from hearth import LLM, SamplingParams
from hearth.engine.structured_output import StructuredOutput

REPO_ROOT = Path(__file__).resolve().parent.parent
DEMO = REPO_ROOT / "models" / "demo"
DEMO_DRAFT = REPO_ROOT / "models" / "demo-draft"
DEMO_EAGLE3 = REPO_ROOT / "models" / "demo-eagle3"

SCHEMA = {
    "type": "object",
    "properties": {
        "tool": {"enum": ["search", "read_file", "finish"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "note": {"type": "string", "maxLength": 6},
    },
    "required": ["tool", "count", "note"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module", autouse=True)
def compiled_kernels() -> None:
    """Every run here uses the same attention path: the compiled CPU kernels, loaded before the first."""
    from hearth.ops import cpu_kernels

    cpu_kernels.start_build()
    cpu_kernels.paged_decode_attention_kernel(wait=True)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("spec") / "target", "llama", seed=0)


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same tokenizer, different weights: a draft that is mostly wrong, so rollbacks happen all the time."""
    return make_tiny_model(tmp_path_factory.mktemp("spec") / "other", "qwen3", seed=1)


def repetitive_prompt(length: int, seed: int) -> list[int]:
    """Random tokens from a small range with repeated stretches, so prompt lookup finds matches."""
    rng = random.Random(seed)
    base = [rng.randrange(3, 40) for _ in range(12)]
    tokens: list[int] = []
    while len(tokens) < length:
        tokens += base[rng.randrange(6) :] if rng.random() < 0.6 else [rng.randrange(3, 300)]
    return tokens[:length]


PROMPTS = [repetitive_prompt(n, seed=n) for n in (5, 19, 33, 27)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def speculative_options(method: str, draft_dir: Path | None, k: int = 4) -> dict:
    return dict(
        speculative_method=method,
        speculative_model=str(draft_dir) if draft_dir is not None else None,
        num_speculative_tokens=k,
    )


def generate(model_dir: Path, prompts, params, **options):
    llm = LLM(str(model_dir), dtype="float32", num_threads=1, **options)
    if llm.engine.speculator is not None:
        # Drafts on every step: the adaptive switch decides by measured time, which would make how many
        # drafts these losslessness tests verify depend on the machine's load.
        llm.engine.speculator.adaptive = False
    return llm, llm.generate(prompts, params)


@pytest.mark.parametrize(
    "method, draft",
    [("ngram", None), ("draft", "self"), ("draft", "other")],
    ids=["ngram", "draft-self", "draft-other"],
)
@pytest.mark.parametrize(
    "engine_options",
    [
        dict(),
        dict(page_size=4, max_num_batched_tokens=9),  # chunked prefill, drafts cut by the budget
        # 2 layers x 2 KV heads x 16 dims x fp32 x (K, V) = 512 bytes per token; 18 pages of 4 tokens.
        dict(page_size=4, kv_cache_memory_gib=18 * 4 * 512 / 2**30),  # preemption
    ],
    ids=["batch", "chunked", "preempt"],
)
def test_greedy_output_is_unchanged(target_dir, other_dir, method, draft, engine_options):
    draft_dir = {"self": target_dir, "other": other_dir, None: None}[draft]
    _, expected = generate(target_dir, PROMPTS, GREEDY, **engine_options)
    llm, got = generate(
        target_dir, PROMPTS, GREEDY, **engine_options, **speculative_options(method, draft_dir)
    )
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    stats = llm.engine.speculator.stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens >= stats.num_drafts
    if draft == "self":  # the target proposing for itself is always right
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    if "kv_cache_memory_gib" in engine_options:
        assert llm.engine.stats().num_preemptions_total > 0
    assert llm.engine.stats().kv_pages_used == 0  # rollbacks leaked no page
    draft_kv = getattr(llm.engine.speculator.proposer, "kv", None)
    if draft_kv is not None:
        assert draft_kv.num_used_pages == 0  # nor did the draft's own KV


def test_prefix_cache_hits_with_drafts_stay_exact(target_dir):
    shared = repetitive_prompt(40, seed=3)
    prompts = [shared + [7, 8, 9], shared + [11, 12]]
    options = dict(page_size=8, **speculative_options("draft", target_dir))
    llm = LLM(str(target_dir), dtype="float32", **options)
    first = llm.generate(prompts[:1], GREEDY)[0]
    second = llm.generate(prompts[1:], GREEDY)[0]
    assert second.cached_tokens == 40
    _, expected = generate(target_dir, prompts, GREEDY, page_size=8)
    assert [first.token_ids, second.token_ids] == [r.token_ids for r in expected]


def test_stop_strings_logprobs_and_penalties_are_unchanged(target_dir):
    tokenizer = LLM(str(target_dir), dtype="float32").tokenizer
    _, plain = generate(target_dir, PROMPTS[:2], GREEDY)
    stop_text = tokenizer.decode(plain[0].token_ids[10:12])
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop_text], logprobs=2),
        SamplingParams(
            temperature=0.0,
            max_tokens=40,
            ignore_eos=True,
            repetition_penalty=1.3,
            frequency_penalty=0.5,
            presence_penalty=0.2,
            min_tokens=5,
            logprobs=0,
        ),
    ]
    _, expected = generate(target_dir, PROMPTS[:2], params)
    llm, got = generate(target_dir, PROMPTS[:2], params, **speculative_options("ngram", None))
    for e, g in zip(expected, got, strict=True):
        assert g.token_ids == e.token_ids and g.text == e.text and g.finish_reason == e.finish_reason
        assert [lp.token_id for lp in g.logprobs] == g.token_ids
        assert [[t for t, _ in lp.top] for lp in g.logprobs] == [[t for t, _ in lp.top] for lp in e.logprobs]
        assert [lp.logprob for lp in g.logprobs] == pytest.approx([lp.logprob for lp in e.logprobs], abs=1e-4)
    assert llm.engine.speculator.stats.num_drafts > 0


def test_structured_output_with_drafts_matches(target_dir):
    spec = StructuredOutput.json_schema(SCHEMA)
    params = SamplingParams(temperature=0.0, max_tokens=60, structured_output=spec)
    prompts = PROMPTS[:3]
    _, expected = generate(target_dir, prompts, params)
    # The target itself as the draft proposes tokens the grammar also allows; "other" proposes ones it
    # rejects, so both accepted and rolled-back grammar states are exercised.
    for draft_dir in (target_dir,):
        _, got = generate(target_dir, prompts, params, **speculative_options("draft", draft_dir))
        assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    for result in expected:
        if result.finish_reason == "stop":
            jsonschema.validate(json.loads(result.text), SCHEMA)


def test_structured_output_with_rejected_drafts_matches(target_dir, other_dir):
    spec = StructuredOutput.json_schema(SCHEMA)
    params = SamplingParams(temperature=0.0, max_tokens=60, structured_output=spec)
    _, expected = generate(target_dir, PROMPTS[:3], params)
    llm, got = generate(target_dir, PROMPTS[:3], params, **speculative_options("draft", other_dir))
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    stats = llm.engine.speculator.stats
    assert stats.num_accepted_tokens < stats.num_draft_tokens


def test_seeded_sampling_is_reproducible_and_valid(target_dir):
    params = [
        SamplingParams(temperature=0.8, top_k=20, max_tokens=30, seed=s, ignore_eos=True) for s in range(4)
    ]
    options = speculative_options("draft", target_dir)
    _, first = generate(target_dir, PROMPTS[:4], params, **options)
    llm, again = generate(target_dir, PROMPTS[:4], params, **options)
    assert [r.token_ids for r in first] == [r.token_ids for r in again]
    assert all(len(r.token_ids) == 30 for r in first)
    assert llm.engine.speculator.stats.num_accepted_tokens > 0


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_demo_model_tool_calls_are_unchanged(method):
    prompts = weather_tool_prompts(DEMO)
    params = SamplingParams(temperature=0.0, max_tokens=48)
    _, expected = generate(DEMO, prompts, params)
    draft = DEMO_DRAFT if method == "draft" else None
    llm, got = generate(DEMO, prompts, params, **speculative_options(method, draft))
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    assert "get_weather" in expected[0].text
    assert llm.engine.speculator.stats.num_accepted_tokens > 0


# ---- with tensor and pipeline parallelism -----------------------------------------------------------------


def test_proposers_with_tensor_and_pipeline_parallelism_give_the_tokens_of_one_rank():
    """Draft, n-gram and EAGLE-3 under TP=2 (and draft under PP=2): the greedy tokens of one rank without
    speculation, and drafts were really proposed (the proposer's model runs whole on rank 0)."""
    from test_distributed import run_layouts

    repeat = [5, 17, 33, 5, 17, 33, 5, 17, 33, 5, 17]  # n-gram finds its continuation in the prompt
    prompts = [[1, 5, 9, 33, 100, 7], list(range(40, 90)), repeat]
    spec = {"num_speculative_tokens": 3, "speculative_max_batch_size": 8, "dtype": "float32"}
    layouts = [
        {"dtype": "float32"},
        {
            "tensor_parallel_size": 2,
            "speculative_method": "draft",
            "speculative_model": str(DEMO_DRAFT),
            **spec,
        },
        {"tensor_parallel_size": 2, "speculative_method": "ngram", **spec},
        {
            "tensor_parallel_size": 2,
            "speculative_method": "eagle3",
            "speculative_model": str(DEMO_EAGLE3),
            **spec,
        },
        {
            "pipeline_parallel_size": 2,
            "speculative_method": "draft",
            "speculative_model": str(DEMO_DRAFT),
            **spec,
        },
    ]
    drafted: list[int] = []
    expected, *others = run_layouts(DEMO, layouts, prompts=prompts, drafted=drafted)
    for layout, tokens in zip(layouts[1:], others, strict=True):
        assert tokens == expected, layout
    assert drafted[0] == 0 and all(count > 0 for count in drafted[1:]), drafted
