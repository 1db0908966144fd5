"""Load a Hugging Face checkpoint directory into a `CausalLM`: a name mapping plus the fused projections."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from hearth.model.config import ModelConfig, ModelLoadError
from hearth.model.decoder import CausalLM
from hearth.model.rotary import build_cos_sin_table

logger = logging.getLogger(__name__)

# checkpoint name fragment -> (our fused parameter, shard index among its parts)
FUSED_PARTS: dict[str, tuple[str, int]] = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise ModelLoadError(f"{index} is malformed ({exc})") from None
        files = sorted({model_dir / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} names shards that are missing: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"no *.safetensors weights in {model_dir} (only safetensors checkpoints are supported)"
        )
    return files


def _shard_offsets(config: ModelConfig, fused_name: str) -> list[int]:
    if fused_name.endswith("qkv_proj"):
        return [0, config.q_size, config.q_size + config.kv_size, config.q_size + 2 * config.kv_size]
    return [0, config.intermediate_size, 2 * config.intermediate_size]


def load_model(
    model_dir: str | Path,
    config: ModelConfig,
    dtype: torch.dtype,
    max_positions: int,
    progress: bool = False,
    device: torch.device | str = "cpu",
) -> CausalLM:
    from safetensors import safe_open

    model_dir = Path(model_dir)
    files = checkpoint_files(model_dir)
    with torch.device("meta"):
        model = CausalLM(config, max_positions)
    device = torch.device(device)
    model = model.to_empty(device=device).to(dtype)
    if config.tie_word_embeddings:  # to_empty() gives every module its own storage, untying them
        model.lm_head.weight = model.model.embed_tokens.weight
    # to_empty() left the rotary table uninitialised (and .to() would have cast it): rebuild it in float32.
    model.cos_sin = build_cos_sin_table(config, max_positions).to(device)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(params), desc="Loading weights", unit="tensor", leave=False)
    for path in files:
        with safe_open(str(path), framework="pt") as reader:
            for name in reader.keys():
                if name.endswith(IGNORED_SUFFIXES):
                    continue
                tensor = reader.get_tensor(name)
                target, shard = _target(name)
                if target not in params:
                    if config.tie_word_embeddings and target == "lm_head.weight":
                        continue
                    raise ModelLoadError(f"{path.name}: unexpected tensor {name!r} for {config.architecture}")
                param = params[target]
                with torch.no_grad():
                    if shard is None:
                        if param.shape != tensor.shape:
                            raise ModelLoadError(
                                f"{path.name}: {name} has shape {tuple(tensor.shape)}, config implies {tuple(param.shape)}"
                            )
                        param.copy_(tensor)
                        loaded.add(target)
                    else:
                        offsets = _shard_offsets(config, target.rsplit(".", 1)[0])
                        start, end = offsets[shard], offsets[shard + 1]
                        if tensor.shape[0] != end - start or tensor.shape[1:] != param.shape[1:]:
                            raise ModelLoadError(
                                f"{path.name}: {name} has shape {tuple(tensor.shape)}, config disagrees"
                            )
                        param[start:end].copy_(tensor)
                        loaded.add(f"{target}#{shard}")
                if bar is not None:
                    bar.update(1)
    if bar is not None:
        bar.close()
    _check_complete(model, config, loaded)
    model.eval()
    if device.type == "cpu":  # the prepacked layouts are CPU kernels' (hearth.ops.linear)
        model.prepare_for_inference()
    return model


def _target(name: str) -> tuple[str, int | None]:
    for part, (fused, shard) in FUSED_PARTS.items():
        marker = f".{part}."
        if marker in name:
            return name.replace(marker, f".{fused}."), shard
    return name, None


def _check_complete(model: CausalLM, config: ModelConfig, loaded: set[str]) -> None:
    missing = []
    for name, _ in model.named_parameters():
        if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
            parts = [f"{name}#{i}" for i in range(3)]
        elif name.endswith("gate_up_proj.weight"):
            parts = [f"{name}#{i}" for i in range(2)]
        else:
            parts = [name]
        missing.extend(p for p in parts if p not in loaded)
    if missing:
        raise ModelLoadError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[0]}")
