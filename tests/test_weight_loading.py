"""Weight loading: checkpoint tensors reach their (fused, sharded) parameters through per-parameter
weight loaders; tensor-parallel ranks hold slices that put together give the whole checkpoint; a
checkpoint that does not fit fails with one line naming the tensor."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hearth.model.config import ModelConfig, ModelLoadError
from hearth.model.layers import Linear
from hearth.model.loader import build_model, load_model, load_weights


def checkpoint(model_dir) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


def load_rank(model_dir, tp_rank: int = 0, tp_size: int = 1):
    """The model of `model_dir` for one rank, loaded but not prepared (weights as loaded)."""
    config = ModelConfig.from_dir(model_dir)
    model = build_model(config, torch.float32, 64, tp_rank=tp_rank, tp_size=tp_size)
    load_weights(model, model_dir)
    return model


def test_fused_projections_hold_the_checkpoint_parts(tiny_model_factory):
    model_dir = tiny_model_factory("qwen2")  # q/k/v biases too
    tensors = checkpoint(model_dir)
    model = load_rank(model_dir)
    for i, layer in enumerate(model.model.layers):
        hf = f"model.layers.{i}."
        for kind in ("weight", "bias"):
            expected = torch.cat([tensors[f"{hf}self_attn.{p}_proj.{kind}"] for p in "qkv"])
            assert torch.equal(getattr(layer.self_attn.qkv_proj, kind), expected)
        gate_up = torch.cat([tensors[f"{hf}mlp.gate_proj.weight"], tensors[f"{hf}mlp.up_proj.weight"]])
        assert torch.equal(layer.mlp.gate_up_proj.weight, gate_up)
        assert torch.equal(layer.mlp.down_proj.weight, tensors[f"{hf}mlp.down_proj.weight"])
    assert torch.equal(model.lm_head.weight, tensors["lm_head.weight"])


@pytest.mark.parametrize("tp_size", [2, 4])
def test_tensor_parallel_slices_put_together_give_the_checkpoint(tiny_model_factory, tp_size):
    # 4 query heads, 2 KV heads: at 4 ranks each KV head is held by two consecutive ranks.
    model_dir = tiny_model_factory("qwen2")
    tensors = checkpoint(model_dir)
    ranks = [load_rank(model_dir, r, tp_size) for r in range(tp_size)]
    kv_heads, head_dim = 2, 16
    for i in range(2):
        hf = f"model.layers.{i}."
        attns = [rank.model.layers[i].self_attn for rank in ranks]
        mlps = [rank.model.layers[i].mlp for rank in ranks]
        for kind in ("weight", "bias"):
            parts = [getattr(a.qkv_proj, kind).split([a.q_size, a.kv_size, a.kv_size]) for a in attns]
            assert torch.equal(torch.cat([p[0] for p in parts]), tensors[f"{hf}self_attn.q_proj.{kind}"])
            for j, name in ((1, "k"), (2, "v")):
                full = tensors[f"{hf}self_attn.{name}_proj.{kind}"]
                held = [p[j] for p in parts]
                if tp_size <= kv_heads:
                    assert torch.equal(torch.cat(held), full)
                else:
                    replicas = tp_size // kv_heads
                    for r, part in enumerate(held):
                        head = r // replicas
                        assert torch.equal(part, full[head * head_dim : (head + 1) * head_dim])
        o_proj = torch.cat([a.o_proj.weight for a in attns], dim=1)
        assert torch.equal(o_proj, tensors[f"{hf}self_attn.o_proj.weight"])
        gate, up = zip(*(m.gate_up_proj.weight.split(m.intermediate_size) for m in mlps))
        assert torch.equal(torch.cat(gate), tensors[f"{hf}mlp.gate_proj.weight"])
        assert torch.equal(torch.cat(up), tensors[f"{hf}mlp.up_proj.weight"])
        down = torch.cat([m.down_proj.weight for m in mlps], dim=1)
        assert torch.equal(down, tensors[f"{hf}mlp.down_proj.weight"])
    # The embedding and LM head by vocabulary rows (the last block padded past the vocabulary).
    for module, name in (
        (lambda m: m.model.embed_tokens, "model.embed_tokens.weight"),
        (lambda m: m.lm_head, "lm_head.weight"),
    ):
        whole = tensors[name]
        rows = torch.cat([module(rank).weight for rank in ranks])
        assert torch.equal(rows[: whole.shape[0]], whole)
        assert not rows[whole.shape[0] :].any()
    for rank in ranks:  # replicated
        assert torch.equal(
            rank.model.layers[1].input_layernorm.weight, tensors["model.layers.1.input_layernorm.weight"]
        )


def test_tensor_parallel_mlp_partial_sums_add_up_to_the_whole(tiny_model_factory):
    model_dir = tiny_model_factory("llama")
    whole = load_rank(model_dir).model.layers[0].mlp
    shards = [load_rank(model_dir, r, 2).model.layers[0].mlp for r in range(2)]
    x = torch.randn(5, 64)
    with torch.no_grad():
        # The all-reduce a tensor-parallel step would do after the row-parallel down projection.
        summed = shards[0](x) + shards[1](x)
        torch.testing.assert_close(summed, whole(x), rtol=1e-5, atol=1e-5)


def test_tensor_parallel_size_that_does_not_split_the_heads_is_refused(tiny_llama):
    config = ModelConfig.from_dir(tiny_llama)
    with pytest.raises(ModelLoadError, match="num_attention_heads 4 does not split evenly over 3"):
        build_model(config, torch.float32, 64, tp_rank=0, tp_size=3)


def copy_with_tensors(source, target, tensors: dict[str, torch.Tensor]):
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, target / name)
    save_file(tensors, str(target / "model.safetensors"))
    return ModelConfig.from_dir(target)


def test_wrong_shape_names_the_tensor_and_both_shapes(tiny_llama, tmp_path):
    tensors = checkpoint(tiny_llama)
    tensors["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(16, 64)
    config = copy_with_tensors(tiny_llama, tmp_path, tensors)
    with pytest.raises(
        ModelLoadError,
        match=r"model.safetensors: model.layers.1.self_attn.k_proj.weight has shape \(16, 64\), config implies \(32, 64\)",
    ):
        load_model(tmp_path, config, torch.float32, 64)
    tensors = checkpoint(tiny_llama)
    tensors["model.norm.weight"] = torch.zeros(65)
    config = copy_with_tensors(tiny_llama, tmp_path, tensors)
    with pytest.raises(ModelLoadError, match=r"model.norm.weight has shape \(65,\), config implies \(64,\)"):
        load_model(tmp_path, config, torch.float32, 64)


def test_unexpected_and_missing_tensors(tiny_llama, tmp_path):
    tensors = checkpoint(tiny_llama)
    tensors["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)
    config = copy_with_tensors(tiny_llama, tmp_path, tensors)
    with pytest.raises(
        ModelLoadError, match="unexpected tensor 'model.layers.0.self_attn.o_proj.bias' for LlamaForCausalLM"
    ):
        load_model(tmp_path, config, torch.float32, 64)
    tensors = checkpoint(tiny_llama)
    del tensors["model.layers.1.self_attn.v_proj.weight"]
    config = copy_with_tensors(tiny_llama, tmp_path, tensors)
    # Named as the checkpoint names it, not as the fused parameter it would have filled.
    with pytest.raises(
        ModelLoadError, match="checkpoint lacks 1 tensors, e.g. model.layers.1.self_attn.v_proj.weight$"
    ):
        load_model(tmp_path, config, torch.float32, 64)


def test_tied_checkpoint_that_also_stores_the_head_loads_the_embedding(tiny_model_factory, tmp_path):
    source = tiny_model_factory("llama", tie_word_embeddings=True)
    tensors = checkpoint(source)
    tensors["lm_head.weight"] = torch.zeros_like(tensors["model.embed_tokens.weight"])
    config = copy_with_tensors(source, tmp_path, tensors)
    model = load_model(tmp_path, config, torch.float32, 64)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, checkpoint(source)["model.embed_tokens.weight"])


def test_bf16_model_is_built_in_bf16_with_a_float32_rotary_table(tiny_model_factory):
    model_dir = tiny_model_factory("qwen3", weights_dtype="bfloat16")
    tensors = checkpoint(model_dir)
    model = load_model(model_dir, ModelConfig.from_dir(model_dir), torch.bfloat16, 64)
    assert model.cos_sin.dtype == torch.float32
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert all(m.prepared is not None for m in linears)  # CPU layouts, as for float32
    q_norm = model.model.layers[0].self_attn.q_norm.weight
    assert torch.equal(q_norm, tensors["model.layers.0.self_attn.q_norm.weight"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_device_gets_plain_weights_with_the_cpu_values(tiny_model_factory):
    model_dir = tiny_model_factory("qwen3")
    config = ModelConfig.from_dir(model_dir)
    model = load_model(model_dir, config, torch.float32, 64, device="cuda")
    assert {p.device.type for p in model.parameters()} == {"cuda"} and model.cos_sin.is_cuda
    assert model.lm_head_weights is None
    reference = load_rank(model_dir)
    x = torch.randn(3, 64)
    for (name, cpu_linear), (_, cuda_linear) in zip(reference.named_modules(), model.named_modules()):
        if isinstance(cpu_linear, Linear):
            assert cuda_linear.prepared is None and cuda_linear.weight is not None, name
            with torch.no_grad():
                torch.testing.assert_close(cuda_linear(x.cuda()).cpu(), cpu_linear(x), rtol=1e-4, atol=1e-4)
