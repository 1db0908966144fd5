"""Which decoder layers each pipeline stage holds.

The engine core decides once, at start (`plan_stages`): layers split so that the stages' estimated
times per step are as equal as they can be (`hearth.engine.ranks.stage_cost`: weights by kind, seconds
per parameter measured on this device), and every rank gets the result in its `EngineConfig`
(`pipeline_stage_layers`: layers per stage), so all ranks and the KV cache sizing agree.
`--pipeline-stage-layers` sets it by hand.

Without a plan (`stage_layers` called with no layer counts: a worker built directly, in tests) the
fallback balances parameter counts, built on the meta device, with the LM head counted on the last stage.
"""

from __future__ import annotations

import logging
import time

import torch

from hearth.engine.ranks.stage_cost import StageCosts, calibrate, layer_weights, stage_seconds, step_costs
from hearth.model.config import ModelConfig
from hearth.parallel.topology import split_layers

logger = logging.getLogger("hearth.distributed")


def layer_costs(config: ModelConfig) -> list[int]:
    return [w.dense_params + w.expert_params for w in layer_weights(config)]


def ranges_of(layers_per_stage: tuple[int, ...], num_layers: int) -> tuple[range, ...]:
    if sum(layers_per_stage) != num_layers:
        raise ValueError(
            f"--pipeline-stage-layers {','.join(map(str, layers_per_stage))} adds up to "
            f"{sum(layers_per_stage)} layers; the model has {num_layers}"
        )
    stages, start = [], 0
    for count in layers_per_stage:
        stages.append(range(start, start + count))
        start += count
    return tuple(stages)


def stage_layers(
    config: ModelConfig, pp_size: int, layers_per_stage: tuple[int, ...] | None = None
) -> tuple[range, ...]:
    """The layer ranges of stages 0..pp_size-1 (every stage at least one layer)."""
    if pp_size == 1:
        return (range(config.num_layers),)
    if layers_per_stage is not None:
        return ranges_of(layers_per_stage, config.num_layers)
    lm_head = config.vocab_size * config.hidden_size
    return tuple(split_layers(layer_costs(config), pp_size, last_extra=lm_head))


def plan_stages(
    config: ModelConfig, pp_size: int, dtype: torch.dtype, device: torch.device, tokens: int
) -> tuple[tuple[int, ...], list[float]]:
    """Layers per stage balancing the estimated time of a step of `tokens` tokens per micro-batch, and
    each stage's estimate (seconds); logged."""
    start = time.perf_counter()
    timing = calibrate(dtype, device)
    costs: StageCosts = step_costs(
        layer_weights(config), timing, tokens, config.hidden_size, config.vocab_size
    )
    stages = split_layers(costs.layer_s, pp_size, costs.first_extra_s, costs.last_extra_s)
    seconds = stage_seconds(costs, stages)
    logger.info(
        "pipeline stages balanced by measured cost (%d tokens per micro-batch; calibrated in %.2f s): %s",
        tokens,
        time.perf_counter() - start,
        "; ".join(
            f"stage {i}: layers {s.start}-{s.stop - 1}, ~{t * 1e3:.2f} ms"
            for i, (s, t) in enumerate(zip(stages, seconds, strict=True))
        ),
    )
    return tuple(len(s) for s in stages), seconds
