"""FP8 KV cache under tensor and pipeline parallelism: each rank's pool holds its stage's layers and its KV
heads, so its scales are those heads' (sliced from the checkpoint's, or calibrated by the sharded model);
greedy tokens equal one rank's with the same FP8 cache."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from test_distributed import PROMPTS, run_layouts

from hearth.engine.fp8_kv_scales import rank_kv_scales
from hearth.engine.llm import LLM
from hearth.engine.sampling_params import SamplingParams

FP8 = {"kv_cache_dtype": "fp8_e4m3"}


def one_rank_fp8(model_dir: Path) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
    llm = LLM(str(model_dir), kv_cache_memory_gib=0.02, **FP8)
    pool = llm.engine.worker.kv_pool
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    tokens = [r.token_ids for r in llm.generate(PROMPTS, params)]
    return tokens, pool.k_scales.clone(), pool.v_scales.clone()


def test_rank_kv_scales_take_the_heads_and_layers_the_rank_holds():
    scales = torch.arange(4 * 4, dtype=torch.float32).view(4, 4)  # [layers, kv heads]
    assert torch.equal(rank_kv_scales(scales, range(0, 4), 1, 2), scales[:, 2:4])
    assert torch.equal(rank_kv_scales(scales, range(2, 4), 0, 1), scales[2:4])
    # 8 ranks over 4 KV heads: ranks 2 and 3 both replicate head 1.
    assert torch.equal(rank_kv_scales(scales, range(0, 2), 3, 8), scales[0:2, 1:2])


def test_fp8_kv_calibrated_under_tensor_and_pipeline_parallel_gives_one_ranks_tokens(tiny_model_factory):
    model_dir = tiny_model_factory("qwen2", num_hidden_layers=4)  # 2 KV heads: one per TP rank
    expected, _, _ = one_rank_fp8(model_dir)
    tags: list[str] = []
    tp, pp = run_layouts(
        model_dir, [{"tensor_parallel_size": 2, **FP8}, {"pipeline_parallel_size": 2, **FP8}], kv_tags=tags
    )
    assert tp == expected
    assert pp == expected
    assert all("float8_e4m3fn" in tag for tag in tags), tags


def test_fp8_kv_checkpoint_scales_are_sharded_with_the_heads(tiny_model_factory, tmp_path):
    src = tiny_model_factory("qwen2", num_hidden_layers=4)
    model_dir = tmp_path / "with-kv-scales"
    shutil.copytree(src, model_dir)
    tensors = load_file(model_dir / "model.safetensors")
    gen = torch.Generator().manual_seed(1)
    # Per KV head, each head's own (different heads would decode differently if swapped).
    for layer in range(4):
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.rand(2, generator=gen) * 0.02 + 0.005
        tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.rand(2, generator=gen) * 0.02 + 0.005
    save_file(tensors, model_dir / "model.safetensors")
    expected, k_scales, v_scales = one_rank_fp8(model_dir)
    torch.testing.assert_close(
        k_scales[1], tensors["model.layers.1.self_attn.k_scale"], msg="one rank uses the checkpoint's"
    )
    (tp,) = run_layouts(model_dir, [{"tensor_parallel_size": 2, **FP8}])
    assert tp == expected
