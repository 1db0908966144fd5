"""Tiny GGUF files for tests, written with the `gguf` library from a tiny Hugging Face checkpoint
(`tests/tiny_models.py`) the way llama.cpp's converter writes them: llama.cpp's tensor names, q/k rows
permuted for interleaved rotary, the tokenizer and chat template as metadata, weights in a chosen type.

transformers loads the result with `from_pretrained(dir, gguf_file=name)`: the tests' oracle.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

LINEAR_SUFFIXES = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight") + (
    "gate_proj.weight",
    "up_proj.weight",
    "down_proj.weight",
)


def _permute_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k permutation: each head's (half, pair) rows become (pair, half)."""
    rows = weight.shape[0]
    return (
        weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def write_gguf(
    hf_dir: Path,
    out_path: Path,
    linear_type: str = "F32",
    embedding_type: str = "F32",
    tensor_types: dict[str, str] | None = None,
) -> Path:
    """Write `hf_dir` (a tiny Llama checkpoint) as a GGUF file. `linear_type`: the type of every linear
    weight (F32, F16, BF16, Q4_0, Q4_1, Q8_0); `embedding_type` of the embedding (and LM head);
    `tensor_types`: per GGUF tensor name, overriding both."""
    import gguf

    config = json.loads((hf_dir / "config.json").read_text())
    tokenizer = json.loads((hf_dir / "tokenizer.json").read_text())
    tok_config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    tensors = load_file(hf_dir / "model.safetensors")
    layers = config["num_hidden_layers"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads

    writer = gguf.GGUFWriter(str(out_path), "llama")
    writer.add_name("tiny-llama")
    writer.add_block_count(layers)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config.get("rope_theta") or config["rope_parameters"]["rope_theta"])
    writer.add_vocab_size(config["vocab_size"])

    vocab = dict(tokenizer["model"]["vocab"])
    special_ids = {t["id"] for t in tokenizer["added_tokens"] if t["special"]}
    for added in tokenizer["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [""] * config["vocab_size"]
    for token, index in vocab.items():
        tokens[index] = token
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    eos_id = vocab[tok_config["eos_token"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in special_ids else 1 for i in range(len(tokens))])
    writer.add_token_merges(merges)
    writer.add_eos_token_id(eos_id)
    writer.add_bos_token_id(vocab["<|im_start|>"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(tok_config["chat_template"])

    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, layers)
    for name, tensor in tensors.items():
        base = name.removesuffix(".weight")
        gguf_name = name_map.get_name(base) + ".weight"
        value = tensor.float().numpy()
        if name.endswith("q_proj.weight"):
            value = _permute_rows(value, heads)
        elif name.endswith("k_proj.weight"):
            value = _permute_rows(value, kv_heads)
        kind = "F32"
        if name.endswith(LINEAR_SUFFIXES):
            kind = linear_type
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            kind = embedding_type
        kind = (tensor_types or {}).get(gguf_name, kind)
        qtype = gguf.GGMLQuantizationType[kind]
        if kind == "F32":
            writer.add_tensor(gguf_name, value.astype(np.float32))
        elif kind == "F16":
            writer.add_tensor(gguf_name, value.astype(np.float16))
        else:
            data = gguf.quants.quantize(value.astype(np.float32), qtype)
            writer.add_tensor(gguf_name, data, raw_shape=data.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


def hf_gguf_model(path: Path):  # type: ignore[no-untyped-def]
    """transformers' model of the GGUF file (it dequantizes the weights), float32, eval mode."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


def hf_gguf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:  # type: ignore[no-untyped-def]
    input_ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()
