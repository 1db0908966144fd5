"""Models whose layers attend differently (per-layer attention kinds: `ModelConfig.layer_attention`, the
backends' `layer_kinds`): token-exact with transformers, through prefill, decode and the prefix cache."""

from __future__ import annotations

from hf_oracle import hf_greedy

from hearth import LLM
from hearth.engine.sampling_params import SamplingParams

# Longer than the window, so the windowed layers attend to less than the full ones.
PROMPTS = [[(7 * i + 3) % 500 for i in range(37)], [(11 * i + 5) % 500 for i in range(21)]]


def test_qwen2_with_windowed_and_full_layers_matches_transformers(tiny_model_factory):
    model_dir = tiny_model_factory(
        "qwen2", num_hidden_layers=3, use_sliding_window=True, sliding_window=8, max_window_layers=1
    )
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory_gib=0.02, page_size=4)
    assert [llm.engine.worker.attention.layer_kinds[i].sliding_window for i in range(3)] == [None, 8, 8]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = [hf_greedy(model_dir, prompt, 12) for prompt in PROMPTS]
    assert [r.token_ids for r in llm.generate(PROMPTS, params)] == expected
    # Again: the prompts' full pages now come from the prefix cache, for every layer kind.
    again = llm.generate(PROMPTS, params)
    assert all(r.cached_tokens > 0 for r in again)
    assert [r.token_ids for r in again] == expected


def test_gemma3_sliding_and_full_layers_with_their_own_rotary_match_transformers(tiny_model_factory):
    model_dir = tiny_model_factory("gemma3")
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory_gib=0.02, page_size=4)
    kinds = llm.engine.worker.attention.layer_kinds
    assert [kind.sliding_window for kind in kinds] == [8, 8, None, 8]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = [hf_greedy(model_dir, prompt, 12) for prompt in PROMPTS]
    assert [r.token_ids for r in llm.generate(PROMPTS, params)] == expected
    again = llm.generate(PROMPTS, params)
    assert all(r.cached_tokens > 0 for r in again)
    assert [r.token_ids for r in again] == expected
