"""Engine options: one frozen dataclass, shared by `LLM`, `AsyncEngine`, `hearth serve`, `hearth bench
offline` and a multi-node worker.

Each option is defined once, on a field of the sub-config of the layer that owns it (`hearth.model.options`,
`hearth.kv.options`, `hearth.parallel.options`, `hearth.engine.speculative.options`,
`hearth.kv_transfer.options`, and the scheduler's here): default, type, choices, help and vLLM's spellings
(`hearth.contracts.options.option`). `EngineConfig` is all of them at once, flat, so `EngineConfig(model=...,
page_size=...)` and `LLM(model, **options)` take every option by its name and a layer can take just its
sub-config; the flags of every command that builds an engine are generated from the fields
(`add_cli_arguments`).

Torch-free: names come from registries of lazy entries (proposers, KV transports) and torch-free tables
(dtypes, quantization modes); a test imports this module in a fresh interpreter and checks.
"""

from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass, fields
from typing import Any

from hearth.contracts.options import add_arguments, check_choices, on_off, option
from hearth.engine import config_values
from hearth.engine.speculative.options import SpeculativeOptions
from hearth.kv.options import KV_INTEGRITY_ACTIONS, CacheOptions, KVTierOptions
from hearth.kv_transfer.options import ROLE_CHOICES, KVTransferOptions
from hearth.model.options import DEVICE_CHOICES, DTYPE_CHOICES, ModelOptions
from hearth.parallel.options import ParallelOptions

__all__ = [
    "DEVICE_CHOICES",
    "DTYPE_CHOICES",
    "GROUPS",
    "KV_INTEGRITY_ACTIONS",
    "ROLE_CHOICES",
    "EngineConfig",
]

# Sub-config -> the title of its flags in --help, in the order they are listed.
GROUPS = {
    "model": "model and loading (hearth.model)",
    "cache": "KV cache (hearth.kv)",
    "scheduler": "scheduler (hearth.engine.scheduler)",
    "parallel": "parallelism (hearth.parallel, hearth.engine.ranks)",
    "speculative": "speculative decoding (hearth.engine.speculative)",
    "kv_transfer": "prefill/decode disaggregation (docs/pd-protocol.md)",
    "kv_tiers": "KV tiers below device memory (hearth.kv.tiers)",
}


_option = functools.partial(option, group="scheduler")


@dataclass(frozen=True)
class SchedulerOptions:
    """What one engine step may hold, and whether the next step is built while this one runs."""

    max_num_batched_tokens: int = _option(2048, type=int, help="token budget per engine step")
    max_num_seqs: int = _option(256, type=int, help="most requests running at once")
    # Overlap scheduling (hearth.engine.overlap): the host builds step N+1 while the worker runs step N.
    # None: on with an accelerator, off on a CPU.
    async_scheduling: bool | None = _option(
        None,
        type=on_off,
        help="on/off: build the next decode step while the current one runs (default: on with a GPU)",
    )


# Fields are ordered from the last base to the first: the model's (`model`, the one without a default) first.
@dataclass(frozen=True)
class EngineConfig(
    KVTierOptions,
    KVTransferOptions,
    SpeculativeOptions,
    ParallelOptions,
    SchedulerOptions,
    CacheOptions,
    ModelOptions,
):
    def __post_init__(self) -> None:
        check_choices(self)  # dtype, device, kv_cache_dtype, quantization, role, kv_transfer, ...
        if self.page_size < 1 or self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("page_size, max_num_batched_tokens and max_num_seqs must be >= 1")
        self._check_model_options()
        self._check_cache_options()
        self._check_parallel_options()
        self._check_speculative_options()
        self._check_kv_transfer_options()
        self._check_kv_tier_options()

    @staticmethod
    def add_cli_arguments(parser: argparse.ArgumentParser, require_model: bool = False) -> None:
        """Every option's flag, generated from the fields, plus `--speculative-config`: vLLM's JSON form of
        the speculative options, which fills several fields at once (`from_cli_args`)."""
        groups = add_arguments(parser, EngineConfig, GROUPS, required=("model",) if require_model else ())
        groups["speculative"].add_argument(
            "--speculative-config",
            type=config_values.speculative_config,
            default=None,
            help='vLLM\'s JSON form: {"method": "ngram"|"suffix"|"draft_model"|"eagle3", "model": DIR, '
            '"num_speculative_tokens": N, "prompt_lookup_max": N, "prompt_lookup_min": N}',
        )

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **overrides: Any) -> EngineConfig:
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        names = values.get("served_model_name")
        if isinstance(names, list):  # vLLM takes several; the first is the one answers carry
            values["served_model_name"] = names[0]
        speculative = getattr(args, "speculative_config", None)
        if speculative:
            if getattr(args, "speculative_method", None) is not None:
                raise ValueError("give --speculative-config or --speculative-method, not both")
            values.update(speculative)
        values.update(overrides)
        return cls(**values)
