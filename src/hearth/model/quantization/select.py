"""Which quantization method serves a checkpoint: `--quantization` and the checkpoint's own
`quantization_config` (config.json) together.

- `auto` (the default): the checkpoint's method (gptq, awq, compressed-tensors, fp8), else unquantized.
- `none`: unquantized; refused for a quantized checkpoint (its tensors are not dense weights).
- `int4`: round-to-nearest INT4 at load time, from a dense (BF16/FP32) checkpoint or an FP8 block-scaled
  one (`fp8-int4`: dequantized per block first); for a checkpoint that already is INT4 it is that
  checkpoint's method.
- a method's own name: that method, configured by the checkpoint.

A GGUF file with block-quantized weights is served by the `gguf` method (`auto` or `int4`); a GGUF of
F32/F16/BF16 weights is a dense checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hearth.model.config import ModelLoadError

QUANTIZATION_CHOICES = ("auto", "none", "int4", "gptq", "awq", "compressed-tensors", "fp8")

_INT4_FORMATS = ("gptq", "awq", "compressed-tensors")


def checkpoint_quant_config(model_dir: str | Path) -> dict[str, Any] | None:
    from hearth.model.gguf_file import GGUFCheckpoint, is_gguf_path

    if is_gguf_path(model_dir):
        return {"quant_method": "gguf"} if GGUFCheckpoint(model_dir).is_quantized else None
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    config = raw.get("quantization_config") or raw.get("compression_config")
    return config if isinstance(config, dict) else None


def resolve_quantization(requested: str, model_dir: str | Path) -> tuple[str, dict[str, Any] | None]:
    """(method name, the checkpoint's quantization_config or None)."""
    if requested not in QUANTIZATION_CHOICES:
        raise ModelLoadError(
            f"--quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, got {requested!r}"
        )
    config = checkpoint_quant_config(model_dir)
    shipped = str(config.get("quant_method", "")).replace("_", "-") if config else None
    if shipped is None:
        if requested in ("auto", "none"):
            return "unquantized", None
        if requested == "int4":
            return "int4", None
        raise ModelLoadError(f"--quantization {requested}: {model_dir} is not a {requested} checkpoint")
    if shipped == "gguf":
        if requested in ("auto", "int4"):
            return "gguf", config
        raise ModelLoadError(
            f"--quantization {requested}: {model_dir} holds GGUF block-quantized weights (use --quantization auto)"
        )
    if shipped not in QUANTIZATION_CHOICES:
        raise ModelLoadError(f"{model_dir}: quantization_config quant_method {shipped!r} is not supported")
    if requested in ("auto", shipped) or (requested == "int4" and shipped in _INT4_FORMATS):
        return shipped, config
    if requested == "int4" and shipped == "fp8":
        return "fp8-int4", config
    raise ModelLoadError(
        f"--quantization {requested}: {model_dir} is a {shipped} checkpoint (use --quantization auto)"
    )
