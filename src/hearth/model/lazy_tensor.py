"""A checkpoint tensor not read yet: `shape` and `narrow` like a tensor, and `materialize()` reads only
the narrowed block from the safetensors file (`safe_open(...).get_slice`). Weight loaders that slice
(column/row-parallel linears, the vocabulary-parallel embedding and head) take one, so a rank of N reads
~1/N of each sharded tensor, never the whole of it; `LOADED_BYTES` counts what was read."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

LOADED_BYTES: Counter[str] = Counter()  # "sliced": read through a LazyTensor; "whole": get_tensor


class LazyTensor:
    def __init__(self, source: Any, shape: tuple[int, ...], index: tuple[slice, ...] | None = None) -> None:
        self._source = source  # a safetensors PySafeSlice (get_shape / get_dtype / __getitem__)
        self.shape = torch.Size(shape)
        self._index = index if index is not None else tuple(slice(0, n) for n in shape)

    @classmethod
    def from_safetensors(cls, reader: Any, name: str) -> LazyTensor:
        source = reader.get_slice(name)
        return cls(source, tuple(source.get_shape()))

    def narrow(self, dim: int, start: int, length: int) -> LazyTensor:
        dim %= len(self.shape)
        if not 0 <= start <= start + length <= self.shape[dim]:
            raise IndexError(
                f"narrow({dim}, {start}, {length}) is outside a tensor of shape {tuple(self.shape)}"
            )
        base = self._index[dim].start
        index = list(self._index)
        index[dim] = slice(base + start, base + start + length)
        shape = list(self.shape)
        shape[dim] = length
        return LazyTensor(self._source, tuple(shape), tuple(index))

    def materialize(self) -> torch.Tensor:
        tensor = self._source[self._index]
        LOADED_BYTES["sliced"] += tensor.numel() * tensor.element_size()
        return tensor


def materialize(x: torch.Tensor | LazyTensor) -> torch.Tensor:
    return x.materialize() if isinstance(x, LazyTensor) else x
