"""Command-line values as vLLM users write them, turned into Hearth's: `32k` lengths, `half`, `fp8`, `-q
awq_marlin`, `--speculative-config '{...}'`. Torch-free (argparse types); a value whose meaning Hearth
cannot keep is refused with the Hearth option that comes closest."""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

# vLLM's human-readable integers: lowercase k/m/g are powers of 1000, uppercase K/M/G of 1024 (`32k` = 32000,
# `32K` = 32768); decimals allowed with a suffix (`25.6k`).
_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}
_HUMAN_INT = re.compile(r"^(\d+(?:\.\d+)?)([kmgKMG]?)$")


def human_int(text: str) -> int:
    """`4096`, `32k`, `32K`, `1m`, `25.6k` -> tokens."""
    match = _HUMAN_INT.match(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a token count (a number, optionally with k/K/m/M: 32k = 32000, 32K = 32768)"
        )
    number, suffix = match.groups()
    if suffix:
        value = float(number) * _SUFFIXES[suffix]
        if value != int(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of tokens")
        return int(value)
    if "." in number:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of tokens")
    return int(number)


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


DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32")


def dtype(text: str) -> str:
    value = _DTYPE_ALIASES.get(text, text)
    if value not in DTYPE_CHOICES:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a dtype; use one of {', '.join(DTYPE_CHOICES)} (or half, float)"
        )
    return value


# vLLM's `fp8` is E4M3 on every GPU Hearth targets; E5M2 keeps no per-head scales and is not built.
_KV_DTYPE_ALIASES = {"fp8": "fp8_e4m3", "fp8_e4m3fn": "fp8_e4m3", "half": "float16", "float": "float32"}


def kv_cache_dtype(text: str) -> str:
    from hearth.kv.dtypes import KV_CACHE_DTYPE_CHOICES

    value = _KV_DTYPE_ALIASES.get(text, text)
    if value == "fp8_e5m2":
        raise argparse.ArgumentTypeError(
            "fp8_e5m2 KV caches are not supported; use --kv-cache-dtype fp8 (fp8_e4m3 with per-head scales)"
        )
    if value not in KV_CACHE_DTYPE_CHOICES:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a KV cache dtype; use one of {', '.join(KV_CACHE_DTYPE_CHOICES)} (or fp8)"
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
    from hearth.model.quantization.select import QUANTIZATION_CHOICES

    value = _QUANTIZATION_ALIASES.get(text, text)
    if value not in QUANTIZATION_CHOICES:
        raise argparse.ArgumentTypeError(
            f"quantization {text!r} is not supported; Hearth reads {', '.join(QUANTIZATION_CHOICES)} "
            "(awq_marlin = awq, gptq_marlin = gptq); auto follows the checkpoint's quantization_config"
        )
    return value


def on_off(value: str) -> bool:
    if value not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {value!r}")
    return value == "on"


def int_list(text: str) -> tuple[int, ...]:
    """`30,31` -> (30, 31)."""
    try:
        return tuple(int(n) for n in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def memory_fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"{value} is not a fraction in (0, 1]")
    return value


# vLLM's methods Hearth has no proposer for: refused by name rather than as a typo.
_UNSUPPORTED_SPECULATIVE_METHODS = (
    "eagle",
    "medusa",
    "mlp_speculator",
    "deepseek_mtp",
    "mtp",
    "ernie_mtp",
    "qwen3_next_mtp",
)
_SPECULATIVE_KEYS = {
    "method",
    "model",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "draft_tensor_parallel_size",
    "max_model_len",
    "quantization",
    "revision",
    "disable_by_batch_size",
}


def speculative_config(text: str) -> dict[str, Any]:
    """`--speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'` as EngineConfig fields.

    Keys whose meaning Hearth cannot keep are refused by name rather than dropped."""
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"--speculative-config is not JSON: {exc}") from None
    if not isinstance(spec, dict):
        raise argparse.ArgumentTypeError("--speculative-config must be a JSON object")
    unknown = sorted(set(spec) - _SPECULATIVE_KEYS)
    if unknown:
        raise argparse.ArgumentTypeError(
            f"--speculative-config: {', '.join(unknown)} not supported (Hearth reads method, model, "
            "num_speculative_tokens, prompt_lookup_max/min, disable_by_batch_size)"
        )
    from hearth.engine.speculative.registry import PROPOSERS  # torch-free: lazy entries

    methods = ", ".join(PROPOSERS.choices())
    method = spec.get("method")
    if method is None:
        method = "draft_model" if spec.get("model") else None
    if method in _UNSUPPORTED_SPECULATIVE_METHODS:
        raise argparse.ArgumentTypeError(
            f"--speculative-config method {method!r} is not supported; Hearth proposes with {methods} "
            "(draft_model: a smaller model of the same tokenizer; eagle3: an EAGLE-3 head)"
        )
    if not isinstance(method, str) or method not in PROPOSERS:
        raise argparse.ArgumentTypeError(
            f"--speculative-config needs method ({methods}) or a draft model, got {method!r}"
        )
    for key in ("draft_tensor_parallel_size",):
        if spec.get(key) not in (None, 1):
            raise argparse.ArgumentTypeError(f"--speculative-config {key}: only 1 is supported")
    for key in ("quantization", "revision", "max_model_len"):
        if spec.get(key) is not None:
            raise argparse.ArgumentTypeError(
                f"--speculative-config {key} is not supported; the draft loads as its checkpoint says"
            )
    fields: dict[str, Any] = {"speculative_method": PROPOSERS.canonical(method)}
    if spec.get("model") is not None:
        fields["speculative_model"] = str(spec["model"])
    if spec.get("num_speculative_tokens") is not None:
        fields["num_speculative_tokens"] = _positive(spec["num_speculative_tokens"], "num_speculative_tokens")
    if spec.get("disable_by_batch_size") is not None:
        fields["speculative_max_batch_size"] = _positive(
            spec["disable_by_batch_size"], "disable_by_batch_size"
        )
    lookup = (spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max"))
    if lookup != (None, None):
        if fields["speculative_method"] != "ngram":
            raise argparse.ArgumentTypeError(
                "--speculative-config prompt_lookup_min/max are for method ngram"
            )
        fields["ngram_lookup"] = (
            _positive(lookup[0] if lookup[0] is not None else 1, "prompt_lookup_min"),
            _positive(lookup[1] if lookup[1] is not None else 4, "prompt_lookup_max"),
        )
    return fields


def _positive(value: Any, key: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise argparse.ArgumentTypeError(
            f"--speculative-config {key} must be a positive integer, got {value!r}"
        )
    return value
