"""Command-line values as vLLM users write them, turned into Hearth's: `32k` lengths, `half`, `fp8`, `-q
awq_marlin`, `--speculative-config '{...}'`. Torch-free (argparse types); a value whose meaning Hearth
cannot keep is refused with the Hearth option that comes closest."""

from __future__ import annotations

import argparse
import json
from typing import Any

# Each value type lives with the options of the layer that owns it; this module gathers them under the names
# the command line knows them by.
from hearth.contracts.options import human_int, int_list, memory_fraction, on_off
from hearth.kv.options import kv_cache_dtype
from hearth.model.options import DTYPE_CHOICES, dtype, max_model_len, quantization

__all__ = [
    "DTYPE_CHOICES",
    "dtype",
    "human_int",
    "int_list",
    "kv_cache_dtype",
    "max_model_len",
    "memory_fraction",
    "on_off",
    "quantization",
    "speculative_config",
]

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
