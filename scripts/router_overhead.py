"""Router overhead, side by side: hearth route vs sglang-router vs vllm-router vs no router.

Two fake workers (scripts/router_fake_worker.py, one process each) answer at once. For each
target the script starts the router as its own process, warms it up, then:

1. fixed rate (open loop, `--rate` req/s for `--duration-s`): latency measured from each
   request's scheduled send time, so a stalled router cannot hide its queue;
   added latency = target percentile - direct percentile (same client, same workers);
2. highest rate: `wrk` (closed loop, `--connections`) for `--duration-s`.

Everything shares this machine's cores: the client, the router and the workers. The figures are
ratios taken in one session, not absolute capacity.

    python scripts/router_overhead.py --rate 500 --duration-s 10 --out /tmp/overhead.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).parent.parent
WORKER_PORTS = (18401, 18402)
ROUTER_PORT = 18410
SYSTEM = "You are a careful coding agent. Use the tools when needed. " * 30
PEERS = {
    "sglang": "/tmp/sgl-router-venv/bin/sglang-router",
    "vllm": "/tmp/vllm-router-venv/bin/vllm-router",
}


def body_for(i: int) -> bytes:
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"task {i % 50}: list the files"},
    ]
    return json.dumps({"model": "fake-model", "messages": messages, "max_tokens": 16}).encode()


def router_command(name: str, policy: str) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of a target; `hearth@DIR` runs the `src/` tree under DIR."""
    workers = [f"http://127.0.0.1:{p}" for p in WORKER_PORTS]
    env = dict(os.environ)
    name, _, src = name.partition("@")
    if name == "hearth":
        env["PYTHONPATH"] = str(Path(src) / "src") if src else str(ROOT / "src")
        cmd = [sys.executable, "-m", "hearth.cli", "route", "--port", str(ROUTER_PORT), "--policy", policy]
        for url in workers:
            cmd += ["--worker", url]
        return cmd, env
    peer_policy = "cache_aware" if policy == "default" else policy
    cmd = [PEERS[name]] + (["launch"] if name == "sglang" else [])
    cmd += [
        "--host",
        "127.0.0.1",
        "--port",
        str(ROUTER_PORT),
        "--worker-urls",
        *workers,
        "--policy",
        peer_policy,
    ]
    cmd += ["--prometheus-port", "18411", "--prometheus-host", "127.0.0.1", "--log-level", "error"]
    return cmd, env


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process and its threads, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def warm_up(url: str, num_requests: int = 300) -> None:
    async with aiohttp.ClientSession() as session:
        for i in range(num_requests):
            async with session.post(url, data=body_for(i), headers={"content-type": "application/json"}) as r:
                await r.read()


async def wait_ready(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            try:
                async with session.post(
                    url, data=body_for(0), headers={"content-type": "application/json"}
                ) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise TimeoutError(f"{url} not answering after {timeout_s} s")


def fixed_rate(url: str, rate: float, duration_s: float, body_path: str) -> dict[str, float]:
    """`hey` at `rate` req/s: `rate / 20` workers at 20 req/s each (closed loop per worker)."""
    num_workers = max(1, int(rate // 20))
    cmd = ["hey", "-z", f"{int(duration_s)}s", "-c", str(num_workers), "-q", "20", "-m", "POST"]
    cmd += ["-T", "application/json", "-D", body_path, url]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=duration_s + 60).stdout

    def pct(p: int) -> float:
        return float(re.search(rf"{p}% in ([\d.]+) secs", out).group(1)) * 1000  # type: ignore[union-attr]

    codes = dict((int(c), int(n)) for c, n in re.findall(r"\[(\d+)\]\s+(\d+) responses", out))
    ok = codes.get(200, 0)
    return {
        "achieved_rps": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)),  # type: ignore[union-attr]
        "ok": ok,
        # Non-200 answers plus transport errors (hey's "Error distribution": "  [count]\tPost ...").
        "errors": sum(codes.values())
        - ok
        + sum(int(n) for n in re.findall(r"^\s+\[(\d+)\]\s+Post", out, re.M)),
        "p50_ms": pct(50),
        "p90_ms": pct(90),
        "p99_ms": pct(99),
    }


def max_rate(url: str, duration_s: float, connections: int) -> dict[str, float]:
    body = body_for(1).decode()
    lua = f'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\nwrk.body = [[{body}]]\n'
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(lua)
    out = subprocess.run(
        ["wrk", "-t1", f"-c{connections}", f"-d{int(duration_s)}s", "-s", f.name, "--latency", url],
        capture_output=True,
        text=True,
        timeout=duration_s + 30,
    ).stdout
    os.unlink(f.name)
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    return {"max_rps": rps, "non_2xx": int(non2xx.group(1)) if non2xx else 0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=500.0)
    parser.add_argument("--duration-s", type=float, default=10.0)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument(
        "--targets", default="direct,hearth,sglang,vllm", help="also hearth@DIR: the src/ tree under DIR"
    )
    parser.add_argument(
        "--policy", default="default", help="hearth's policy (peers get cache_aware for default)"
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    fake = [sys.executable, str(ROOT / "scripts" / "router_fake_worker.py")]
    workers = [
        subprocess.Popen(fake + ["--port", str(p)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for p in WORKER_PORTS
    ]
    results: dict[str, dict[str, float]] = {}
    body_path = str(Path(tempfile.gettempdir()) / "router_overhead_body.json")
    Path(body_path).write_bytes(body_for(1))
    try:
        direct_urls = [f"http://127.0.0.1:{p}/v1/chat/completions" for p in WORKER_PORTS]
        for url in direct_urls:
            asyncio.run(wait_ready(url))
        for target in args.targets.split(","):
            router = None
            urls = direct_urls
            if target != "direct":
                if target in PEERS and not Path(PEERS[target]).exists():
                    print(f"{target}: not installed at {PEERS[target]}, skipped", flush=True)
                    continue
                cmd, env = router_command(target, args.policy)
                router = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                urls = [f"http://127.0.0.1:{ROUTER_PORT}/v1/chat/completions"]
                asyncio.run(wait_ready(urls[0]))
            try:
                asyncio.run(warm_up(urls[0]))
                cpu_before_s = cpu_seconds(router.pid) if router is not None else 0.0
                result = fixed_rate(urls[0], args.rate, args.duration_s, body_path)
                if router is not None:
                    # CPU per request is the contention-proof figure: what the router itself burns.
                    result["cpu_ms_per_request"] = (
                        (cpu_seconds(router.pid) - cpu_before_s) * 1000 / result["ok"]
                    )
                result.update(max_rate(urls[0], args.duration_s, args.connections))
                results[target] = result
                print(target, json.dumps({k: round(v, 3) for k, v in result.items()}), flush=True)
            finally:
                if router is not None:
                    router.terminate()
                    router.wait(timeout=10)
                    time.sleep(1.0)
    finally:
        for w in workers:
            w.terminate()
            w.wait(timeout=10)
    direct = results.get("direct")
    print(
        f"\nfixed rate {args.rate:.0f} req/s for {args.duration_s:.0f} s; max rate: wrk -t1 -c{args.connections}"
    )
    print(
        "| target | p50 (ms) | p99 (ms) | added p50 (ms) | added p99 (ms) | errors | router CPU ms/req | max req/s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        added50 = r["p50_ms"] - direct["p50_ms"] if direct else float("nan")
        added99 = r["p99_ms"] - direct["p99_ms"] if direct else float("nan")
        print(
            f"| {name} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {added50:.2f} | {added99:.2f} "
            f"| {r['errors']:.0f} | {r.get('cpu_ms_per_request', 0.0):.3f} | {r['max_rps']:.0f} |"
        )
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
