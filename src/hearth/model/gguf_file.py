"""GGUF checkpoints (llama.cpp's single-file format), read with the `gguf` library: the model's config,
its tokenizer and chat template, and its tensors under Hugging Face names, so the rest of the loader is
the one a checkpoint directory takes.

`is_gguf_path` is the one test for "this --model is a GGUF file"; `ModelConfig.from_dir`,
`Tokenizer.from_dir`, `ChatTemplate.from_dir`, the quantization choice and `load_model` all branch on it.

What llama.cpp's converter changed, undone here:
- names: `blk.N.attn_q.weight` etc. (the `gguf` library's tensor name map, read backwards);
- Llama's q/k rows: permuted so rotary pairs are interleaved; put back to halves (`_unpermute_order`);
- Gemma's norm weights: stored as `1 + w` (ggml's RMS norm multiplies by the weight); `w` again here;
- shapes: `ne` is innermost-first; a quantized tensor is `[rows, bytes per row]` of blocks.

Quantized tensors are handed over as `QuantizedTensor` (the raw blocks, not dequantized): the `gguf`
quantization method (`hearth.model.quantization.gguf`) runs 4-bit formats on the INT4 kernels as they are.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hearth.model.config import ModelLoadError

if TYPE_CHECKING:
    import gguf

# GGUF `general.architecture` -> the Hugging Face architecture Hearth serves it with.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
# Tensor types that are plain floats (read as dense weights).
DENSE_TYPES = ("F32", "F16", "BF16")


def is_gguf_path(model: str | Path) -> bool:
    """True for a path to a GGUF file (`--model FILE.gguf`): a file whose first bytes are GGUF's magic."""
    path = Path(model)
    if not path.is_file():
        return False
    with path.open("rb") as handle:
        return handle.read(4) == b"GGUF"


@dataclass(frozen=True)
class QuantizedTensor:
    """A quantized GGUF tensor as stored: `blocks` uint8 `[rows, bytes per row]`, of `type_name`
    (Q4_0, Q4_1, Q8_0, Q4_K, ...) for a `[rows, columns]` weight."""

    type_name: str
    blocks: np.ndarray
    shape: tuple[int, int]

    def dequantize(self) -> torch.Tensor:
        """float32 `[rows, columns]` (for tensors without a native path: embeddings, unmapped types)."""
        from gguf import GGMLQuantizationType, dequantize

        dense = dequantize(np.asarray(self.blocks), GGMLQuantizationType[self.type_name])
        return torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32)).view(self.shape)

    def rows(self, order: torch.Tensor) -> QuantizedTensor:
        """The same tensor with its rows in `order` (a row of blocks moves whole)."""
        return QuantizedTensor(self.type_name, np.asarray(self.blocks)[order.numpy()], self.shape)


def _import_gguf() -> Any:
    try:
        import gguf
    except ImportError:
        raise ModelLoadError("reading a GGUF file needs the `gguf` package: pip install gguf") from None
    return gguf


@functools.lru_cache(maxsize=4)
def _reader(path: str) -> gguf.GGUFReader:
    gguf = _import_gguf()
    try:
        return gguf.GGUFReader(path)
    except (ValueError, OSError) as exc:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({exc})") from None


class GGUFCheckpoint:
    """One GGUF file: `metadata(key)`, `hf_config()`, `tokenizer_fields()`, `tensors(model)`."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.reader = _reader(str(self.path.resolve()))
        self.arch = str(self.metadata("general.architecture", ""))
        if self.arch not in ARCHITECTURES:
            raise ModelLoadError(
                f"{self.path.name}: GGUF architecture {self.arch!r} is not supported; supported: "
                f"{', '.join(ARCHITECTURES)}"
            )

    def metadata(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def _arch_key(self, key: str, default: Any = None) -> Any:
        return self.metadata(f"{self.arch}.{key}", default)

    @property
    def tensor_types(self) -> dict[str, str]:
        return {t.name: t.tensor_type.name for t in self.reader.tensors}

    @property
    def is_quantized(self) -> bool:
        """Any 2-D weight in a block-quantized type: then the `gguf` quantization method serves the model."""
        return any(len(t.shape) == 2 and t.tensor_type.name not in DENSE_TYPES for t in self.reader.tensors)

    def hf_config(self) -> dict[str, Any]:
        """The file's metadata as the config.json transformers would write for it."""
        names = {t.name for t in self.reader.tensors}
        hidden = int(self._arch_key("embedding_length"))
        heads = int(self._arch_key("attention.head_count"))
        kv_heads = self._arch_key("attention.head_count_kv", heads)
        if isinstance(kv_heads, list):
            raise ModelLoadError(f"{self.path.name}: per-layer KV head counts are not supported")
        tokens = self.metadata("tokenizer.ggml.tokens") or []
        eos_ids = [
            int(value)
            for key in (
                "tokenizer.ggml.eos_token_id",
                "tokenizer.ggml.eot_token_id",
                "tokenizer.ggml.eom_token_id",
            )
            if (value := self.metadata(key)) is not None
        ]
        dense_types = {self.tensor_types.get("token_embd.weight", "F32")}
        config: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.arch]],
            "vocab_size": int(self._arch_key("vocab_size", len(tokens))),
            "hidden_size": hidden,
            "intermediate_size": int(self._arch_key("feed_forward_length")),
            "num_hidden_layers": int(self._arch_key("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(kv_heads),
            "head_dim": int(self._arch_key("attention.key_length", hidden // heads)),
            "rms_norm_eps": float(self._arch_key("attention.layer_norm_rms_epsilon", 1e-6)),
            "max_position_embeddings": int(self._arch_key("context_length", 4096)),
            "rope_theta": float(self._arch_key("rope.freq_base", 10000.0)),
            "tie_word_embeddings": "output.weight" not in names,
            "torch_dtype": "bfloat16" if dense_types == {"BF16"} else "float32",
            "eos_token_id": eos_ids,
        }
        scaling = self._arch_key("rope.scaling.type")
        if scaling not in (None, "none"):
            config["rope_scaling"] = {
                "rope_type": scaling,
                "factor": float(self._arch_key("rope.scaling.factor", 1.0)),
                "original_max_position_embeddings": int(
                    self._arch_key("rope.scaling.original_context_length", config["max_position_embeddings"])
                ),
            }
        if self.arch == "qwen2":
            config["use_sliding_window"] = False
        if self.arch == "gemma3":
            # What the file does not say is Gemma 3's (transformers' defaults): five sliding layers, then a full one.
            config["hidden_activation"] = "gelu_pytorch_tanh"
            config["sliding_window"] = int(self._arch_key("attention.sliding_window", 4096))
            config["query_pre_attn_scalar"] = config["head_dim"]
            config["rope_local_base_freq"] = 10000.0
            config["torch_dtype"] = "float32"
        return config

    def tokenizer_fields(self) -> dict[str, Any]:
        """`tokenizer.*` metadata with the `tokenizer.` prefix dropped (`ggml.tokens`, `chat_template`...)."""
        return {
            key.removeprefix("tokenizer."): self.metadata(key)
            for key in self.reader.fields
            if key.startswith("tokenizer.")
        }

    def tensors(
        self, hf_names: Iterator[str] | list[str]
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
        """(Hugging Face name, tensor) for every tensor of the file: dense ones as float tensors, quantized
        ones as `QuantizedTensor`. `hf_names` are the checkpoint names the model loads (its parameters'
        `checkpoint_name`s), which the `gguf` library maps to GGUF names; a GGUF tensor none of them maps
        to is an error that names it."""
        gguf = _import_gguf()
        arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == self.arch)
        config = self.hf_config()
        name_map = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
        to_hf: dict[str, str] = {}
        for hf_name in hf_names:
            base, dot, suffix = hf_name.rpartition(".")
            gguf_base = name_map.get_name(base)
            if gguf_base is not None:
                to_hf[f"{gguf_base}{dot}{suffix}"] = hf_name
        for tensor in self.reader.tensors:
            hf_name = to_hf.get(tensor.name)
            if hf_name is None:
                if tensor.name == "output.weight" and config["tie_word_embeddings"]:
                    continue
                if tensor.name.startswith("rope_"):  # rope frequency tables: computed here
                    continue
                raise ModelLoadError(f"{self.path.name}: unexpected tensor {tensor.name!r} for {self.arch}")
            value = _tensor_value(tensor)
            if self.arch == "llama" and tensor.name.endswith(("attn_q.weight", "attn_k.weight")):
                heads = (
                    config["num_attention_heads"]
                    if "attn_q" in tensor.name
                    else config["num_key_value_heads"]
                )
                order = _unpermute_order(value.shape[0], heads)
                value = value.rows(order) if isinstance(value, QuantizedTensor) else value[order]
            if (
                self.arch == "gemma3"
                and tensor.name.endswith("norm.weight")
                and isinstance(value, torch.Tensor)
            ):
                value = value - 1.0
            yield hf_name, value


def _tensor_value(tensor: Any) -> torch.Tensor | QuantizedTensor:
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))  # GGUF's ne is innermost-first
    type_name = tensor.tensor_type.name
    data = np.asarray(tensor.data)
    if type_name in ("F32", "F16"):
        return torch.from_numpy(data.astype(np.float32)).view(shape)
    if type_name == "BF16":
        raw = torch.from_numpy(np.ascontiguousarray(data).view(np.uint16).astype(np.int16))
        return raw.view(torch.bfloat16).view(shape)
    if len(shape) != 2:
        raise ModelLoadError(f"{tensor.name}: a {len(shape)}-D {type_name} tensor is not supported")
    return QuantizedTensor(type_name, data.reshape(shape[0], -1), (shape[0], shape[1]))


def _unpermute_order(rows: int, heads: int) -> torch.Tensor:
    """llama.cpp stores each head's q/k rows as (pair, 2) interleaved: row `2i + j` of a head is HF row
    `i + j * head_dim / 2`. The order that puts the HF rows back."""
    half = rows // heads // 2
    # HF row (h, j, i) sits at GGUF row (h, i, j).
    return torch.arange(rows).view(heads, half, 2).transpose(1, 2).reshape(rows)
