"""Building an engine from its options: checkpoint, tokenizer, dtype, KV layout and size, model, scheduler.

Everything that decides *what* the engine is happens here, once; `Engine` is only the loop.
"""

from __future__ import annotations

import logging
import time

import torch

from hearth.engine.config import EngineConfig
from hearth.engine.engine import Engine
from hearth.engine.runner import ModelRunner
from hearth.engine.sampler import Sampler
from hearth.engine.scheduler import Scheduler
from hearth.engine.structured_output import StructuredOutputManager
from hearth.kv.manager import KVCacheManager
from hearth.kv.pool import KVLayout, KVPool
from hearth.model.config import ModelConfig, ModelLoadError
from hearth.model.device import resolve_dtype
from hearth.model.loader import load_model
from hearth.model.tokenizer import Tokenizer
from hearth.ops import cpu_kernels

logger = logging.getLogger("hearth.engine")

GIB = 1 << 30


def build_engine(config: EngineConfig) -> Engine:
    started = time.perf_counter()
    torch.set_num_threads(config.resolved_num_threads)
    model_config = ModelConfig.from_dir(config.model)
    tokenizer = Tokenizer.from_dir(config.model)
    dtype = resolve_dtype(config.dtype, model_config.checkpoint_dtype)
    layout = KVLayout(
        num_layers=model_config.num_layers,
        num_kv_heads=model_config.num_kv_heads,
        head_dim=model_config.head_dim,
        page_size=config.page_size,
        dtype=dtype,
    )
    num_pages = KVPool.num_pages_for_budget(layout, int(config.kv_cache_memory_gib * GIB))
    if num_pages < 2:
        raise ModelLoadError(
            f"--kv-cache-memory {config.kv_cache_memory_gib} GiB holds {num_pages} pages of "
            f"{layout.bytes_per_page} bytes; give the KV cache more memory"
        )
    num_kv_tokens = num_pages * config.page_size
    max_model_len = resolve_max_model_len(model_config, config.max_model_len, num_kv_tokens)
    model = load_model(config.model, model_config, dtype, max_model_len + 1, progress=config.load_progress)
    pool = KVPool(layout, num_pages)
    kv = KVCacheManager(num_pages, config.page_size, config.enable_prefix_caching)
    eos_token_ids = set(tokenizer.eos_token_ids) | set(model_config.eos_token_ids)
    # The embedding may be padded past the tokenizer's ids; those columns are never sampled.
    sample_vocab = min(model_config.vocab_size, tokenizer.vocab_size)
    torch.manual_seed(config.seed)
    engine = Engine(
        config=config,
        model_config=model_config,
        tokenizer=tokenizer,
        kv=kv,
        scheduler=Scheduler(kv, config.max_num_batched_tokens, config.max_num_seqs),
        runner=ModelRunner(model, pool, model_config.sliding_window),
        sampler=Sampler(sample_vocab, eos_token_ids),
        structured=StructuredOutputManager(tokenizer, eos_token_ids),
        eos_token_ids=eos_token_ids,
        kv_layout_tag=layout.describe(),
        max_model_len=max_model_len,
        num_kv_tokens=num_kv_tokens,
        dtype=dtype,
    )
    # Compiled CPU attention, loaded (or built, the first time) in the background once the model is
    # in place, so it never delays readiness; the torch path serves until it is there.
    cpu_kernels.start_build()
    logger.info(
        "KV cache: %d pages x %d tokens = %d tokens (%.2f GiB, %s); max model len %d; ready in %.1f s",
        num_pages,
        config.page_size,
        num_kv_tokens,
        num_pages * layout.bytes_per_page / GIB,
        str(dtype).removeprefix("torch."),
        max_model_len,
        time.perf_counter() - started,
    )
    return engine


def resolve_max_model_len(model_config: ModelConfig, requested: int | None, num_kv_tokens: int) -> int:
    """The context limit: the model's positions (stretched by rope scaling), `--max-model-len`, and the KV cache."""
    limit = model_config.max_position_embeddings
    if model_config.rope_scaling.get("rope_type") in ("yarn", "dynamic", "linear", "llama3"):
        factor = float(model_config.rope_scaling.get("factor", 1.0))
        original = model_config.rope_scaling.get("original_max_position_embeddings", limit)
        limit = max(limit, int(original * factor))
    if requested is not None:
        if requested > limit:
            raise ModelLoadError(f"--max-model-len {requested} exceeds the model's {limit} positions")
        limit = requested
    return min(limit, num_kv_tokens)
