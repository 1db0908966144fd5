"""Engine options: one frozen dataclass, shared by `LLM`, `AsyncEngine`, `hearth serve`, `hearth bench
offline` and a multi-node worker.

Each option is defined once, on its field: default, type, choices, help and vLLM's spellings
(`hearth.contracts.options`); the flags of every command that builds an engine are generated from the fields
(`add_cli_arguments`). Fields are grouped by the sub-config that owns them (`GROUPS`: model and loading, KV
cache, scheduler, parallelism, speculative decoding, KV transfer, KV tiers); the config stays flat so
`EngineConfig(model=..., page_size=...)` and `LLM(model, **options)` take every option by its name.

Torch-free: names come from registries of lazy entries (proposers, KV transports) and torch-free tables
(dtypes, quantization modes); a test imports this module in a fresh interpreter and checks.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from hearth.contracts.cli_common import DEFAULT_PAGE_SIZE
from hearth.contracts.options import add_arguments, check_choices, not_an_option, option
from hearth.engine import config_values
from hearth.engine.config_values import DTYPE_CHOICES, on_off
from hearth.engine.speculative.registry import PROPOSERS, check_speculative_options
from hearth.kv.dtypes import KV_CACHE_DTYPE_CHOICES
from hearth.kv_transfer import KV_TRANSPORTS
from hearth.model.quantization.select import QUANTIZATION_CHOICES

__all__ = [
    "DEVICE_CHOICES",
    "DTYPE_CHOICES",
    "GROUPS",
    "KV_INTEGRITY_ACTIONS",
    "ROLE_CHOICES",
    "EngineConfig",
]

DEVICE_CHOICES = ("auto", "cpu", "cuda")
KV_INTEGRITY_ACTIONS = ("recompute", "abort")
ROLE_CHOICES = ("mixed", "prefill", "decode")

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


@dataclass(frozen=True)
class EngineConfig:
    model: str = option(help="Hugging Face checkpoint directory", group="model")
    dtype: str = option(
        "auto",
        group="model",
        type=config_values.dtype,
        choices=DTYPE_CHOICES,
        metavar="{" + ",".join(DTYPE_CHOICES) + ",half,float}",
        help="weights/activations dtype; auto = the checkpoint's (float32 on CPUs without bf16/fp16 math)",
    )
    # None: sized by `hearth.engine.kv_budget` (GPU: from free device memory and gpu_memory_utilization;
    # CPU: $VLLM_CPU_KVCACHE_SPACE GiB, else 1 GiB).
    kv_cache_memory_gib: float | None = option(
        None,
        group="cache",
        flags=("--kv-cache-memory",),
        type=float,
        help="memory for the KV cache, GiB (default: GPU: what --gpu-memory-utilization leaves after the "
        "weights; CPU: $VLLM_CPU_KVCACHE_SPACE, else 1)",
    )
    page_size: int = option(
        DEFAULT_PAGE_SIZE,
        group="cache",
        flags=("--page-size", "--block-size"),
        type=int,
        help="tokens per KV page",
    )
    max_num_batched_tokens: int = option(
        2048, group="scheduler", type=int, help="token budget per engine step"
    )
    max_num_seqs: int = option(256, group="scheduler", type=int, help="most requests running at once")
    max_model_len: int | None = option(
        None,
        group="model",
        type=config_values.max_model_len,
        help="context limit in tokens: 4096, 32k (32000), 32K (32768), auto (default: the model's, "
        "bounded by the KV cache)",
    )
    enable_prefix_caching: bool = option(
        True,
        group="cache",
        action=argparse.BooleanOptionalAction,
        hidden_negatives=("--no-prefix-caching",),
        help="reuse the KV of shared prompt prefixes",
    )
    seed: int = option(0, group="model", type=int, help="seed for unseeded sampling")
    num_threads: int | None = option(
        None, group="model", type=int, help="torch CPU threads (default: all cores)"
    )
    served_model_name: str | None = option(
        None,
        group="model",
        nargs="+",
        help="model name in the API; more names are accepted as aliases (default: directory name)",
    )
    load_progress: bool = not_an_option(False)  # a progress bar: `hearth serve` asks for one
    device: str = option(
        "auto",
        group="model",
        choices=DEVICE_CHOICES,
        help="where the model and KV cache live; auto = cuda when available, else cpu",
    )
    kv_cache_dtype: str = option(
        "auto",
        group="cache",
        type=config_values.kv_cache_dtype,
        choices=KV_CACHE_DTYPE_CHOICES,
        metavar="{" + ",".join(KV_CACHE_DTYPE_CHOICES) + ",fp8}",
        help="KV cache storage dtype (fp8 = fp8_e4m3); auto = the model's dtype; fp8_e4m3 halves the bytes per "
        "token (per-head scales from the checkpoint or a calibration pass)",
    )
    # Parallelism (hearth.parallel, hearth.engine.ranks): ranks = tensor x pipeline parallel size, over `nnodes` hosts.
    tensor_parallel_size: int = option(
        1,
        group="parallel",
        flags=("--tensor-parallel-size", "-tp"),
        type=int,
        help="ranks that split every layer (by heads)",
    )
    pipeline_parallel_size: int = option(
        1,
        group="parallel",
        flags=("--pipeline-parallel-size", "-pp"),
        type=int,
        help="pipeline stages (ranks holding consecutive layers)",
    )
    expert_parallel: bool = option(
        False,
        group="parallel",
        flags=("--expert-parallel", "--enable-expert-parallel"),
        action="store_true",
        help="MoE models: each tensor-parallel rank holds whole experts (a 1/N share of them) instead of a "
        "slice of each",
    )
    nnodes: int = option(1, group="parallel", type=int, help="hosts the ranks span (as torchrun)")
    node_rank: int = option(0, group="parallel", type=int, help="this host's index; node 0 serves the API")
    master_addr: str = option("127.0.0.1", group="parallel", help="node 0's address for the rendezvous")
    master_port: int | None = option(  # None on one node: a free port is picked
        None, group="parallel", type=int, help="node 0's rendezvous port (default on one node: a free one)"
    )
    # Speculative decoding (hearth.engine.speculative): None = off.
    speculative_method: str | None = option(
        None,
        group="speculative",
        choices=PROPOSERS,
        help="propose tokens for the target to verify: a draft model, prompt lookup (ngram), suffix decoding "
        "over the request and its tenant's earlier answers (suffix; try --num-speculative-tokens 8), or an "
        "EAGLE-3 head",
    )
    speculative_model: str | None = option(
        None, group="speculative", help="checkpoint directory of the draft model (draft, eagle3)"
    )
    num_speculative_tokens: int = option(
        4, group="speculative", type=int, help="most tokens proposed per request and step"
    )
    # Speculation turns itself off for a step with more decode rows than this (verification stops paying).
    # None: 8 on CPU (at batch 64 on the demo model, 8 kept speculation at 0.98-1.08x of none where 32 lost
    # 12-15%), 32 on accelerators, where a wider verify row is nearer free.
    speculative_max_batch_size: int | None = option(
        None,
        group="speculative",
        type=int,
        help="no speculation in steps with more decode rows than this (it stops paying); "
        "default 8 on CPU, 32 on accelerators",
    )
    # Check every step's page tables against the pages' tags (hearth.kv.integrity).
    kv_integrity: bool = option(
        True,
        group="cache",
        type=on_off,
        metavar="{on,off}",
        help="check each step's KV page tables against the pages' tags before the model reads them",
    )
    kv_integrity_action: str = option(
        "recompute",
        group="cache",
        choices=KV_INTEGRITY_ACTIONS,
        help="on a page tag mismatch: recompute the request once (then fail it), or fail it at once",
    )
    # Prefill/decode disaggregation (hearth.kv_transfer); the secret travels in $HEARTH_KV_TRANSFER_SECRET.
    role: str = option(
        "mixed",
        group="kv_transfer",
        choices=ROLE_CHOICES,
        help="mixed: computes everything; prefill: computes prompts and sends their KV; decode: receives "
        "prompt KV and answers",
    )
    kv_transfer: str = option(
        "tcp", group="kv_transfer", choices=KV_TRANSPORTS, help="how KV moves between servers"
    )
    kv_transfer_host: str = option(
        "127.0.0.1", group="kv_transfer", help="decode role: address the KV listener binds"
    )
    kv_transfer_port: int = option(
        0, group="kv_transfer", type=int, help="decode role: KV listener port (0: any free port)"
    )
    kv_transfer_timeout_s: float = option(
        30.0,
        group="kv_transfer",
        flags=("--kv-transfer-timeout",),
        type=float,
        help="seconds a decode request waits for its KV before it computes the prompt itself",
    )
    quantization: str = option(
        "auto",
        group="model",
        flags=("--quantization", "-q"),
        type=config_values.quantization,
        choices=QUANTIZATION_CHOICES,
        metavar="{" + ",".join(QUANTIZATION_CHOICES) + "}",
        help="weights: auto = as the checkpoint's quantization_config says (GPTQ/AWQ/compressed-tensors INT4, "
        "FP8 blocks), else dense; int4 = round-to-nearest INT4 per group at load time",
    )
    kv_offload_memory_gib: float = option(
        0.0,
        group="kv_tiers",
        flags=("--kv-offload-memory",),
        type=float,
        help="host RAM for KV pages evicted from the device cache, GiB (0: none)",
    )
    kv_disk_dir: str | None = option(
        None, group="kv_tiers", help="directory for a local-disk KV tier (survives restarts)"
    )
    kv_disk_size_gib: float = option(
        16.0, group="kv_tiers", flags=("--kv-disk-size",), type=float, help="disk KV tier size, GiB"
    )
    kv_store: str | None = option(
        None,
        group="kv_tiers",
        help="cluster-shared KV store: redis://host:port[/db] or mooncake://master:port?metadata=URL",
    )
    # Pipeline parallelism (hearth.engine.ranks.microbatch, hearth.engine.ranks.pipeline): micro-batches per
    # step (0: auto, 2 x stages; 1: none), and the layers per stage (None: balanced by the cost model).
    pipeline_micro_batches: int = option(
        0,
        group="parallel",
        type=int,
        help="micro-batches a step is cut into so pipeline stages overlap (0: 2 x stages; 1: none)",
    )
    pipeline_stage_layers: tuple[int, ...] | None = option(
        None,
        group="parallel",
        type=config_values.int_list,
        help="layers per pipeline stage, e.g. 30,31 (default: balanced by a cost model measured at start)",
    )
    # vLLM's options (docs/server.md "Coming from vLLM"): the share of device memory this server may use
    # (weights + KV + activations), a tokenizer from elsewhere, ngram lookup lengths (min, max).
    gpu_memory_utilization: float | None = (
        option(  # None: 0.9 on GPU, no cap on CPU (hearth.engine.kv_budget)
            None,
            group="cache",
            type=config_values.memory_fraction,
            help="share of the device's memory this server may use (weights, KV cache, activations); the KV cache "
            "gets what is left of it (default 0.9). On CPU (when given): a cap on weights + KV cache as a share "
            "of the host memory available at start",
        )
    )
    tokenizer: str | None = option(
        None, group="model", help="tokenizer (and chat template) directory (default: the model's)"
    )
    ngram_lookup: tuple[int, int] | None = not_an_option(None)  # --speculative-config's prompt_lookup_min/max
    # Tool-pause retention (hearth.engine.retention): seconds a session's pages stay held after its turn
    # (0: off), and the shares of the KV pages all sessions, and one tenant's sessions, may hold.
    session_retention_s: float = option(
        0.0,
        group="cache",
        type=float,
        help="keep an agent session's KV pages for this long after each turn, so the next turn (after a tool "
        "call) finds them (0: off; sessions are named by the session headers or previous_response_id)",
    )
    session_retention_share: float = option(
        0.25, group="cache", type=float, help="largest share of the KV pages that retained sessions may hold"
    )
    session_retention_tenant_share: float = option(
        0.1,
        group="cache",
        type=float,
        help="largest share of the KV pages that one tenant's retained sessions may hold",
    )
    # CUDA graphs for decode steps off (vLLM's --enforce-eager); they are on by default on CUDA.
    enforce_eager: bool = option(
        False,
        group="model",
        action="store_true",
        help="run every step eagerly: no CUDA graphs for decode steps (they are captured at start on CUDA)",
    )
    # Overlap scheduling (hearth.engine.overlap): the host builds step N+1 while the worker runs step N.
    # None: on with an accelerator, off on a CPU.
    async_scheduling: bool | None = option(
        None,
        group="scheduler",
        type=on_off,
        help="on/off: build the next decode step while the current one runs (default: on with a GPU)",
    )

    def __post_init__(self) -> None:
        check_choices(self)  # dtype, device, kv_cache_dtype, quantization, role, kv_transfer, ...
        if self.kv_cache_memory_gib is not None and self.kv_cache_memory_gib <= 0:
            raise ValueError("kv_cache_memory_gib must be > 0")
        if self.gpu_memory_utilization is not None and not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.page_size < 1 or self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("page_size, max_num_batched_tokens and max_num_seqs must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        from hearth.parallel.topology import ParallelConfig  # torch-free: checks sizes and nodes

        ParallelConfig(
            self.tensor_parallel_size,
            self.pipeline_parallel_size,
            self.expert_parallel,
            self.nnodes,
            self.node_rank,
        )
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError(
                "with nnodes > 1, master_port (and master_addr) must name node 0's rendezvous port"
            )
        if self.speculative_method is not None:
            check_speculative_options(
                self.speculative_method, self.speculative_model, self.num_speculative_tokens
            )
        if self.kv_transfer_timeout_s <= 0:
            raise ValueError("kv_transfer_timeout_s must be > 0")
        if self.kv_offload_memory_gib < 0 or self.kv_disk_size_gib <= 0:
            raise ValueError("kv_offload_memory_gib must be >= 0 and kv_disk_size_gib > 0")
        if self.pipeline_micro_batches < 0:
            raise ValueError("pipeline_micro_batches must be >= 0 (0: auto)")
        if self.pipeline_stage_layers is not None:
            layers = tuple(self.pipeline_stage_layers)
            if len(layers) != self.pipeline_parallel_size or min(layers) < 1:
                raise ValueError(
                    f"pipeline_stage_layers needs one layer count >= 1 per stage "
                    f"({self.pipeline_parallel_size}), got {list(layers)}"
                )
            object.__setattr__(self, "pipeline_stage_layers", layers)

    @property
    def kv_tiers_enabled(self) -> bool:
        return bool(self.kv_offload_memory_gib > 0 or self.kv_disk_dir or self.kv_store)

    @property
    def tokenizer_dir(self) -> str:
        return self.tokenizer or self.model

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).name

    @property
    def resolved_num_threads(self) -> int:
        return self.num_threads or len(os.sched_getaffinity(0))

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
