"""`hearth route`: the router in front of pools of Hearth (or other OpenAI-compatible) servers."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal
from typing import TYPE_CHECKING

from hearth.contracts.cli_common import (
    ADMIN_KEY_ENV,
    ADMIN_KEY_FILE_ENV,
    KV_TRANSFER_SECRET_ENV,
    KV_TRANSFER_SECRET_FILE_ENV,
    add_admin_key_arguments,
    add_kv_transfer_secret_arguments,
    add_listen_arguments,
    add_log_level_argument,
    add_page_size_argument,
)
from hearth.kv_transfer.auth import read_secret
from hearth.router.config import RouterConfig
from hearth.router.pd import PD_ADAPTERS
from hearth.router.policies import POLICIES, BalanceConfig
from hearth.router.workers import WorkerPool

if TYPE_CHECKING:
    from hearth.router.app import Router


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_listen_arguments(parser)
    parser.add_argument(
        "--worker", action="append", default=[], metavar="URL", help="a mixed server (repeat)"
    )
    parser.add_argument(
        "--worker-urls",
        action="extend",
        nargs="+",
        default=[],
        metavar="URL",
        help="mixed servers, several after one flag, as sglang-router and vllm-router take them",
    )
    parser.add_argument(
        "--prefill",
        action="append",
        nargs="+",
        default=[],
        metavar="URL [BOOTSTRAP_PORT]",
        help="a prefill server, with SGLang's bootstrap port when --pd-protocol sglang (repeat)",
    )
    parser.add_argument(
        "--decode", action="append", default=[], metavar="URL", help="a decode server (repeat)"
    )
    parser.add_argument("--policy", default="default", choices=POLICIES.names())
    parser.add_argument("--pd-protocol", default="hearth", choices=PD_ADAPTERS.names())
    add_admin_key_arguments(parser)
    add_kv_transfer_secret_arguments(parser, "signs Hearth PD instructions")
    parser.add_argument("--tokenizer", default=None, metavar="DIR", help="directory with tokenizer.json")
    parser.add_argument(
        "--model-id", default="hearth", help="salt of the prefix keys when --tokenizer is given"
    )
    add_page_size_argument(parser, "tokens per prefix-index block (the servers' --page-size)")
    parser.add_argument("--prefix-index-blocks", type=int, default=65536, help="blocks remembered per worker")
    parser.add_argument("--balance-rel", type=float, default=1.5, help="overloaded above this x mean load")
    parser.add_argument(
        "--balance-abs-tokens", type=int, default=8192, help="...and this many tokens above the least loaded"
    )
    parser.add_argument("--min-prefix-match-tokens", type=int, default=256)
    parser.add_argument("--health-interval-s", type=float, default=0.5)
    parser.add_argument("--health-timeout-s", type=float, default=1.0)
    parser.add_argument("--read-timeout-s", type=float, default=600.0, help="longest silence from a worker")
    add_log_level_argument(parser, default="warning")


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """Raises ValueError (MissingSecretError) when a secret file cannot be read."""
    admin_key = args.admin_key or read_secret(ADMIN_KEY_ENV, ADMIN_KEY_FILE_ENV, args.admin_key_file)
    kv_secret = read_secret(
        KV_TRANSFER_SECRET_ENV, KV_TRANSFER_SECRET_FILE_ENV, getattr(args, "kv_transfer_secret_file", None)
    )
    return RouterConfig(
        host=args.host,
        port=args.port,
        policy=args.policy,
        pd_protocol=args.pd_protocol,
        balance=BalanceConfig(
            rel=args.balance_rel,
            abs_tokens=args.balance_abs_tokens,
            min_prefix_match_tokens=args.min_prefix_match_tokens,
        ),
        health_interval_s=args.health_interval_s,
        health_timeout_s=args.health_timeout_s,
        read_timeout_s=args.read_timeout_s,
        admin_key=admin_key or None,
        kv_transfer_secret=kv_secret.encode() if kv_secret else None,
        tokenizer_dir=args.tokenizer,
        model_id=args.model_id,
        page_size=args.page_size,
        prefix_index_blocks=args.prefix_index_blocks,
    )


def pool_from_args(args: argparse.Namespace) -> WorkerPool:
    pool = WorkerPool(prefix_blocks=args.prefix_index_blocks)
    for url in [*args.worker, *args.worker_urls]:
        pool.add(url, "mixed")
    for entry in args.prefill:
        if len(entry) > 2:
            raise ValueError(f"--prefill takes URL [BOOTSTRAP_PORT], got {entry}")
        pool.add(entry[0], "prefill", int(entry[1]) if len(entry) == 2 else None)
    for url in args.decode:
        pool.add(url, "decode")
    if bool(args.prefill) != bool(args.decode):
        raise ValueError("PD mode needs both --prefill and --decode servers")
    return pool


def run(args: argparse.Namespace) -> int:
    from hearth.router.app import Router

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = config_from_args(args)
        pool = pool_from_args(args)
        if config.pd_protocol == "sglang" and any(
            w.role == "prefill" and w.bootstrap_port is None for w in pool.workers.values()
        ):
            raise ValueError("--pd-protocol sglang needs each prefill as --prefill URL BOOTSTRAP_PORT")
        if config.pd_protocol == "hearth" and args.prefill and config.kv_transfer_secret is None:
            raise ValueError(
                "Hearth prefill/decode pools need the deployment's KV transfer secret (the router signs each "
                f"transfer instruction with it): --kv-transfer-secret-file FILE, ${KV_TRANSFER_SECRET_FILE_ENV} or "
                f"${KV_TRANSFER_SECRET_ENV}, the same as the servers'"
            )
        router = Router(config, pool)
    except (ValueError, FileNotFoundError) as exc:
        print(f"hearth route: {exc}")
        return 2
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass  # the default loop works; uvloop only trims latency
    try:
        asyncio.run(_serve(router, config, len(pool.workers)))
    except OSError as exc:
        print(f"hearth route: cannot listen on {config.host}:{config.port}: {exc}")
        return 1
    return 0


async def _serve(router: Router, config: RouterConfig, num_workers: int) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await router.serve(config.host, config.port)
        # Everything alive now (modules, the app) lives as long as the process: keep it out of
        # the collector's full passes, which otherwise walk it all and show up as p99 spikes.
        gc.collect()
        gc.freeze()
        print(
            f"hearth route: listening on http://{config.host}:{config.port} "
            f"({num_workers} workers, policy {config.policy})",
            flush=True,
        )
        await stop.wait()
    finally:
        await router.close()
