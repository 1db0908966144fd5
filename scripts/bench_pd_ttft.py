"""TTFT added by prefill/decode disaggregation, with where the added time goes.

    python scripts/bench_pd_ttft.py [--lengths 256 2048 8192] [--repeats 7] [--model DIR]

Starts two deployments with `hearth launch` on this machine (or uses `--a`/`--b` URLs given):
  A: `--mixed 1` (one mixed server behind the router),
  B: `--prefill 1 --decode 1` (behind the router),
and measures, interleaved in every repetition (the order rotating, so a noisy machine hits all alike):
  mixed        TTFT through A's router;
  pd           TTFT through B's router;
  mixed_direct TTFT from A's server directly (the router hop is `mixed - mixed_direct`);
  pd_direct    B's two servers asked directly, at once, as the router does: `pd_direct` is the decode
               server's TTFT and `prefill_answer` when the prefill server's JSON answer came (it answers
               once its KV is sent), so `pd_direct - prefill_answer` is what the decode server adds after
               the KV has landed (its wakeup, the last prompt token, the first sample, the stream).
Each prompt is fresh random token ids (no prefix-cache hit anywhere); TTFT is from sending a streamed
completion to its first content chunk. Without `--model`, a random-weight Qwen3-shaped model (4 layers,
hidden 256, 8 heads / 2 KV heads, 16k positions, float32) is written to a temporary directory with
`tests/tiny_models.make_tiny_model`. Prints one JSON line per length with medians and every sample.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

SERVER_ARGS = "--max-model-len 9000 --kv-cache-memory 0.5 --page-size 16"


class Deployment:
    """`hearth launch ...` as a child; its URLs from the ready line."""

    def __init__(
        self,
        name: str,
        model: str,
        roles: list[str],
        port: int,
        log_dir: Path,
        server_args: str = SERVER_ARGS,
    ) -> None:
        command = [sys.executable, "-m", "hearth.cli", "launch", "--model", model, *roles]
        command += ["--port", str(port), "--server-args", server_args, "--ready-timeout", "900"]
        command += ["--decode-args", "--kv-transfer-timeout 120"]
        self.log_path = log_dir / f"{name}.log"
        self._log = self.log_path.open("w")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        self.ready = threading.Event()
        self.urls: dict[str, str] = {}
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._log.write(line)
            found = re.search(r"ready at (\S+) \((.*)\)", line)
            if found:
                self.urls["router"] = found.group(1)
                for name, url in re.findall(r"(\w+)-0 (http://\S+?)(?:,|$)", found.group(2)):
                    self.urls[name] = url
                self.ready.set()
        self._log.flush()

    def wait(self, timeout_s: float = 900) -> dict[str, str]:
        deadline = time.monotonic() + timeout_s
        while not self.ready.wait(1):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"deployment did not start; see {self.log_path}")
        return self.urls

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(120)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


def body_for(prompt: list[int]) -> dict:
    return {"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True, "stream": True}


async def ttft_s(client: httpx.AsyncClient, url: str, body: dict, started: float) -> float:
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        elapsed = None
        async for line in response.aiter_lines():  # read to the end, so the request ends before the next
            if elapsed is None and line.startswith("data: ") and '"text"' in line:
                elapsed = time.perf_counter() - started
        if elapsed is not None:
            return elapsed
    raise RuntimeError("no token came back")


async def pd_direct(
    client: httpx.AsyncClient, prefill: str, decode: str, prompt: list[int]
) -> tuple[float, float]:
    """(decode TTFT, prefill answer time), both servers asked at once as the router does."""
    transfer_id = f"bench-{random.getrandbits(64):016x}"
    decode_body = {
        **body_for(prompt),
        "kv_transfer": {"role": "decode", "transfer_id": transfer_id, "prefill_url": prefill},
    }
    prefill_body = {
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0,
        "kv_transfer": {"role": "prefill", "transfer_id": transfer_id, "decode_url": decode},
    }
    started = time.perf_counter()

    async def prefill_answer() -> float:
        response = await client.post(prefill + "/v1/completions", json=prefill_body)
        response.raise_for_status()
        assert response.json()["kv_transfer"]["status"] == "sent", response.text
        return time.perf_counter() - started

    decode_s, prefill_s = await asyncio.gather(ttft_s(client, decode, decode_body, started), prefill_answer())
    return decode_s, prefill_s


async def measure(args: argparse.Namespace, urls: dict[str, dict[str, str]]) -> None:
    rng = random.Random(0)
    a, b = urls["a"], urls["b"]
    sides = ["mixed", "pd", "mixed_direct", "pd_direct"] if "prefill" in b else ["mixed", "pd"]

    async def one(
        client: httpx.AsyncClient, side: str, prompt: list[int], out: dict[str, list[float]]
    ) -> None:
        if side == "pd_direct":
            decode_s, prefill_s = await pd_direct(client, b["prefill"], b["decode"], prompt)
            out["pd_direct"].append(decode_s)
            out["prefill_answer"].append(prefill_s)
            return
        url = {"mixed": a["router"], "pd": b["router"], "mixed_direct": a.get("mixed", "")}[side]
        out[side].append(await ttft_s(client, url, body_for(prompt), time.perf_counter()))

    async with httpx.AsyncClient(timeout=900) as client:
        warm: dict[str, list[float]] = {side: [] for side in (*sides, "prefill_answer")}
        for side in sides:  # warm up every path (connections, first-step costs)
            await one(client, side, [rng.randrange(3, args.vocab) for _ in range(64)], warm)
        for length in args.lengths:
            times: dict[str, list[float]] = {side: [] for side in (*sides, "prefill_answer")}
            load = []
            for repeat in range(args.repeats):
                order = sides[repeat % len(sides) :] + sides[: repeat % len(sides)]
                for side in order:
                    await one(client, side, [rng.randrange(3, args.vocab) for _ in range(length)], times)
                load.append(os.getloadavg()[0])
            median = {side: statistics.median(values) for side, values in times.items() if values}
            result: dict[str, object] = {"prompt_tokens": length, "repeats": args.repeats}
            result.update({f"{side}_ttft_ms": round(value * 1000, 1) for side, value in median.items()})
            result["pd_added_pct"] = round((median["pd"] / median["mixed"] - 1) * 100, 1)
            # per repetition (same moment, same load): the ratio's median is steadier than medians' ratio
            paired = [p / m for p, m in zip(times["pd"], times["mixed"], strict=True)]
            result["pd_added_pct_paired_median"] = round((statistics.median(paired) - 1) * 100, 1)
            if "pd_direct" in median:
                result["router_hop_ms"] = round((median["mixed"] - median["mixed_direct"]) * 1000, 1)
                after_kv = [d - p for d, p in zip(times["pd_direct"], times["prefill_answer"], strict=True)]
                result["decode_after_prefill_answer_ms"] = round(statistics.median(after_kv) * 1000, 1)
                result["pd_direct_added_pct"] = round(
                    (median["pd_direct"] / median["mixed_direct"] - 1) * 100, 1
                )
            result["loadavg_1m"] = [round(min(load), 1), round(max(load), 1)]
            result["samples_ms"] = {side: [round(t * 1000) for t in values] for side, values in times.items()}
            print(json.dumps(result), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--a", help="baseline (mixed) router URL; default: launch one here")
    parser.add_argument("--b", help="PD router URL; default: launch one here")
    parser.add_argument("--model", help="checkpoint (default: a random 16k-position tiny model)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 2048, 8192])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--vocab", type=int, default=400, help="token ids are drawn below this")
    parser.add_argument("--port", type=int, default=18600, help="A's router; B's is the next port")
    args = parser.parse_args()
    if args.a and args.b:
        asyncio.run(measure(args, {"a": {"router": args.a}, "b": {"router": args.b}}))
        return
    work = Path(tempfile.mkdtemp(prefix="bench_pd_ttft_"))
    model = args.model
    if model is None:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from tiny_models import make_tiny_model

        model = str(
            make_tiny_model(
                work / "model",
                arch="qwen3",
                num_hidden_layers=4,
                hidden_size=256,
                intermediate_size=512,
                num_attention_heads=8,
                num_key_value_heads=2,
                max_position_embeddings=16384,
            )
        )
    os.environ.setdefault("HEARTH_KV_TRANSFER_SECRET", "bench-" + os.urandom(8).hex())
    deployments = {
        "a": Deployment("mixed", model, ["--mixed", "1"], args.port, work),
        "b": Deployment("pd", model, ["--prefill", "1", "--decode", "1"], args.port + 1, work),
    }
    try:
        urls = {name: deployment.wait() for name, deployment in deployments.items()}
        print(json.dumps({"deployments": urls, "logs": str(work)}), flush=True)
        asyncio.run(measure(args, urls))
    finally:
        for deployment in deployments.values():
            deployment.stop()


if __name__ == "__main__":
    main()
