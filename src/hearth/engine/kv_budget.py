"""How many bytes the KV cache gets when `--kv-cache-memory` is not given.

GPU (vLLM's rule): this server may use `gpu_memory_utilization` of the device's memory in all; the KV cache
gets what is left of that share after what the device already holds (other processes, the CUDA context),
this rank's weights, and a reserve for activations.

CPU: `$VLLM_CPU_KVCACHE_SPACE` GiB (vLLM's CPU backend option), else 1 GiB; `--gpu-memory-utilization`
given explicitly caps weights + KV cache at that share of the host memory available at start.
"""

from __future__ import annotations

import os
from pathlib import Path

from hearth.engine.config import EngineConfig

GIB = 1 << 30
CPU_DEFAULT_KV_BYTES = GIB
# Activations, logits and the allocator's slack on a GPU, beyond what the weights and the KV cache take.
GPU_ACTIVATION_RESERVE_BYTES = 2 * GIB


def checkpoint_bytes(model_dir: str) -> int:
    """The weight files' size: what loading the checkpoint puts in memory (at most; INT4 at load shrinks it)."""
    root = Path(model_dir)
    if root.is_file():
        return root.stat().st_size
    return sum(
        path.stat().st_size for pattern in ("*.safetensors", "*.bin", "*.gguf") for path in root.glob(pattern)
    )


def host_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def gpu_kv_bytes(
    utilization: float, free_bytes: int, total_bytes: int, weight_bytes: int, reserve_bytes: int
) -> int:
    """The KV share on a device: `utilization x total`, less what others hold, the weights and the reserve."""
    in_use_bytes = total_bytes - free_bytes
    return int(utilization * total_bytes) - in_use_bytes - weight_bytes - reserve_bytes


def cpu_kv_bytes(utilization: float | None, available_bytes: int, weight_bytes: int) -> int:
    space = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    kv_bytes = int(float(space) * GIB) if space not in (None, "", "0") else CPU_DEFAULT_KV_BYTES
    if utilization is not None:
        kv_bytes = min(kv_bytes, int(utilization * available_bytes) - weight_bytes)
    return kv_bytes


GPU_DEFAULT_UTILIZATION = 0.9


def resolve_kv_cache_bytes(config: EngineConfig, device_type: str) -> int:
    """The KV cache's bytes on one rank; raises ValueError naming the option when nothing is left."""
    if config.kv_cache_memory_gib is not None:
        return int(config.kv_cache_memory_gib * GIB)
    ranks = config.tensor_parallel_size * config.pipeline_parallel_size
    weight_bytes = checkpoint_bytes(config.model) // ranks
    if config.speculative_model:
        weight_bytes += checkpoint_bytes(config.speculative_model)
    if device_type == "cuda":
        import torch

        free_bytes, total_bytes = torch.cuda.mem_get_info()
        utilization = config.gpu_memory_utilization or GPU_DEFAULT_UTILIZATION
        kv_bytes = gpu_kv_bytes(
            utilization, free_bytes, total_bytes, weight_bytes, GPU_ACTIVATION_RESERVE_BYTES
        )
        if kv_bytes <= 0:
            raise ValueError(
                f"--gpu-memory-utilization {utilization} leaves no room for the KV cache "
                f"({(total_bytes - free_bytes) / GIB:.1f} GiB of {total_bytes / GIB:.1f} GiB already in use, "
                f"weights {weight_bytes / GIB:.1f} GiB); raise it or pass --kv-cache-memory GiB"
            )
        return kv_bytes
    kv_bytes = cpu_kv_bytes(config.gpu_memory_utilization, host_available_bytes(), weight_bytes)
    if kv_bytes <= 0:
        raise ValueError(
            f"--gpu-memory-utilization {config.gpu_memory_utilization} of the host's available memory does not "
            "hold the weights and a KV cache; raise it or pass --kv-cache-memory GiB"
        )
    return kv_bytes
