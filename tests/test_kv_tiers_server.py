"""Two `hearth serve` processes sharing one Redis: a long prompt computed on A is served from the store on
B (usage's cached_tokens, the same greedy answer), never across cache salts; /metrics shows the tier."""

from __future__ import annotations

import random
import re
import time
from pathlib import Path

import httpx
import pytest
from kv_tier_helpers import RedisServer

from hearth.server.process import ServerProcess


def complete(server: ServerProcess, prompt: list[int], **extra) -> dict:
    body = {"model": "m", "prompt": prompt, "max_tokens": 8, "temperature": 0, **extra}
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def metric(server: ServerProcess, name: str, tier: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    match = re.search(rf'^hearth_{name}\{{[^}}]*tier="{tier}"[^}}]*\}} ([0-9.e+-]+)$', text, re.M)
    return float(match.group(1)) if match else -1.0


def test_server_b_is_served_what_server_a_computed_through_redis(
    tiny_llama: Path, redis_server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("HEARTH_CPU_KERNELS", "0")  # both servers on the torch paths: comparable answers
    monkeypatch.setenv("HEARTH_KV_TRANSFER_SECRET", "tier-secret")  # the store's pages are MAC'd with it
    args = ["--model", str(tiny_llama), "--served-model-name", "m", "--device", "cpu", "--num-threads", "1",
            "--dtype", "float32", "--kv-store", redis_server.url]  # fmt: skip
    prompt = [random.Random(0).randrange(5, 250) for _ in range(300)]
    with ServerProcess(args, tmp_path / "a.log") as a, ServerProcess(args, tmp_path / "b.log") as b:
        on_a = complete(a, prompt)
        assert on_a["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        deadline = time.monotonic() + 30  # the write-back is asynchronous
        while metric(a, "kv_tier_written_pages_total", "redis") < 300 // 16:
            assert time.monotonic() < deadline, a.log()[-3000:]
            time.sleep(0.2)
        on_b = complete(b, prompt)
        cached = on_b["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= 0.9 * len(prompt) and cached == 288
        by_source = on_b["usage"]["prompt_tokens_details"]["cached_tokens_by_source"]
        assert by_source == {"device": 0, "tier": 0, "store": 288, "peer": 0}
        assert on_b["choices"][0]["text"] == on_a["choices"][0]["text"]
        deadline = time.monotonic() + 30  # tier stats reach the API process with a later stats message
        while metric(b, "kv_tier_hit_pages_total", "redis") != 18:
            assert time.monotonic() < deadline, metric(b, "kv_tier_hit_pages_total", "redis")
            time.sleep(0.2)
        assert 'hearth_kv_tier_read_latency_seconds_bucket{le="+Inf",model_name="m",tier="redis"}' in (
            httpx.get(b.url + "/metrics").text
        )
        other = complete(b, prompt, cache_salt="tenant-2")
        assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert other["choices"][0]["text"] == on_a["choices"][0]["text"]
        assert httpx.get(b.url + "/health").status_code == 200
