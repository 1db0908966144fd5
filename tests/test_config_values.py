"""vLLM's command-line values (`32k`, `half`, `fp8`, `-q awq_marlin`, `--speculative-config`) as Hearth's."""

from __future__ import annotations

import argparse
import json

import pytest

from hearth.engine import config_values
from hearth.engine.config import EngineConfig


@pytest.mark.parametrize(
    ("text", "tokens"),
    [("4096", 4096), ("32k", 32000), ("32K", 32768), ("1m", 10**6), ("1M", 2**20), ("25.6k", 25600)],
)
def test_max_model_len_takes_vllms_suffixes(text: str, tokens: int) -> None:
    assert config_values.max_model_len(text) == tokens


@pytest.mark.parametrize("text", ["auto", "-1"])
def test_max_model_len_auto_means_the_models_limit(text: str) -> None:
    assert config_values.max_model_len(text) is None


@pytest.mark.parametrize("text", ["32q", "1.5", "k", "0.0001k", ""])
def test_a_bad_length_is_a_usage_error(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        config_values.human_int(text)


def test_dtype_aliases() -> None:
    assert config_values.dtype("half") == "float16"
    assert config_values.dtype("float") == "float32"
    assert config_values.dtype("bfloat16") == "bfloat16"
    with pytest.raises(argparse.ArgumentTypeError, match="not a dtype"):
        config_values.dtype("int8")


def test_kv_cache_dtype_fp8_is_e4m3_and_e5m2_names_the_alternative() -> None:
    assert config_values.kv_cache_dtype("fp8") == "fp8_e4m3"
    assert config_values.kv_cache_dtype("auto") == "auto"
    with pytest.raises(argparse.ArgumentTypeError, match="--kv-cache-dtype fp8"):
        config_values.kv_cache_dtype("fp8_e5m2")


def test_quantization_kernel_names_map_to_formats_and_unknown_ones_list_the_choices() -> None:
    assert config_values.quantization("awq_marlin") == "awq"
    assert config_values.quantization("gptq_marlin") == "gptq"
    assert config_values.quantization("fp8") == "fp8"
    with pytest.raises(argparse.ArgumentTypeError, match="int4"):
        config_values.quantization("bitsandbytes")


def test_speculative_config_maps_methods_and_lookup_lengths() -> None:
    fields = config_values.speculative_config(
        json.dumps(
            {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 6, "prompt_lookup_min": 2}
        )
    )
    assert fields == {"speculative_method": "ngram", "num_speculative_tokens": 5, "ngram_lookup": (2, 6)}
    draft = config_values.speculative_config('{"model": "/m/draft", "num_speculative_tokens": 3}')
    assert draft == {
        "speculative_method": "draft",
        "speculative_model": "/m/draft",
        "num_speculative_tokens": 3,
    }
    eagle = config_values.speculative_config('{"method": "eagle3", "model": "/m/head"}')
    assert eagle["speculative_method"] == "eagle3"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"method": "mtp", "num_speculative_tokens": 1}', "not supported"),
        ('{"method": "ngram", "speculative_token_tree": "x"}', "speculative_token_tree"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "positive"),
        ("[1]", "JSON object"),
        ("{", "not JSON"),
    ],
)
def test_speculative_config_refuses_what_it_cannot_keep(text: str, message: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        config_values.speculative_config(text)


def _parse(words: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_arguments(parser)
    return parser.parse_args(words)


def test_vllm_flags_reach_the_engine_config() -> None:
    args = _parse(
        "--dtype half --kv-cache-dtype fp8 --max-model-len 32k --block-size 32 -q awq_marlin "
        "--no-enable-prefix-caching --gpu-memory-utilization 0.8 --served-model-name a b --tokenizer /t "
        "--enable-expert-parallel".split()
        + ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']
    )
    config = EngineConfig.from_cli_args(args, model="/m")
    assert (config.dtype, config.kv_cache_dtype, config.max_model_len) == ("float16", "fp8_e4m3", 32000)
    assert (config.page_size, config.quantization, config.enable_prefix_caching) == (32, "awq", False)
    assert (config.gpu_memory_utilization, config.served_model_name, config.tokenizer_dir) == (0.8, "a", "/t")
    assert config.expert_parallel
    assert (config.speculative_method, config.num_speculative_tokens) == ("ngram", 3)


def test_prefix_caching_flags_both_ways() -> None:
    assert EngineConfig.from_cli_args(_parse(["--enable-prefix-caching"]), model="/m").enable_prefix_caching
    assert not EngineConfig.from_cli_args(_parse(["--no-prefix-caching"]), model="/m").enable_prefix_caching


def test_speculative_config_and_method_together_are_refused() -> None:
    args = _parse(["--speculative-method", "ngram", "--speculative-config", '{"method": "ngram"}'])
    with pytest.raises(ValueError, match="not both"):
        EngineConfig.from_cli_args(args, model="/m")


def test_speculative_config_and_method_accept_the_same_registered_methods() -> None:
    from hearth.engine.speculative.registry import PROPOSERS

    suffix = config_values.speculative_config('{"method": "suffix", "num_speculative_tokens": 8}')
    assert suffix == {"speculative_method": "suffix", "num_speculative_tokens": 8}
    assert _parse(["--speculative-method", "suffix"]).speculative_method == "suffix"
    for method in PROPOSERS.names():
        from_json = config_values.speculative_config(json.dumps({"method": method}))
        assert from_json["speculative_method"] == _parse(["--speculative-method", method]).speculative_method
    assert config_values.speculative_config('{"method": "draft_model"}')["speculative_method"] == "draft"
    with pytest.raises(
        argparse.ArgumentTypeError, match="needs method \\(draft, draft_model, eagle3, ngram, suffix\\)"
    ):
        config_values.speculative_config('{"method": "lookahead"}')
    with pytest.raises(SystemExit):
        _parse(["--speculative-method", "lookahead"])


def test_the_kv_transport_is_checked_against_its_registry() -> None:
    from hearth.contracts.registry import UnknownNameError

    assert EngineConfig(model="/m", kv_transfer="mooncake").kv_transfer == "mooncake"
    with pytest.raises(UnknownNameError, match="unknown KV transport 'rdma'; choose one of mooncake, tcp"):
        EngineConfig(model="/m", kv_transfer="rdma")
