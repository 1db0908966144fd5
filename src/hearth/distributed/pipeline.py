"""Which decoder layers each pipeline stage holds, balanced by cost.

A layer's cost is its parameter count, measured by building it on the meta device (no memory, any
architecture, MoE layers and dense layers alike): decode is memory-bound, so a stage's time per step
goes with the bytes of weights it reads, and its memory with the same count. The first stage also
holds the embedding (a lookup: no cost per step worth counting), the last the LM head (a
`[vocab, hidden]` GEMM every step), which is counted.
"""

from __future__ import annotations

import torch

from hearth.distributed.topology import split_layers
from hearth.model.config import ModelConfig
from hearth.model.layers import LayerOptions
from hearth.model.registry import get_model_class


def layer_costs(config: ModelConfig) -> list[int]:
    layer_class = get_model_class(config.architecture).layer_class
    costs = []
    with torch.device("meta"):
        for index in range(config.num_layers):
            layer = layer_class(config, index, LayerOptions())
            costs.append(sum(p.numel() for p in layer.parameters()))
    return costs


def stage_layers(config: ModelConfig, pp_size: int) -> tuple[range, ...]:
    """The layer ranges of stages 0..pp_size-1 (every stage at least one layer)."""
    if pp_size == 1:
        return (range(config.num_layers),)
    lm_head = config.vocab_size * config.hidden_size
    return tuple(split_layers(layer_costs(config), pp_size, last_extra=lm_head))
