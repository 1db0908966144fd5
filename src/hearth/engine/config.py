"""Engine options: one frozen dataclass, shared by `LLM`, `AsyncEngine`, `hearth serve` and `hearth bench offline`."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from hearth.engine import config_values
from hearth.engine.speculative.registry import PROPOSERS, check_speculative_options
from hearth.kv.dtypes import KV_CACHE_DTYPE_CHOICES, check_kv_cache_dtype
from hearth.kv_transfer import KV_TRANSPORTS
from hearth.model.quantization.select import QUANTIZATION_CHOICES

# Torch-free, like the KV dtype names: `hearth.model.quantization.select` checks them against the checkpoint.

DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32")
DEVICE_CHOICES = ("auto", "cpu", "cuda")
KV_INTEGRITY_ACTIONS = ("recompute", "abort")


def _on_off(value: str) -> bool:
    if value not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {value!r}")
    return value == "on"


ROLE_CHOICES = ("mixed", "prefill", "decode")


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = "auto"
    # None: sized by `hearth.engine.kv_budget` (GPU: from free device memory and gpu_memory_utilization;
    # CPU: $VLLM_CPU_KVCACHE_SPACE GiB, else 1 GiB).
    kv_cache_memory_gib: float | None = None
    page_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    seed: int = 0
    num_threads: int | None = None
    served_model_name: str | None = None
    load_progress: bool = False
    device: str = "auto"
    kv_cache_dtype: str = "auto"
    # Parallelism (hearth.parallel, hearth.engine.ranks): ranks = tensor x pipeline parallel size, over `nnodes` hosts.
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    expert_parallel: bool = False
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None on one node: a free port is picked
    # Speculative decoding (hearth.engine.speculative): None = off.
    speculative_method: str | None = None
    speculative_model: str | None = None
    num_speculative_tokens: int = 4
    # Speculation turns itself off for a step with more decode rows than this (verification stops paying).
    # None: 8 on CPU (at batch 64 on the demo model, 8 kept speculation at 0.98-1.08x of none where 32 lost
    # 12-15%), 32 on accelerators, where a wider verify row is nearer free.
    speculative_max_batch_size: int | None = None
    kv_integrity: bool = True  # check every step's page tables against the pages' tags (hearth.kv.integrity)
    kv_integrity_action: str = "recompute"  # on a mismatch: "recompute" once, then fail; or "abort" at once
    # Prefill/decode disaggregation (hearth.kv_transfer); the secret travels in $HEARTH_KV_TRANSFER_SECRET.
    role: str = "mixed"
    kv_transfer: str = "tcp"
    kv_transfer_host: str = "127.0.0.1"
    kv_transfer_port: int = 0
    kv_transfer_timeout_s: float = 30.0
    quantization: str = "auto"
    kv_offload_memory_gib: float = 0.0
    kv_disk_dir: str | None = None
    kv_disk_size_gib: float = 16.0
    kv_store: str | None = None
    # Pipeline parallelism (hearth.engine.ranks.microbatch, hearth.engine.ranks.pipeline): micro-batches per
    # step (0: auto, 2 x stages; 1: none), and the layers per stage (None: balanced by the cost model).
    pipeline_micro_batches: int = 0
    pipeline_stage_layers: tuple[int, ...] | None = None
    # vLLM's options (docs/server.md "Coming from vLLM"): the share of device memory this server may use
    # (weights + KV + activations), a tokenizer from elsewhere, ngram lookup lengths (min, max).
    gpu_memory_utilization: float | None = None  # None: 0.9 on GPU, no cap on CPU (hearth.engine.kv_budget)
    tokenizer: str | None = None
    ngram_lookup: tuple[int, int] | None = None
    # Tool-pause retention (hearth.engine.retention): seconds a session's pages stay held after its turn
    # (0: off), and the shares of the KV pages all sessions, and one tenant's sessions, may hold.
    session_retention_s: float = 0.0
    session_retention_share: float = 0.25
    session_retention_tenant_share: float = 0.1
    # CUDA graphs for decode steps off (vLLM's --enforce-eager); they are on by default on CUDA.
    enforce_eager: bool = False
    # Overlap scheduling (hearth.engine.overlap): the host builds step N+1 while the worker runs step N.
    # None: on with an accelerator, off on a CPU.
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype!r}")
        if self.device not in DEVICE_CHOICES:
            raise ValueError(f"device must be one of {', '.join(DEVICE_CHOICES)}, got {self.device!r}")
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, got {self.quantization!r}"
            )
        if self.kv_cache_memory_gib is not None and self.kv_cache_memory_gib <= 0:
            raise ValueError("kv_cache_memory_gib must be > 0")
        if self.gpu_memory_utilization is not None and not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.page_size < 1 or self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("page_size, max_num_batched_tokens and max_num_seqs must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if self.kv_integrity_action not in KV_INTEGRITY_ACTIONS:
            raise ValueError(
                f"kv_integrity_action must be one of {', '.join(KV_INTEGRITY_ACTIONS)}, "
                f"got {self.kv_integrity_action!r}"
            )
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
        if self.role not in ROLE_CHOICES:
            raise ValueError(f"role must be one of {', '.join(ROLE_CHOICES)}, got {self.role!r}")
        KV_TRANSPORTS.canonical(self.kv_transfer)  # an unknown name: UnknownNameError listing them
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
        group = parser.add_argument_group("engine")
        group.add_argument(
            "--model", required=require_model, default=None, help="Hugging Face checkpoint directory"
        )
        group.add_argument(
            "--served-model-name",
            nargs="+",
            default=None,
            help="model name in the API; more names are accepted as aliases (default: directory name)",
        )
        group.add_argument(
            "--tokenizer", default=None, help="tokenizer (and chat template) directory (default: the model's)"
        )
        group.add_argument(
            "--dtype",
            default="auto",
            type=config_values.dtype,
            metavar="{" + ",".join(DTYPE_CHOICES) + ",half,float}",
            help="weights/activations dtype; auto = the checkpoint's (float32 on CPUs without bf16/fp16 math)",
        )
        group.add_argument(
            "--device",
            default="auto",
            choices=DEVICE_CHOICES,
            help="where the model and KV cache live; auto = cuda when available, else cpu",
        )
        group.add_argument(
            "--kv-cache-dtype",
            default="auto",
            type=config_values.kv_cache_dtype,
            metavar="{" + ",".join(KV_CACHE_DTYPE_CHOICES) + ",fp8}",
            help="KV cache storage dtype (fp8 = fp8_e4m3); auto = the model's dtype; fp8_e4m3 halves the bytes per token (per-head scales from the checkpoint or a calibration pass)",
        )
        group.add_argument(
            "--kv-cache-memory",
            dest="kv_cache_memory_gib",
            type=float,
            default=None,
            help="memory for the KV cache, GiB (default: GPU: what --gpu-memory-utilization leaves after the "
            "weights; CPU: $VLLM_CPU_KVCACHE_SPACE, else 1)",
        )
        group.add_argument(
            "--gpu-memory-utilization",
            type=config_values.memory_fraction,
            default=None,
            help="share of the device's memory this server may use (weights, KV cache, activations); "
            "the KV cache gets what is left of it (default 0.9). On CPU (when given): a cap on weights + KV cache as a share of the "
            "host memory available at start",
        )
        group.add_argument(
            "--page-size", "--block-size", dest="page_size", type=int, default=16, help="tokens per KV page"
        )
        group.add_argument(
            "--max-num-batched-tokens", type=int, default=2048, help="token budget per engine step"
        )
        group.add_argument("--max-num-seqs", type=int, default=256, help="most requests running at once")
        group.add_argument(
            "--max-model-len",
            type=config_values.max_model_len,
            default=None,
            help="context limit in tokens: 4096, 32k (32000), 32K (32768), auto (default: the model's, "
            "bounded by the KV cache)",
        )
        group.add_argument(
            "--enable-prefix-caching",
            dest="enable_prefix_caching",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="reuse the KV of shared prompt prefixes",
        )
        group.add_argument(
            "--no-prefix-caching", dest="enable_prefix_caching", action="store_false", help=argparse.SUPPRESS
        )
        group.add_argument("--seed", type=int, default=0, help="seed for unseeded sampling")
        group.add_argument(
            "--session-retention-s",
            type=float,
            default=0.0,
            help="keep an agent session's KV pages for this long after each turn, so the next turn (after a "
            "tool call) finds them (0: off; sessions are named by the session headers or previous_response_id)",
        )
        group.add_argument(
            "--session-retention-share",
            type=float,
            default=0.25,
            help="largest share of the KV pages that retained sessions may hold",
        )
        group.add_argument(
            "--session-retention-tenant-share",
            type=float,
            default=0.1,
            help="largest share of the KV pages that one tenant's retained sessions may hold",
        )
        group.add_argument(
            "--num-threads", type=int, default=None, help="torch CPU threads (default: all cores)"
        )
        group.add_argument(
            "--kv-integrity",
            type=_on_off,
            default=True,
            metavar="{on,off}",
            help="check each step's KV page tables against the pages' tags before the model reads them",
        )
        group.add_argument(
            "--kv-integrity-action",
            default="recompute",
            choices=KV_INTEGRITY_ACTIONS,
            help="on a page tag mismatch: recompute the request once (then fail it), or fail it at once",
        )
        group.add_argument(
            "--quantization",
            "-q",
            default="auto",
            type=config_values.quantization,
            metavar="{" + ",".join(QUANTIZATION_CHOICES) + "}",
            help="weights: auto = as the checkpoint's quantization_config says (GPTQ/AWQ/compressed-tensors INT4, "
            "FP8 blocks), else dense; int4 = round-to-nearest INT4 per group at load time",
        )
        parallel = parser.add_argument_group("parallelism (hearth.parallel, hearth.engine.ranks)")
        parallel.add_argument(
            "--tensor-parallel-size",
            "-tp",
            type=int,
            default=1,
            help="ranks that split every layer (by heads)",
        )
        parallel.add_argument(
            "--pipeline-parallel-size",
            "-pp",
            type=int,
            default=1,
            help="pipeline stages (ranks holding consecutive layers)",
        )
        parallel.add_argument(
            "--expert-parallel",
            "--enable-expert-parallel",
            action="store_true",
            help="MoE models: each tensor-parallel rank holds whole experts (a 1/N share of them) instead of a slice of each",
        )
        parallel.add_argument("--nnodes", type=int, default=1, help="hosts the ranks span (as torchrun)")
        parallel.add_argument(
            "--node-rank", type=int, default=0, help="this host's index; node 0 serves the API"
        )
        parallel.add_argument(
            "--master-addr", default="127.0.0.1", help="node 0's address for the rendezvous"
        )
        parallel.add_argument(
            "--master-port",
            type=int,
            default=None,
            help="node 0's rendezvous port (default on one node: a free one)",
        )
        spec = parser.add_argument_group("speculative decoding")
        spec.add_argument(
            "--speculative-method",
            default=None,
            choices=PROPOSERS.names(),
            help="propose tokens for the target to verify: a draft model, prompt lookup (ngram), suffix decoding "
            "over the request and its tenant's earlier answers (suffix; try --num-speculative-tokens 8), or an "
            "EAGLE-3 head",
        )
        spec.add_argument(
            "--speculative-model",
            default=None,
            help="checkpoint directory of the draft model (draft, eagle3)",
        )
        spec.add_argument(
            "--num-speculative-tokens", type=int, default=4, help="most tokens proposed per request and step"
        )
        spec.add_argument(
            "--speculative-max-batch-size",
            type=int,
            default=None,
            help="no speculation in steps with more decode rows than this (it stops paying); "
            "default 8 on CPU, 32 on accelerators",
        )
        spec.add_argument(
            "--speculative-config",
            type=config_values.speculative_config,
            default=None,
            help='vLLM\'s JSON form: {"method": "ngram"|"draft_model"|"eagle3", "model": DIR, '
            '"num_speculative_tokens": N, "prompt_lookup_max": N, "prompt_lookup_min": N}',
        )
        group.add_argument(
            "--kv-offload-memory",
            dest="kv_offload_memory_gib",
            type=float,
            default=0.0,
            help="host RAM for KV pages evicted from the device cache, GiB (0: none)",
        )
        group.add_argument(
            "--kv-disk-dir", default=None, help="directory for a local-disk KV tier (survives restarts)"
        )
        group.add_argument(
            "--kv-disk-size", dest="kv_disk_size_gib", type=float, default=16.0, help="disk KV tier size, GiB"
        )
        group.add_argument(
            "--kv-store",
            default=None,
            help="cluster-shared KV store: redis://host:port[/db] or mooncake://master:port?metadata=URL",
        )
        group.add_argument(
            "--pipeline-micro-batches",
            type=int,
            default=0,
            help="micro-batches a step is cut into so pipeline stages overlap (0: 2 x stages; 1: none)",
        )
        group.add_argument(
            "--pipeline-stage-layers",
            type=lambda text: tuple(int(n) for n in text.split(",")),
            default=None,
            help="layers per pipeline stage, e.g. 30,31 (default: balanced by a cost model measured at start)",
        )

        group.add_argument(
            "--enforce-eager",
            action="store_true",
            help="run every step eagerly: no CUDA graphs for decode steps (they are captured at start on CUDA)",
        )
        group.add_argument(
            "--async-scheduling",
            type=_on_off,
            default=None,
            help="on/off: build the next decode step while the current one runs (default: on with a GPU)",
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
