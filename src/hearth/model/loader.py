"""Load a Hugging Face checkpoint directory (or a GGUF file, `hearth.model.gguf_file`) into the model its config names: build the model class
from the registry on the meta device, place it on the device, and hand every checkpoint tensor to
the weight loader of the parameter it maps to (`hearth.model.weights`)."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hearth.model.config import ModelConfig, ModelLoadError
from hearth.model.decoder import CausalLM, MissingLayer
from hearth.model.gguf_file import GGUFCheckpoint, QuantizedTensor, is_gguf_path
from hearth.model.kv_scale_names import kv_scale_target
from hearth.model.layers import LayerOptions
from hearth.model.lazy_tensor import LOADED_BYTES, LazyTensor
from hearth.model.quantization import get_quantization_method
from hearth.model.registry import get_model_class
from hearth.model.weights import ShardId, TPRank, WeightShapeError, default_weight_loader

logger = logging.getLogger(__name__)


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


def load_model(
    model_dir: str | Path,
    config: ModelConfig,
    dtype: torch.dtype,
    max_positions: int,
    progress: bool = False,
    device: torch.device | str = "cpu",
    *,
    quantization: str = "unquantized",
    quant_config: dict[str, Any] | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
    layers: range | None = None,
) -> CausalLM:
    """The model of `config` with the checkpoint's weights (this rank's shard of them, of the decoder
    layers `layers` of its pipeline stage; None: all), on `device`,
    in eval mode and processed for inference by its quantization method (on CPU: the fast paths'
    weight layouts; on other devices the unquantized weights stay as loaded)."""
    model_dir = Path(model_dir)
    if not is_gguf_path(model_dir):
        checkpoint_files(model_dir)  # no weights: fail before allocating the model
    model = build_model(
        config,
        dtype,
        max_positions,
        device=device,
        quantization=quantization,
        quant_config=quant_config,
        tp_rank=tp_rank,
        tp_size=tp_size,
        layers=layers,
    )
    load_weights(model, model_dir, progress=progress)
    model.eval()
    model.prepare_for_inference()
    return model


def build_model(
    config: ModelConfig,
    dtype: torch.dtype,
    max_positions: int,
    *,
    device: torch.device | str = "cpu",
    quantization: str = "unquantized",
    quant_config: dict[str, Any] | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
    layers: range | None = None,
) -> CausalLM:
    """The registered class of `config.architecture`, its parameters allocated (not initialised) on `device`."""
    options = LayerOptions(
        tp=TPRank(tp_rank, tp_size),
        quant_method=get_quantization_method(quantization, quant_config),
        layers=layers,
    )
    model_class = get_model_class(config.architecture)
    # Parameters are created in `dtype` on the meta device: no initialisation, no float32 copy to cast.
    with torch.device("meta"), _default_dtype(dtype):
        model = model_class(config, max_positions, options)
    _materialize(model, torch.device(device))
    if config.tie_word_embeddings and model.model.is_last_stage:
        # to_empty() gives every module its own storage, untying them
        model.lm_head.weight = model.model.embed_tokens.weight
    # to_empty() left the rotary table uninitialised: build it, in float32.
    model.cos_sin = type(model).rotary_table(config, max_positions).to(device)
    return model


def load_weights(model: CausalLM, model_dir: str | Path, progress: bool = False) -> None:
    """Fill `model`'s parameters from the checkpoint in `model_dir` (a directory of safetensors, or a
    GGUF file); a ModelLoadError names the first tensor that does not fit (unexpected name, wrong shape)
    or the tensors the checkpoint lacks.

    Tensors of modules another pipeline stage holds are skipped unread. Parameters whose loader
    slices (`lazy_loading`) get a `LazyTensor`, so only this rank's rows / columns are read."""
    params = dict(model.named_parameters(remove_duplicate=False))
    elsewhere = tuple(
        f"{name}."
        for name, module in model.named_modules(remove_duplicate=False)
        if isinstance(module, MissingLayer)
    )
    loaded: set[tuple[str, ShardId | None]] = set()
    # FP8 KV-cache scales are not parameters: set aside for the KV pool (`hearth.engine.fp8_kv_scales`).
    model.checkpoint_kv_scales = {}
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(params), desc="Loading weights", unit="tensor", leave=False)
    with torch.no_grad():
        for source, name, read in _checkpoint_tensors(model, Path(model_dir), params):
            scale_target = kv_scale_target(name)
            if scale_target is not None:
                model.checkpoint_kv_scales[scale_target] = read(False)
                continue
            target = model.checkpoint_target(name)
            if target is None:
                continue
            param_name, shard = target
            param = params.get(param_name)
            if param is None and param_name.startswith(elsewhere):
                continue  # another pipeline stage loads it
            if param is None:
                raise ModelLoadError(f"{source}: unexpected tensor {name!r} for {model.config.architecture}")
            weight_loader = getattr(param, "weight_loader", default_weight_loader)
            tensor = read(getattr(param, "lazy_loading", False))
            if isinstance(tensor, QuantizedTensor) and not getattr(param, "gguf_blocks", False):
                # The file's blocks stay beside the dense copy: a tied LM head runs on them (`quantize_lm_head`).
                param.gguf_source = tensor
                tensor = tensor.dequantize().to(param.dtype)  # embeddings, norms: no block-quantized path
            try:
                weight_loader(param, tensor, shard)
            except WeightShapeError as exc:
                raise ModelLoadError(
                    f"{source}: {name} has shape {exc.loaded_shape}, config implies {exc.expected_shape}"
                ) from None
            except ModelLoadError as exc:
                raise ModelLoadError(f"{source}: {name} {exc}") from None
            loaded.add((param_name, shard))
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    _check_complete(model, loaded)


TensorReader = Callable[[bool], "torch.Tensor | LazyTensor | QuantizedTensor"]


def _checkpoint_tensors(
    model: CausalLM, path: Path, params: dict[str, nn.Parameter]
) -> Iterator[tuple[str, str, TensorReader]]:
    """(file name, checkpoint tensor name, read) for every tensor of the checkpoint, in file order;
    `read(lazy)` returns it whole, or as a `LazyTensor` when `lazy` and the format can slice lazily."""
    if is_gguf_path(path):
        hf_names = [
            model.checkpoint_name(name, shard)
            for name, param in params.items()
            for shard in getattr(param, "shard_ids", (None,))
        ]
        for name, value in GGUFCheckpoint(path).tensors(hf_names):
            if isinstance(value, torch.Tensor):
                LOADED_BYTES["whole"] += value.numel() * value.element_size()
            yield path.name, name, lambda lazy, value=value: value
        return
    from safetensors import safe_open

    def read(reader: Any, name: str, lazy: bool) -> torch.Tensor | LazyTensor:
        if lazy:
            return LazyTensor.from_safetensors(reader, name)
        tensor = reader.get_tensor(name)
        LOADED_BYTES["whole"] += tensor.numel() * tensor.element_size()
        return tensor

    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as reader:
            for name in reader.keys():
                yield file.name, name, partial(read, reader, name)


def _check_complete(model: CausalLM, loaded: set[tuple[str, ShardId | None]]) -> None:
    missing = [
        model.checkpoint_name(name, shard)
        for name, param in model.named_parameters()
        for shard in getattr(param, "shard_ids", (None,))
        if (name, shard) not in loaded
    ]
    if missing:
        raise ModelLoadError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[0]}")


def _materialize(model: nn.Module, device: torch.device) -> None:
    """`to_empty(device)`, keeping the loading metadata (weight loaders, sharded dims) attached to
    each parameter: moving off the meta device makes new Parameter objects without it."""
    attrs = {name: dict(vars(param)) for name, param in model.named_parameters(remove_duplicate=False)}
    model.to_empty(device=device)
    for name, param in model.named_parameters(remove_duplicate=False):
        vars(param).update(attrs[name])


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
