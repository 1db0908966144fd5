"""The model and loading options (`ModelOptions`, a part of `EngineConfig`), with the value types that read
them as vLLM users write them (`half`, `32k`, `-q awq_marlin`). Torch-free."""

from __future__ import annotations

import argparse
import functools
import os
from dataclasses import dataclass
from pathlib import Path

from hearth.contracts.options import human_int, not_an_option, option
from hearth.model.quantization.select import QUANTIZATION_CHOICES

DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32")
DEVICE_CHOICES = ("auto", "cpu", "cuda")
PREFILL_MATH_CHOICES = ("auto", "float32", "bfloat16")


def max_model_len(text: str) -> int | None:
    """`--max-model-len`: a token count, or `auto` / `-1` (the model's and the KV cache's limit)."""
    if text.strip() in ("auto", "-1"):
        return None
    return human_int(text)


_DTYPE_ALIASES = {
    "half": "float16",
    "float": "float32",
    "fp16": "float16",
    "bf16": "bfloat16",
    "fp32": "float32",
}


def dtype(text: str) -> str:
    value = _DTYPE_ALIASES.get(text, text)
    if value not in DTYPE_CHOICES:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a dtype; use one of {', '.join(DTYPE_CHOICES)} (or half, float)"
        )
    return value


# vLLM's kernel-flavoured method names name the same checkpoint formats Hearth reads.
_QUANTIZATION_ALIASES = {
    "awq_marlin": "awq",
    "gptq_marlin": "gptq",
    "compressed_tensors": "compressed-tensors",
    "fbgemm_fp8": "fp8",
    # A GGUF file carries its own quantization: the checkpoint decides.
    "gguf": "auto",
}


def quantization(text: str) -> str:
    value = _QUANTIZATION_ALIASES.get(text, text)
    if value not in QUANTIZATION_CHOICES:
        raise argparse.ArgumentTypeError(
            f"quantization {text!r} is not supported; Hearth reads {', '.join(QUANTIZATION_CHOICES)} "
            "(awq_marlin = awq, gptq_marlin = gptq); auto follows the checkpoint's quantization_config"
        )
    return value


_option = functools.partial(option, group="model")


@dataclass(frozen=True)
class ModelOptions:
    """What to load and how: the checkpoint, its dtype and quantization, the device, the names it answers to."""

    model: str = _option(help="Hugging Face checkpoint directory")
    dtype: str = _option(
        "auto",
        type=dtype,
        choices=DTYPE_CHOICES,
        metavar="{" + ",".join(DTYPE_CHOICES) + ",half,float}",
        help="weights/activations dtype; auto = the checkpoint's (float32 on CPUs without bf16/fp16 math)",
    )
    max_model_len: int | None = _option(
        None,
        type=max_model_len,
        help="context limit in tokens: 4096, 32k (32000), 32K (32768), auto (default: the model's, "
        "bounded by the KV cache)",
    )
    seed: int = _option(0, type=int, help="seed for unseeded sampling")
    num_threads: int | None = _option(None, type=int, help="torch CPU threads (default: all cores)")
    served_model_name: str | None = _option(
        None,
        nargs="+",
        help="model name in the API; more names are accepted as aliases (default: directory name)",
    )
    load_progress: bool = not_an_option(False)  # a progress bar: `hearth serve` asks for one
    device: str = _option(
        "auto",
        choices=DEVICE_CHOICES,
        help="where the model and KV cache live; auto = cuda when available, else cpu",
    )
    quantization: str = _option(
        "auto",
        flags=("--quantization", "-q"),
        type=quantization,
        choices=QUANTIZATION_CHOICES,
        metavar="{" + ",".join(QUANTIZATION_CHOICES) + "}",
        help="weights: auto = as the checkpoint's quantization_config says (GPTQ/AWQ/compressed-tensors INT4, "
        "FP8 blocks), else dense; int4 = round-to-nearest INT4 per group at load time",
    )
    # `hearth.ops.prefill_math`: the measured cost of bfloat16 is in docs/quantization.md.
    prefill_math: str = _option(
        "auto",
        choices=PREFILL_MATH_CHOICES,
        help="math of prompt chunks (and steps of >= 64 rows) whose activations are float32, on CPUs with bf16 "
        "math: bfloat16 = bf16 tiles with float32 accumulation, as vLLM-CPU runs every row (2-3x a prefill); "
        "float32 = the activations' own; auto = bfloat16 for quantized weights (GGUF, INT4, INT8), else float32",
    )
    # vLLM's --tokenizer: a tokenizer from elsewhere.
    tokenizer: str | None = _option(
        None, help="tokenizer (and chat template) directory (default: the model's)"
    )
    # CUDA graphs for decode steps off (vLLM's --enforce-eager); they are on by default on CUDA.
    enforce_eager: bool = _option(
        False,
        action="store_true",
        help="run every step eagerly: no CUDA graphs for decode steps (they are captured at start on CUDA)",
    )

    @property
    def tokenizer_dir(self) -> str:
        return self.tokenizer or self.model

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).name

    @property
    def resolved_num_threads(self) -> int:
        return self.num_threads or len(os.sched_getaffinity(0))

    def _check_model_options(self) -> None:
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
