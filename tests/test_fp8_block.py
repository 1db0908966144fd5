"""FP8 block-scaled weights (DeepSeek-V3 / Kimi K2: `weight` float8_e4m3fn, `weight_scale_inv` per 128x128
block): a checkpoint written here, as that format specifies, against transformers running the dequantized
weights; and `--quantization int4` on it (dequantize per block, then RTN per group)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hf_oracle import hf_greedy
from safetensors.torch import load_file, save_file

from hearth.engine.llm import LLM
from hearth.engine.sampling_params import SamplingParams
from hearth.model.quantization.fp8_block import dequantize_fp8_blocks
from hearth.ops import cpu_kernels
from hearth.ops.int4 import dequantize_int4, quantize_rtn

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BLOCK = 128
FP8_MAX = 448.0
PROMPTS = [[5, 17, 99, 3, 250, 41], [300, 2, 7], list(range(20, 60))]


def fp8_block_quantize(w: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's layout: scale_inv [ceil(out / 128), ceil(in / 128)] = block amax / 448, weight =
    w / scale_inv as float8_e4m3fn. Blocks are first scaled by factors 1/16..16 apart, so a reader that
    ignored (or misplaced) the per-block scales would compute a different model."""
    out, k = w.shape
    grid = (-(-out // BLOCK), -(-k // BLOCK))
    spread = 2.0 ** torch.randint(-4, 5, grid, generator=gen).float()
    w = w * spread.repeat_interleave(BLOCK, 0)[:out].repeat_interleave(BLOCK, 1)[:, :k]
    padded = torch.zeros(grid[0] * BLOCK, grid[1] * BLOCK)
    padded[:out, :k] = w.abs()
    amax = padded.view(grid[0], BLOCK, grid[1], BLOCK).amax(dim=(1, 3)).clamp(min=1e-12)
    scale_inv = amax / FP8_MAX
    full = scale_inv.repeat_interleave(BLOCK, 0)[:out].repeat_interleave(BLOCK, 1)[:, :k]
    return (w / full).to(torch.float8_e4m3fn), scale_inv


def write_fp8_checkpoint(src: Path, dst: Path) -> Path:
    """`dst`: the FP8 checkpoint of `src`'s linear layers; returns `dst`-dense, the dequantized weights."""
    dense_dir = dst.with_name(dst.name + "-dense")
    for d in (dst, dense_dir):
        shutil.copytree(src, d)
    gen = torch.Generator().manual_seed(3)
    fp8: dict[str, torch.Tensor] = {}
    dense: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(src / "model.safetensors").items():
        if not (name.endswith(".weight") and name.rsplit(".", 2)[-2] in LINEARS):
            fp8[name] = dense[name] = tensor
            continue
        weight, scale_inv = fp8_block_quantize(tensor.float(), gen)
        fp8[name] = weight
        fp8[name.removesuffix("weight") + "weight_scale_inv"] = scale_inv
        # The dequantized weight in float64 arithmetic, independently of Hearth's helper.
        scales = scale_inv.double().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
        dense[name] = (weight.double() * scales[: weight.shape[0], : weight.shape[1]]).float()
    save_file(fp8, dst / "model.safetensors")
    save_file(dense, dense_dir / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {  # as DeepSeek-V3's config.json ships it
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [BLOCK, BLOCK],
    }
    (dst / "config.json").write_text(json.dumps(config))
    return dense_dir


@pytest.fixture(scope="module")
def fp8_checkpoint(tiny_model_factory, tmp_path_factory) -> tuple[Path, Path]:
    # 192 and 320 features: blocks of 128 with a partial last block on both axes; q/k/v fused with their
    # own block grids (k and v have 96 rows).
    src = tiny_model_factory("llama", hidden_size=192, intermediate_size=320)
    dst = tmp_path_factory.mktemp("fp8") / "fp8-block"
    return dst, write_fp8_checkpoint(src, dst)


def test_fp8_block_checkpoint_gives_transformers_greedy_tokens_on_dequantized_weights(fp8_checkpoint):
    fp8_dir, dense_dir = fp8_checkpoint
    stored = load_file(fp8_dir / "model.safetensors")
    assert stored["model.layers.0.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert stored["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (2, 3)  # [192/128, 320/128] up
    llm = LLM(str(fp8_dir), dtype="float32", kv_cache_memory_gib=0.02)
    assert type(llm.engine.worker.model.model.layers[0].self_attn.qkv_proj.quant_method).__name__ == (
        "Fp8BlockLinearMethod"
    )
    results = llm.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    for prompt, result in zip(PROMPTS, results):
        assert result.token_ids == hf_greedy(dense_dir, prompt, 10)


def test_dequantize_fp8_blocks_applies_each_blocks_scale():
    weight = torch.full((130, 200), 2.0).to(torch.float8_e4m3fn)
    scale_inv = torch.tensor([[1.0, 3.0], [5.0, 7.0]])
    dense = dequantize_fp8_blocks(weight, scale_inv, (128, 128))
    assert dense[0, 0] == 2 and dense[0, 128] == 6 and dense[128, 0] == 10 and dense[129, 199] == 14


def test_quantization_int4_from_fp8_block_checkpoint(fp8_checkpoint, monkeypatch, tmp_path):
    """Each layer: the per-block dequantized weight rounded per group; the LM head too. Greedy tokens equal
    transformers on those INT4 weights, dequantized (the kernel's activations kept float: W4A16)."""
    monkeypatch.setenv("HEARTH_INT4_ACTIVATIONS", "float")
    cpu_kernels.paged_decode_attention_kernel(wait=True)
    fp8_dir, dense_dir = fp8_checkpoint
    llm = LLM(str(fp8_dir), quantization="int4", dtype="float32", kv_cache_memory_gib=0.02)
    model = llm.engine.worker.model
    dense = load_file(dense_dir / "model.safetensors")
    oracle: dict[str, torch.Tensor] = {}
    for name, tensor in dense.items():
        oracle[name] = tensor
        if name.endswith(".weight") and (name.rsplit(".", 2)[-2] in LINEARS or name == "lm_head.weight"):
            group = 128 if tensor.shape[1] % 128 == 0 else 64
            q, scales, zeros = quantize_rtn(tensor, group)
            oracle[name] = (
                (q.float().view(q.shape[0], -1, group) - zeros[..., None]) * scales[..., None]
            ).view(tensor.shape)
    down = model.model.layers[1].mlp.down_proj
    assert not hasattr(down, "weight") and down.int4.group_size == 64  # 320 input features
    torch.testing.assert_close(dequantize_int4(down.int4), oracle["model.layers.1.mlp.down_proj.weight"])
    assert model.lm_head_quantized is not None
    oracle_dir = tmp_path / "int4-oracle"
    shutil.copytree(dense_dir, oracle_dir)
    save_file(oracle, oracle_dir / "model.safetensors")
    results = llm.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    for prompt, result in zip(PROMPTS, results):
        assert result.token_ids == hf_greedy(oracle_dir, prompt, 10)


def test_fp8_block_weights_with_tensor_parallelism_give_the_tokens_of_one_rank(fp8_checkpoint):
    """Each TP rank dequantizes its slice with the blocks it starts in (k/v slices of 48 rows start mid-block)."""
    from test_distributed import run_layouts

    fp8_dir, _ = fp8_checkpoint
    one, tp = run_layouts(fp8_dir, [{"dtype": "float32"}, {"dtype": "float32", "tensor_parallel_size": 2}])
    assert tp == one


def test_a_slice_is_dequantized_with_the_scales_of_its_own_blocks():
    gen = torch.Generator().manual_seed(0)
    weight, scale_inv = fp8_block_quantize(torch.randn(300, 260, generator=gen), gen)
    whole = dequantize_fp8_blocks(weight, scale_inv, (BLOCK, BLOCK))
    part = dequantize_fp8_blocks(weight[100:250, 70:200], scale_inv, (BLOCK, BLOCK), (100, 70))
    assert torch.equal(part, whole[100:250, 70:200])
