"""Agentic multi-turn hit ratios with KV tiers, through `hearth serve` and `hearth bench serve --workload agentic`.

Runs, one after another on the same seeded workload (greedy answers, so every run sends the same turns):
- `unbounded`: one server, a device pool far larger than the workload, plus a disk tier only to count the
  working set (its write-through holds every page ever cached: `hearth_kv_tier_stored_pages{tier="disk"}`);
- `small`: device pool = working set / 4, no tiers;
- `small+host+disk`: the same pool, host RAM of another quarter of the working set, and a disk tier;
- `affinity`: two servers behind `hearth route --policy session_affinity` (every session sends
  x-session-affinity), no store;
- `round_robin+redis`: two servers behind `--policy round_robin`, both on one Redis.
Prints the cache hit ratios and the two goal ratios, and writes them as JSON.

    PYTHONPATH=src python scripts/bench_kv_tiers_agentic.py --out bench-results/kv-tiers-agentic.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from hearth.engine.config import EngineConfig
from hearth.engine.worker import kv_layout_for
from hearth.model.config import ModelConfig
from hearth.model.device import resolve_dtype
from hearth.server.process import ServerProcess

GIB = 1 << 30


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def page_bytes(model: str) -> tuple[int, int]:
    config = EngineConfig(model=model, device="cpu")
    model_config = ModelConfig.from_dir(model)
    layout = kv_layout_for(config, model_config, resolve_dtype("auto", model_config.checkpoint_dtype))
    return layout.bytes_per_page, layout.page_size


def metric(url: str, name: str, labels: str = "") -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    match = re.search(rf"^hearth_{name}\{{[^}}]*{labels}[^}}]*\}} ([0-9.e+-]+)$", text, re.M)
    return float(match.group(1)) if match else float("nan")


LIVE: list[ServerProcess] = []  # stopped on the way out, whatever happens


def start_servers(args, work: Path, count: int, extra: list[str]) -> list[ServerProcess]:
    servers = []
    for index in range(count):
        base = ["--model", args.model, "--device", "cpu", "--num-threads", str(args.threads)]
        server = ServerProcess(base + extra, work / f"server-{len(list(work.glob('server-*')))}-{index}.log")
        servers.append(server.start())
        LIVE.append(server)
    for server in servers:
        server.wait_ready(timeout_s=900)  # a loaded shared machine can take minutes
    return servers


def run_bench(args, url: str, label: str, work: Path, affinity_share: float) -> dict:
    command = [
        sys.executable, "-m", "hearth.cli", "bench", "serve", "--base-url", url, "--model", Path(args.model).name, "--workload", "agentic",
        "--tokenizer", args.model, "--num-sessions", str(args.sessions), "--turns", str(args.turns),
        "--system-prompt-len", str(args.system_prompt_len), "--num-tools", "2", "--tool-description-len", "40",
        "--user-turn-len", str(args.user_turn_len), "--tool-result-len", str(args.tool_result_len),
        "--agentic-output-len", str(args.output_len), "--think-time-s", str(args.think_time_s),
        "--affinity-share", str(affinity_share), "--max-concurrency", str(args.concurrency),
        "--temperature", "0", "--seed", "7", "--result-dir", str(work / "results"), "--label", label,
        "--no-plots", "--no-progress",
    ]  # fmt: skip
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    result = json.loads((work / "results" / f"{label}.json").read_text())
    return {
        "cache_hit_ratio": result["cache_hit_ratio"],
        "completed": result["completed"],
        "failed": result["failed"],
    }


def one_server_runs(args, work: Path, results: dict, bytes_per_page: int, page_size: int) -> None:
    (server,) = start_servers(
        args, work, 1, ["--kv-cache-memory", "0.25", "--kv-disk-dir", str(work / "count")]
    )
    results["unbounded"] = run_bench(args, server.url, "unbounded", work, 0.0)
    time.sleep(1.0)  # the write-through settles
    ws_pages = int(metric(server.url, "kv_tier_stored_pages", 'tier="disk"'))
    server.stop()
    quarter_gib = max(ws_pages // 4, 1) * bytes_per_page / GIB
    results["working_set"] = {
        "pages": ws_pages,
        "tokens": ws_pages * page_size,
        "device_pool_pages": ws_pages // 4,
    }

    (server,) = start_servers(args, work, 1, ["--kv-cache-memory", f"{quarter_gib:.9f}"])
    results["small"] = run_bench(args, server.url, "small", work, 0.0)
    server.stop()

    tiers = [
        "--kv-offload-memory",
        f"{quarter_gib:.9f}",
        "--kv-disk-dir",
        str(work / "disk"),
        "--kv-disk-size",
        "1",
    ]
    (server,) = start_servers(args, work, 1, ["--kv-cache-memory", f"{quarter_gib:.9f}", *tiers])
    results["small+host+disk"] = run_bench(args, server.url, "small-tiers", work, 0.0)
    results["small+host+disk"]["hits"] = {
        tier: metric(server.url, "kv_tier_hit_pages_total", f'tier="{tier}"') for tier in ("host", "disk")
    }
    server.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="models/demo")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-prompt-len", type=int, default=200)
    parser.add_argument("--user-turn-len", type=int, default=60)
    parser.add_argument("--tool-result-len", type=int, default=120)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--think-time-s", type=float, default=0.5)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--out", default="bench-results/kv-tiers-agentic.json")
    parser.add_argument(
        "--only-two-servers", action="store_true", help="just the affinity and round_robin+redis runs"
    )
    args = parser.parse_args()
    # A shared store's pages carry MACs under the deployment secret (hearth.kv.tiers.blob_auth).
    os.environ.setdefault("HEARTH_KV_TRANSFER_SECRET", secrets.token_hex(16))
    work = Path(tempfile.mkdtemp(prefix="hearth-kv-agentic-"))
    bytes_per_page, page_size = page_bytes(args.model)
    results: dict[str, dict] = {}
    redis_process = None
    try:
        (server,) = start_servers(
            args, work, 1, ["--kv-cache-memory", "0.25", "--kv-disk-dir", str(work / "count")]
        )
        redis_port = free_port()
        redis_process = subprocess.Popen(
            [shutil.which("redis-server") or "redis-server", "--port", str(redis_port), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)  # fmt: skip
        for policy, label, extra, share in (
            ("session_affinity", "affinity", [], 1.0),
            ("round_robin", "round_robin+redis", ["--kv-store", f"redis://127.0.0.1:{redis_port}"], 0.0),
        ):
            servers = start_servers(args, work, 2, ["--kv-cache-memory", "0.25", *extra])
            port = free_port()
            route_cmd = [sys.executable, "-m", "hearth.cli", "route", "--host", "127.0.0.1", "--port", str(port),
                         "--policy", policy]  # fmt: skip
            for s in servers:
                route_cmd += ["--worker", s.url]
            router = subprocess.Popen(
                route_cmd, stdout=open(work / f"router-{label}.log", "wb"), stderr=subprocess.STDOUT
            )
            url = f"http://127.0.0.1:{port}"
            for _ in range(300):
                try:
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
            results[label] = run_bench(args, url, label.replace("+", "-"), work, share)
            router.terminate()
            router.wait(timeout=30)
            for s in servers:
                s.stop()
    finally:
        for server in LIVE:
            server.stop()
        if redis_process is not None:
            redis_process.kill()
    if "unbounded" in results:
        results["goal_tiers_vs_unbounded"] = (
            results["small+host+disk"]["cache_hit_ratio"] / results["unbounded"]["cache_hit_ratio"]
        )
    results["goal_rr_redis_vs_affinity"] = (
        results["round_robin+redis"]["cache_hit_ratio"] / results["affinity"]["cache_hit_ratio"]
    )
    results["args"] = vars(args)
    print(json.dumps(results, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
