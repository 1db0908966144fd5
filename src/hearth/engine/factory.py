"""Building an engine from its options: checkpoint, tokenizer, dtype, KV layout and size, model, scheduler.

Everything that decides *what* the engine is happens here, once; `Engine` is only the loop.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from hearth.contracts.kv_ops import KVOps, PeerListen
from hearth.engine.config import EngineConfig
from hearth.engine.engine import Engine
from hearth.engine.kv_budget import resolve_kv_cache_bytes
from hearth.engine.kv_connector import KVConnector, KVOpQueue
from hearth.engine.scheduler import Scheduler
from hearth.engine.speculative import Speculator, build_proposer
from hearth.engine.structured_output import StructuredOutputManager
from hearth.engine.worker import Worker, kv_layout_for
from hearth.kv.faults import KVFaultInjector
from hearth.kv.manager import KVCacheManager
from hearth.kv.pool import KVPool
from hearth.model.config import ModelConfig, ModelLoadError
from hearth.model.device import resolve_dtype
from hearth.model.tokenizer import Tokenizer
from hearth.ops.cpu_capability import log_cpu_capability
from hearth.parallel.topology import ParallelConfig

logger = logging.getLogger("hearth.engine")

GIB = 1 << 30


def plan_pipeline(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype) -> EngineConfig:
    """The config with its pipeline stages' layers balanced by measured cost (`hearth.engine.ranks.pipeline`),
    for a full decode batch cut in micro-batches."""
    from hearth.engine.ranks.microbatch import resolve_micro_batches
    from hearth.engine.ranks.pipeline import plan_stages
    from hearth.engine.worker import resolve_device

    pp = config.pipeline_parallel_size
    micro_batches = resolve_micro_batches(config.pipeline_micro_batches, pp)
    tokens = max(1, min(config.max_num_seqs, config.max_num_batched_tokens) // micro_batches)
    device = resolve_device(config.device)
    if device.type == "cpu":  # measured with the threads a rank will have (its worker sets them again)
        from hearth.engine.ranks.executor import rank_threads

        torch.set_num_threads(rank_threads(config, ParallelConfig.from_engine_config(config)))
    layers, _ = plan_stages(model_config, pp, dtype, device, tokens)
    return dataclasses.replace(config, pipeline_stage_layers=layers)


def build_engine(config: EngineConfig) -> Engine:
    started = time.perf_counter()
    if config.node_rank != 0:
        raise ValueError(
            f"node_rank {config.node_rank}: only node 0 runs the engine; other nodes run their ranks "
            "(`hearth serve --node-rank N ...` or `python -m hearth.engine.ranks.node`)"
        )
    if config.tensor_parallel_size * config.pipeline_parallel_size > 1 and config.master_port is None:
        from hearth.engine.ranks.executor import free_port

        config = dataclasses.replace(config, master_port=free_port())
    parallel = ParallelConfig.from_engine_config(config)
    model_config = ModelConfig.from_dir(config.model)
    tokenizer = Tokenizer.from_dir(config.tokenizer_dir)
    if config.device == "cpu" or not torch.cuda.is_available():
        log_cpu_capability()  # the CPU, its flags and the fast path they pick, once at start
    dtype = resolve_dtype(config.dtype, model_config.checkpoint_dtype)
    if config.pipeline_parallel_size > 1 and config.pipeline_stage_layers is None:
        config = plan_pipeline(config, model_config, dtype)  # decided once here; every rank gets it
    layout = kv_layout_for(config, model_config, dtype)
    from hearth.engine.worker import resolve_device

    try:
        kv_bytes = resolve_kv_cache_bytes(config, resolve_device(config.device).type)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from exc
    num_pages = KVPool.num_pages_for_budget(layout, kv_bytes)
    if num_pages < 2:
        raise ModelLoadError(
            f"a {kv_bytes / GIB:.3g} GiB KV cache holds {num_pages} pages of "
            f"{layout.bytes_per_page} bytes; give the KV cache more memory (--kv-cache-memory GiB)"
        )
    num_kv_tokens = num_pages * config.page_size
    max_model_len = resolve_max_model_len(model_config, config.max_model_len, num_kv_tokens)
    kv = KVCacheManager(num_pages, config.page_size, config.enable_prefix_caching)
    scheduler = Scheduler(kv, config.max_num_batched_tokens, config.max_num_seqs)
    if config.session_retention_s > 0 and config.enable_prefix_caching:
        from hearth.engine.retention import SessionRetention

        scheduler.retention = SessionRetention(
            kv,
            config.session_retention_s,
            max_pages=int(num_pages * config.session_retention_share),
            max_pages_per_tenant=int(num_pages * config.session_retention_tenant_share),
        )
    kv.faults = KVFaultInjector.from_env(config.seed)  # HEARTH_KV_FAULTS (tests); None when unset
    if kv.faults is not None:
        kv.faults.victims = lambda: scheduler.running
        logger.warning("KV fault injection is on: %s", kv.faults.probabilities)
    eos_token_ids = set(tokenizer.eos_token_ids) | set(model_config.eos_token_ids)
    # The embedding may be padded past the tokenizer's ids; those columns are never sampled.
    sample_vocab = min(model_config.vocab_size, tokenizer.vocab_size)
    worker: Worker
    if parallel.is_parallel:
        from hearth.engine.ranks.executor import DistributedExecutor, WorkerSpec

        spec = WorkerSpec(
            config,
            str(dtype).removeprefix("torch."),
            num_pages,
            max_model_len,
            sample_vocab,
            sorted(eos_token_ids),
        )
        worker = DistributedExecutor(config, spec)  # type: ignore[assignment]  # a Worker over every rank
    else:
        worker = Worker(
            config, model_config, dtype, layout, num_pages, max_model_len, sample_vocab, eos_token_ids
        )
    # Pages computed under one parallel layout never serve another (DESIGN "Prefix keys").
    kv_layout_tag = f"{layout.describe()}/{parallel.state_of(0).layout_tag}"
    kv_connectors: list[KVConnector] = []
    kv_ops = KVOpQueue()
    world_size = parallel.world_size
    rank0_kv = worker.kv_worker  # rank 0's worker half, in this process
    if config.kv_tiers_enabled and config.enable_prefix_caching:
        from hearth.engine.kv_connectors.tiers import TierConnector

        assert rank0_kv is not None and rank0_kv.tiers is not None
        tiers = TierConnector(
            kv_ops, config.page_size, world_size, rank0_kv.tier_lookup, rank0_kv.tiers.stats
        )
        kv.on_evict = tiers.on_evict
        kv.lookup = tiers.lookup
        kv_connectors.append(tiers)
    peer = None
    if config.role != "mixed":
        from hearth.engine.kv_connectors.peer import PeerKVConnector

        assert rank0_kv is not None
        peer = PeerKVConnector(kv_ops, kv, config.kv_transfer_timeout_s, world_size, rank0_kv.wakeup_fd)
        kv_connectors.append(peer)
    engine = Engine(
        config=config,
        model_config=model_config,
        tokenizer=tokenizer,
        kv=kv,
        scheduler=scheduler,
        worker=worker,
        structured=StructuredOutputManager(tokenizer, eos_token_ids),
        eos_token_ids=eos_token_ids,
        kv_layout_tag=kv_layout_tag,
        max_model_len=max_model_len,
        num_kv_tokens=num_kv_tokens,
        speculator=build_speculator(
            config, model_config, worker, dtype, num_pages, max_model_len, sample_vocab, eos_token_ids
        ),
        kv_connectors=kv_connectors,
        kv_ops=kv_ops,
    )
    if peer is not None and config.role == "decode":
        engine.kv_transfer_endpoint = listen_on_every_rank(engine, config, parallel)
        logger.info(
            "decode role: KV transfer (%s) listening on %s", config.kv_transfer, engine.kv_transfer_endpoint
        )
    logger.info(
        "KV cache on %s: %d pages x %d tokens = %d tokens held (%.2f GiB, %s, %s layout, %d bytes per token); "
        "max model len %d; ready in %.1f s",
        worker.device,
        num_pages,
        config.page_size,
        num_kv_tokens,
        num_pages * layout.bytes_per_page / GIB,
        str(layout.kv_dtype).removeprefix("torch."),
        layout.kind,
        layout.bytes_per_token,
        max_model_len,
        time.perf_counter() - started,
    )
    return engine


CPU_SPECULATIVE_MAX_BATCH_SIZE = 8


def build_speculator(
    config: EngineConfig,
    model_config: ModelConfig,
    worker: Worker,
    dtype: torch.dtype,
    num_pages: int,
    max_model_len: int,
    sample_vocab_size: int,
    eos_token_ids: set[int],
) -> Speculator | None:
    """The speculative decoder `--speculative-method` asks for (None: off); draft models load here."""
    if config.speculative_method is None:
        return None
    proposer = build_proposer(
        config.speculative_method,
        config=config,
        model_config=model_config,
        target_worker=worker,
        dtype=dtype,
        device=worker.device,
        num_pages=num_pages,
        max_model_len=max_model_len,
        sample_vocab_size=sample_vocab_size,
        eos_token_ids=eos_token_ids,
    )
    logger.info(
        "speculative decoding: %s, up to %d tokens per step",
        config.speculative_method,
        config.num_speculative_tokens,
    )
    max_batch_size = config.speculative_max_batch_size
    if max_batch_size is None:
        max_batch_size = CPU_SPECULATIVE_MAX_BATCH_SIZE if worker.device.type == "cpu" else 32
    return Speculator(proposer, config.num_speculative_tokens, max_batch_size)


def listen_on_every_rank(engine: Engine, config: EngineConfig, parallel: ParallelConfig) -> str:
    """Decode role: every rank's transport listens (one step carries the op; each rank answers with its
    endpoint); prefill servers get them comma-separated, in rank order, with the parallel layout."""
    from hearth.engine.kv_worker import PeerRanks

    step = engine.step_inputs.build([])
    step.kv_ops = KVOps([PeerListen(config.kv_transfer_host, config.kv_transfer_port)], report=True)
    events = engine.worker.execute(step).kv_events
    endpoints = {event.rank: event.detail for event in events if event.kind == "listening"}
    world_size = parallel.world_size
    if sorted(endpoints) != list(range(world_size)):
        raise ModelLoadError(f"KV transfer: only ranks {sorted(endpoints)} of {world_size} are listening")
    return PeerRanks(
        [endpoints[rank] for rank in range(world_size)], parallel.tp_size, parallel.pp_size
    ).describe()


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
