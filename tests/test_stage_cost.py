"""Pipeline stages balanced by measured cost (hearth.engine.ranks.stage_cost, pipeline): the cost model and
the split on uneven models, in plain Python with a fixed timing (no calibration, milliseconds)."""

from __future__ import annotations

import pytest
import torch

from hearth.engine.ranks.pipeline import ranges_of, stage_layers
from hearth.engine.ranks.stage_cost import (
    LayerWeights,
    LinearTiming,
    calibrate,
    layer_seconds,
    stage_seconds,
    step_costs,
)
from hearth.parallel.topology import split_layers

# Memory-bound up to 32 rows (time per parameter flat), then compute-bound (growing with rows).
TIMING = LinearTiming((1, 32, 128), (1e-10, 1e-10, 4e-10))

# DeepSeek-V3 / Kimi K2 shapes: hidden 7168, MLA attention ~187M parameters, 3 dense layers (MLP 18432
# wide), then 58 MoE layers of 256 experts (2048 wide, 8 per token) + 1 shared expert; vocab 129280.
ATTENTION = 187_000_000
EXPERT = 3 * 7168 * 2048
DENSE = LayerWeights(ATTENTION + 3 * 7168 * 18432)
MOE = LayerWeights(ATTENTION + EXPERT + 256 * 7168, 256 * EXPERT, 256, 8)
DEEPSEEK_V3 = [DENSE] * 3 + [MOE] * 58
HIDDEN, VOCAB = 7168, 129280


def params_split(weights: list[LayerWeights], stages: int) -> list[range]:
    """The old split: parameter counts, LM head on the last stage."""
    return split_layers(
        [w.dense_params + w.expert_params for w in weights], stages, last_extra=VOCAB * HIDDEN
    )


def test_timing_interpolates_and_grows_past_the_last_measured_batch():
    assert TIMING.per_param(1) == TIMING.per_param(0.5) == 1e-10
    assert TIMING.per_param(80) == pytest.approx(2.5e-10)
    assert TIMING.per_param(256) == pytest.approx(8e-10)


def test_a_moe_layer_costs_the_experts_its_tokens_touch_not_all_of_them():
    params_ratio = (MOE.dense_params + MOE.expert_params) / DENSE.dense_params  # ~20x
    # One token reads 8 of 256 experts: the MoE layer costs about what the dense one does.
    assert layer_seconds(MOE, TIMING, 1) / layer_seconds(DENSE, TIMING, 1) == pytest.approx(1.0, abs=0.05)
    # 64 tokens touch ~222 experts, each with ~2 rows (memory-bound): ~9x, still far from 20x.
    ratio_64 = layer_seconds(MOE, TIMING, 64) / layer_seconds(DENSE, TIMING, 64)
    assert 8 < ratio_64 < 10 < params_ratio


def test_deepseek_v3_on_eight_stages_at_batch_one_is_balanced_by_time_not_parameters():
    costs = step_costs(DEEPSEEK_V3, TIMING, 1, HIDDEN, VOCAB)
    by_params = params_split(DEEPSEEK_V3, 8)
    by_cost = split_layers(costs.layer_s, 8, costs.first_extra_s, costs.last_extra_s)
    # Parameters put 10 layers on stage 0 (its 3 dense layers look 20x lighter than they run).
    assert [len(s) for s in by_params] == [10, 7, 7, 7, 7, 8, 8, 7]
    assert [len(s) for s in by_cost] == [8, 8, 8, 8, 8, 7, 8, 6]
    slowest_params, slowest_cost = max(stage_seconds(costs, by_params)), max(stage_seconds(costs, by_cost))
    assert slowest_params / slowest_cost == pytest.approx(1.25, abs=0.01)


def test_at_a_large_batch_the_moe_layers_dominate_and_both_splits_agree():
    costs = step_costs(DEEPSEEK_V3, TIMING, 64, HIDDEN, VOCAB)
    by_cost = split_layers(costs.layer_s, 8, costs.first_extra_s, costs.last_extra_s)
    assert by_cost == params_split(DEEPSEEK_V3, 8)


def test_a_big_lm_head_leaves_the_last_stage_fewer_layers():
    # A small dense model with a 152k vocabulary: the head is ~4.7 layers of work.
    layers = [LayerWeights(50_000_000)] * 28
    costs = step_costs(layers, TIMING, 8, 1536, 151936)
    assert costs.last_extra_s / costs.layer_s[0] == pytest.approx(4.67, abs=0.01)
    stages = split_layers(costs.layer_s, 2, costs.first_extra_s, costs.last_extra_s)
    assert stages == [range(0, 16), range(16, 28)]
    first, last = stage_seconds(costs, stages)
    assert abs(first - last) <= costs.layer_s[0]  # as equal as whole layers allow


def test_given_layer_counts_must_cover_the_model(tiny_model_factory):
    from hearth.model.config import ModelConfig

    config = ModelConfig.from_dir(tiny_model_factory("llama", num_hidden_layers=4))
    assert stage_layers(config, 2, (3, 1)) == (range(0, 3), range(3, 4))
    assert ranges_of((1, 2, 1), 4) == (range(0, 1), range(1, 3), range(3, 4))
    with pytest.raises(ValueError, match="adds up to 3 layers; the model has 4"):
        stage_layers(config, 2, (2, 1))


def test_calibration_measures_time_per_parameter_that_never_falls_with_rows():
    timing = calibrate(torch.float32, torch.device("cpu"), repeats=1)
    values = timing.seconds_per_param
    assert all(v > 0 for v in values) and list(values) == sorted(values)


def test_pipeline_options_parse_and_are_checked():
    import argparse

    from hearth.engine.config import EngineConfig

    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_arguments(parser)
    args = parser.parse_args("--model m -pp 2 --pipeline-stage-layers 3,1 --pipeline-micro-batches 4".split())
    config = EngineConfig.from_cli_args(args)
    assert (config.pipeline_stage_layers, config.pipeline_micro_batches) == ((3, 1), 4)
    with pytest.raises(ValueError, match="one layer count >= 1 per stage"):
        EngineConfig("m", pipeline_parallel_size=2, pipeline_stage_layers=(4,))
