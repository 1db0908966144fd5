"""Hearth's greedy tokens equal transformers' `generate(do_sample=False)`, in float32, for every supported family."""

from __future__ import annotations

import random

import pytest
from hf_oracle import hf_greedy

from hearth import LLM, SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


def random_prompt(length: int, seed: int, vocab: int = 500) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]


def assert_matches_hf(model_dir, prompts: list[list[int]], max_tokens: int, **engine_options) -> LLM:
    llm = LLM(str(model_dir), dtype="float32", **engine_options)
    results = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, **GREEDY))
    for prompt, result in zip(prompts, results):
        assert result.token_ids == hf_greedy(model_dir, prompt, max_tokens), f"prompt of {len(prompt)} tokens"
        assert result.finish_reason == "length"
        assert result.prompt_tokens == len(prompt)
    return llm


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_single_prompt_matches_transformers(tiny_model_factory, arch):
    model_dir = tiny_model_factory(arch)
    assert_matches_hf(model_dir, [random_prompt(21, seed=1)], max_tokens=24)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_batch_of_different_lengths_matches_transformers(tiny_model_factory, arch):
    model_dir = tiny_model_factory(arch)
    prompts = [random_prompt(n, seed=n) for n in (1, 3, 16, 17, 33, 50)]
    assert_matches_hf(model_dir, prompts, max_tokens=20, page_size=16)


def test_chunked_prefill_under_tiny_token_budget(tiny_model_factory):
    model_dir = tiny_model_factory("qwen2")
    prompts = [random_prompt(n, seed=n) for n in (37, 45, 9)]
    assert_matches_hf(model_dir, prompts, max_tokens=12, page_size=4, max_num_batched_tokens=7)


def test_prefix_cache_hits_keep_outputs_exact(tiny_model_factory):
    model_dir = tiny_model_factory("llama")
    shared = random_prompt(40, seed=7)
    llm = LLM(str(model_dir), dtype="float32", page_size=8)
    first = llm.generate([shared + [11, 12, 13]], SamplingParams(max_tokens=10, **GREEDY))[0]
    assert first.cached_tokens == 0
    second_prompt = shared + [21, 22, 23, 24, 25]
    second = llm.generate([second_prompt], SamplingParams(max_tokens=10, **GREEDY))[0]
    assert second.cached_tokens == 40  # five full pages of the shared prefix
    assert second.token_ids == hf_greedy(model_dir, second_prompt, 10)
    # A prompt that is entirely cached still computes its last page, so its answer starts right.
    again = llm.generate([second_prompt], SamplingParams(max_tokens=10, **GREEDY))[0]
    assert again.cached_tokens == 40
    assert again.token_ids == second.token_ids


def test_cache_salt_isolates_tenants(tiny_model_factory):
    model_dir = tiny_model_factory("llama")
    prompt = random_prompt(40, seed=3)
    llm = LLM(str(model_dir), dtype="float32", page_size=8)
    llm.generate([prompt], SamplingParams(max_tokens=2, **GREEDY), cache_salt="tenant-a")
    other = llm.generate([prompt], SamplingParams(max_tokens=2, **GREEDY), cache_salt="tenant-b")[0]
    same = llm.generate([prompt], SamplingParams(max_tokens=2, **GREEDY), cache_salt="tenant-a")[0]
    assert other.cached_tokens == 0
    assert same.cached_tokens == 32


def test_preemption_under_tiny_kv_budget_matches_transformers(tiny_model_factory):
    model_dir = tiny_model_factory("llama")
    # 2 layers x 2 KV heads x 16 dims x fp32 x (K, V) = 512 bytes per token; 12 pages of 4 tokens.
    kv_bytes = 12 * 4 * 512
    prompts = [random_prompt(n, seed=100 + n) for n in (10, 13, 7, 11)]
    llm = assert_matches_hf(
        model_dir, prompts, max_tokens=14, page_size=4, kv_cache_memory_gib=kv_bytes / 2**30
    )
    stats = llm.engine.stats()
    assert stats.num_preemptions_total > 0
    assert stats.kv_pages_used == 0
    assert all(count == 0 for count in llm.engine.kv.allocator.ref_counts)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(num_key_value_heads=1),  # MQA
        dict(head_dim=32),  # head_dim != hidden / heads
        dict(tie_word_embeddings=True),
        dict(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}),
        dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
        dict(
            rope_parameters={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
                "rope_theta": 500000.0,
            }
        ),
        dict(
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 16,
                "rope_theta": 10000.0,
            }
        ),
    ],
    ids=["mqa", "head_dim", "tied", "rope-linear", "rope-dynamic", "rope-llama3", "rope-yarn"],
)
def test_config_variants_match_transformers(tiny_model_factory, overrides):
    model_dir = tiny_model_factory("llama", **overrides)
    assert_matches_hf(model_dir, [random_prompt(30, seed=5), random_prompt(9, seed=6)], max_tokens=16)


def test_string_prompts_and_eos_stop(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32")
    result = llm.generate("Hello world", SamplingParams(temperature=0, max_tokens=8))[0]
    assert result.prompt_tokens == len(llm.tokenizer.encode("Hello world"))
    assert result.finish_reason in ("stop", "length")
    assert len(result.token_ids) <= 8
    assert result.text == llm.tokenizer.decode(
        [t for t in result.token_ids if t not in llm.engine.eos_token_ids]
    )


def test_mistral_sliding_window_matches_transformers(tiny_model_factory):
    model_dir = tiny_model_factory("mistral", sliding_window=8)
    assert_matches_hf(
        model_dir, [random_prompt(21, seed=8), random_prompt(5, seed=9)], max_tokens=16, page_size=4
    )


def test_last_layer_finishes_only_the_sampled_rows_of_a_prefill(tiny_llama):
    """The last layer's MLP runs for the rows that are sampled (one per finished prompt), not for every
    prompt token, and the tokens still equal transformers'; decode steps keep every row."""
    prompts = [random_prompt(n, seed=n) for n in (9, 30, 17)]
    llm = LLM(str(tiny_llama), dtype="float32", max_num_batched_tokens=40)
    model = llm.engine.worker.model
    mlp_rows: list[int] = []
    hook = model.model.layers[-1].mlp.register_forward_pre_hook(
        lambda _m, args: mlp_rows.append(args[0].shape[0])
    )
    try:
        results = llm.generate(prompts, SamplingParams(max_tokens=6, **GREEDY))
    finally:
        hook.remove()
    for prompt, result in zip(prompts, results):
        assert result.token_ids == hf_greedy(tiny_llama, prompt, 6)
    # 56 prompt tokens through a 40-token budget: a first chunk that finishes two prompts and starts the
    # third (2 sampled rows), the rest of the third (1 row plus two decode rows); then 3-row decode steps.
    assert max(mlp_rows) == 3
    assert mlp_rows[0] == 2
