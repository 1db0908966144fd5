"""How checkpoint tensors get into parameters: each parameter carries a `weight_loader`, and knows
which of its dims tensor parallelism splits, so fused and sharded parameters load from the same
Hugging Face tensors a single rank does.

The contract (as in vLLM): `param.weight_loader(param, loaded_weight, shard_id)` copies the part of
the whole checkpoint tensor `loaded_weight` that this rank holds into `param`, at the place of
`shard_id` for a fused parameter (e.g. "q"/"k"/"v" of `qkv_proj`, 0/1 of `gate_up_proj`), and
raises `WeightShapeError` when the checkpoint tensor does not have the shape the config implies.
Parameters without a `weight_loader` (norms, the embedding) load with `default_weight_loader`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hearth.model.config import ModelLoadError

ShardId = str | int  # which part of a fused parameter a checkpoint tensor fills


@dataclass(frozen=True)
class TPRank:
    """This process's slot in tensor parallelism: rank `rank` of `size` ranks (one rank today)."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is outside 0..{self.size - 1}")


class WeightShapeError(ModelLoadError):
    """A checkpoint tensor whose shape is not the one the config implies; the loader names the tensor."""

    def __init__(self, loaded_shape: torch.Size | tuple[int, ...], expected_shape: tuple[int, ...]) -> None:
        self.loaded_shape = tuple(loaded_shape)
        self.expected_shape = tuple(expected_shape)
        super().__init__(f"has shape {self.loaded_shape}, config implies {self.expected_shape}")


def set_weight_attrs(param: nn.Parameter, **attrs: Any) -> None:
    """Attach loading metadata to a parameter: `weight_loader`; `output_dim` / `input_dim` (the dims
    that column- / row-parallel sharding split); `shard_ids` (the parts a fused parameter is loaded
    from; `(None,)` when absent). The loader re-attaches them when it moves the model off the meta device."""
    for key, value in attrs.items():
        setattr(param, key, value)


def default_weight_loader(
    param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId | None = None
) -> None:
    """Copy a whole tensor into a replicated, unfused parameter."""
    if shard_id is not None:
        raise ModelLoadError(
            f"is a part ({shard_id!r}) of a fused parameter, but this parameter is not fused"
        )
    if param.shape != loaded_weight.shape:
        raise WeightShapeError(loaded_weight.shape, tuple(param.shape))
    param.data.copy_(loaded_weight)


def divide(numerator: int, tp_size: int, what: str) -> int:
    """`numerator / tp_size` when the ranks split it evenly; else a ModelLoadError naming `what`."""
    if numerator % tp_size:
        raise ModelLoadError(f"{what} {numerator} does not split evenly over {tp_size} tensor-parallel ranks")
    return numerator // tp_size
