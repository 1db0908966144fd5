"""Router CPU per request, A/B: the figure that CPU contention barely moves.

Starts one fake worker process, then each target router as its own process in turn (several
rounds, interleaved, so a change in machine load hits every target alike), drives it with
`hey -n N -c C` (closed loop) and reads the router's user+system CPU from /proc.

Targets: `hearth` (this checkout), `hearth@DIR` (the `src/` tree under DIR, e.g. a copy of an
older version), `sglang`, `vllm` (peers, see docs/bench/router.md), `direct` (no router).

    python scripts/router_cpu.py --targets hearth@/tmp/router_before,hearth,sglang --rounds 3
    python scripts/router_cpu.py --targets hearth --profile /tmp/router.svg   # py-spy flame graph
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from router_overhead import PEERS, body_for, cpu_seconds, wait_ready  # noqa: E402

ROOT = Path(__file__).parent.parent
WORKER_PORT = 18431
ROUTER_PORT = 18432
PEER_METRICS_PORT = 18433


def router_command(target: str, policy: str) -> tuple[list[str], dict[str, str]]:
    worker = f"http://127.0.0.1:{WORKER_PORT}"
    env = dict(os.environ)
    name, _, src = target.partition("@")
    if name == "hearth":
        env["PYTHONPATH"] = str(Path(src) / "src") if src else str(ROOT / "src")
        cmd = [sys.executable, "-m", "hearth.cli", "route", "--port", str(ROUTER_PORT), "--worker", worker]
        return cmd + ["--policy", policy], env
    cmd = [PEERS[name]] + (["launch"] if name == "sglang" else [])
    cmd += ["--host", "127.0.0.1", "--port", str(ROUTER_PORT), "--worker-urls", worker]
    cmd += ["--policy", "cache_aware", "--prometheus-port", str(PEER_METRICS_PORT)]
    cmd += ["--prometheus-host", "127.0.0.1", "--log-level", "error"]
    return cmd, env


def hey(url: str, num_requests: int, connections: int, body_path: str) -> dict[str, float]:
    cmd = ["hey", "-n", str(num_requests), "-c", str(connections), "-m", "POST", "-T", "application/json"]
    out = subprocess.run(cmd + ["-D", body_path, url], capture_output=True, text=True, timeout=300).stdout

    def pct(p: int) -> float:
        return float(re.search(rf"{p}% in ([\d.]+) secs", out).group(1)) * 1000  # type: ignore[union-attr]

    ok = sum(int(n) for c, n in re.findall(r"\[(\d+)\]\s+(\d+) responses", out) if c == "200")
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    return {"ok": ok, "rps": rps, "p50_ms": pct(50), "p99_ms": pct(99)}


def measure(target: str, args: argparse.Namespace, body_path: str) -> dict[str, float]:
    url = f"http://127.0.0.1:{WORKER_PORT if target == 'direct' else ROUTER_PORT}/v1/chat/completions"
    router = None
    if target != "direct":
        cmd, env = router_command(target, args.policy)
        router = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    spy = None
    try:
        asyncio.run(wait_ready(url))
        hey(url, 500, args.connections, body_path)  # warm up
        if router is not None and args.profile:
            spy_cmd = [str(Path(sys.executable).parent / "py-spy"), "record", "-p", str(router.pid)]
            spy_cmd += ["-o", args.profile, "-r", "500", "--nonblocking"]
            if args.profile.endswith(".txt"):
                spy_cmd += ["-f", "raw"]
            spy = subprocess.Popen(spy_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)
        cpu_before_s = cpu_seconds(router.pid) if router is not None else 0.0
        result = hey(url, args.requests, args.connections, body_path)
        if router is not None:
            result["cpu_ms_per_request"] = (cpu_seconds(router.pid) - cpu_before_s) * 1000 / result["ok"]
        return result
    finally:
        if spy is not None:
            spy.send_signal(2)
            spy.wait(timeout=30)
        if router is not None:
            router.terminate()
            router.wait(timeout=10)
            time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default="hearth,sglang")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--policy", default="default")
    parser.add_argument("--profile", default=None, help="py-spy output for the (single) hearth target")
    args = parser.parse_args()
    body_path = "/tmp/router_cpu_body.json"
    Path(body_path).write_bytes(body_for(1))
    fake = [sys.executable, str(ROOT / "scripts" / "router_fake_worker.py"), "--port", str(WORKER_PORT)]
    worker = subprocess.Popen(fake, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    results: dict[str, list[dict[str, float]]] = {}
    try:
        targets = args.targets.split(",")
        for round_index in range(args.rounds):
            for target in targets:
                result = measure(target, args, body_path)
                results.setdefault(target, []).append(result)
                shown = " ".join(f"{k}={v:.3f}" for k, v in result.items())
                print(f"round {round_index} {target}: {shown}", flush=True)
    finally:
        worker.terminate()
        worker.wait(timeout=10)
    print(f"\nhey -n {args.requests} -c {args.connections}, {args.rounds} rounds; median over rounds")
    print("| target | router CPU ms/req | p50 (ms) | p99 (ms) | req/s |")
    print("|---|---|---|---|---|")
    for target, runs in results.items():

        def median(key: str, runs: list[dict[str, float]] = runs) -> float:
            values = sorted(r.get(key, 0.0) for r in runs)
            return values[len(values) // 2]

        print(
            f"| {target} | {median('cpu_ms_per_request'):.3f} | {median('p50_ms'):.2f} "
            f"| {median('p99_ms'):.2f} | {median('rps'):.0f} |"
        )


if __name__ == "__main__":
    main()
