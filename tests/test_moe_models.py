"""The MoE and MLA families (Qwen3-MoE, DeepSeek-V3 / Kimi K2, GLM-4.5) give transformers' greedy tokens in
float32: one prompt, a batch of different lengths, prefix-cache hits, chunked prefill, config variants."""

from __future__ import annotations

import pytest
import torch
from hf_oracle import hf_greedy
from safetensors.torch import load_file, save_file
from test_engine_correctness import GREEDY, assert_matches_hf, random_prompt

from hearth import LLM, SamplingParams

MOE_ARCHS = ["qwen3_moe", "deepseek_v3", "glm4_moe"]


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_batch_of_different_lengths_matches_transformers(tiny_model_factory, arch):
    model_dir = tiny_model_factory(arch)
    prompts = [random_prompt(n, seed=n) for n in (1, 3, 16, 17, 33, 50)]
    assert_matches_hf(model_dir, prompts, max_tokens=20, page_size=16)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_chunked_prefill_under_tiny_token_budget(tiny_model_factory, arch):
    model_dir = tiny_model_factory(arch)
    prompts = [random_prompt(n, seed=n) for n in (37, 45, 9)]
    assert_matches_hf(model_dir, prompts, max_tokens=12, page_size=4, max_num_batched_tokens=7)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_prefix_cache_hits_keep_outputs_exact(tiny_model_factory, arch):
    model_dir = tiny_model_factory(arch)
    shared = random_prompt(40, seed=7)
    llm = LLM(str(model_dir), dtype="float32", page_size=8)
    first = llm.generate([shared + [11, 12, 13]], SamplingParams(max_tokens=10, **GREEDY))[0]
    assert first.cached_tokens == 0
    second_prompt = shared + [21, 22, 23, 24, 25]
    second = llm.generate([second_prompt], SamplingParams(max_tokens=10, **GREEDY))[0]
    assert second.cached_tokens == 40
    assert second.token_ids == hf_greedy(model_dir, second_prompt, 10)


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("qwen3_moe", dict(norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[])),
        ("deepseek_v3", dict(q_lora_rank=None)),  # Kimi K2 / DeepSeek-V2-Lite style: no query compression
        ("deepseek_v3", dict(rope_interleave=False, n_group=1, topk_group=1, norm_topk_prob=False)),
        (
            "deepseek_v3",
            dict(
                rope_parameters={
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 16,
                    "beta_fast": 32,
                    "beta_slow": 1,
                    "mscale": 1.0,
                    "mscale_all_dim": 1.0,
                    "rope_theta": 10000.0,
                }
            ),
        ),
        ("glm4_moe", dict(use_qk_norm=True)),
        (
            "glm4_moe",
            dict(
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}
            ),
        ),
    ],
    ids=[
        "qwen3moe-sparse-step",
        "dsv3-no-q-lora",
        "dsv3-plain-rope-one-group",
        "dsv3-yarn",
        "glm-qk-norm",
        "glm-full-rotary",
    ],
)
def test_moe_config_variants_match_transformers(tiny_model_factory, arch, overrides):
    model_dir = tiny_model_factory(arch, **overrides)
    assert_matches_hf(model_dir, [random_prompt(30, seed=5), random_prompt(9, seed=6)], max_tokens=16)


def test_deepseek_multi_token_prediction_layers_are_not_loaded(tiny_model_factory, tmp_path):
    """DeepSeek-V3 / Kimi K2 checkpoints carry MTP modules as layer `num_hidden_layers`; they are skipped."""
    source = tiny_model_factory("deepseek_v3")
    for item in source.iterdir():
        (tmp_path / item.name).write_bytes(item.read_bytes())
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    tensors["model.layers.3.mlp.experts.0.gate_proj.weight"] = torch.zeros(32, 64)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    prompt = random_prompt(12, seed=3)
    llm = LLM(str(tmp_path), dtype="float32")
    assert llm.generate([prompt], SamplingParams(max_tokens=6, **GREEDY))[0].token_ids == hf_greedy(
        source, prompt, 6
    )


@pytest.mark.parametrize(
    ("arch", "layouts"),
    [
        ("qwen3_moe", [{"tensor_parallel_size": 2, "expert_parallel": True}, {"tensor_parallel_size": 2}]),
        (
            "deepseek_v3",
            [{"tensor_parallel_size": 2, "expert_parallel": True}, {"pipeline_parallel_size": 2}],
        ),
    ],
    ids=["qwen3moe-ep2-tp2", "dsv3-ep2-pp2"],
)
def test_moe_parallel_layouts_give_the_one_rank_tokens(tiny_model_factory, arch, layouts):
    """EP=2 (experts split, routed output all-reduced), TP=2 (experts' intermediate dim split; MLA heads
    split, the latent whole on each rank) and PP=2 give the greedy tokens of one rank (gloo, 2 processes)."""
    from test_distributed import one_rank_tokens, run_layouts

    model_dir = tiny_model_factory(arch)
    kv_tags: list[str] = []
    expected = one_rank_tokens(model_dir)
    for tokens in run_layouts(model_dir, layouts, kv_tags=kv_tags):
        assert tokens == expected
    assert all(tag.startswith("latent/" if arch == "deepseek_v3" else "mha/") for tag in kv_tags)
