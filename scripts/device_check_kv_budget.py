"""GPU check for issue 27: the KV cache sized from free device memory (`--gpu-memory-utilization`, default 0.9)
on the demo model, served through `hearth serve` with no KV option, answering, with vLLM's metric names.

Run on a lent GPU (see scripts/device_check.sh for the wheels to carry):
    python3 scripts/device_check_kv_budget.py
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from hearth.server.process import ServerProcess


def gpu_used_mib() -> str:
    try:
        return subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        ).stdout.strip()
    except FileNotFoundError:
        return "(no nvidia-smi)"


def main() -> int:
    print("before:", gpu_used_mib())
    failures = 0
    for extra in ([], ["--gpu-memory-utilization", "0.5"]):
        log = Path(tempfile.mkdtemp()) / "serve.log"
        started = time.perf_counter()
        with ServerProcess(extra, log) as server:
            ready_s = time.perf_counter() - started
            answer = httpx.post(
                server.url + "/v1/completions",
                json={"prompt": "The weather in Paris", "max_tokens": 8, "temperature": 0},
                timeout=60,
            ).json()
            metrics = httpx.get(server.url + "/metrics").text
            used = gpu_used_mib()
        text = log.read_text()
        kv = re.search(r"KV cache on (\S+): .*?\((\d+\.\d+) GiB", text)
        usage = re.search(r"^vllm:kv_cache_usage_perc\{.*\} (\S+)", metrics, re.M)
        print(
            f"args {extra or ['(defaults)']}: ready in {ready_s:.1f} s; {kv.group(0) if kv else 'no KV line'}"
        )
        print(
            f"  GPU memory used while serving: {used}; vllm:kv_cache_usage_perc {usage.group(1) if usage else None}"
        )
        print(f"  answer: {answer['choices'][0]['text']!r} usage {answer['usage']}")
        if (
            kv is None
            or kv.group(1) != "cuda:0"
            and not kv.group(1).startswith("cuda")
            or float(kv.group(2)) <= 1.0
        ):
            print("  FAIL: the KV cache was not sized from the device's memory")
            failures += 1
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
