"""`hearth serve` under an injected KV fault: a request whose page table fails the integrity check is a 500 with
code `kv_integrity_error` (an SSE error event once streaming), never an answer; /metrics counts it.

The server runs with `HEARTH_KV_FAULTS=table_swap:1` and `--kv-integrity-action abort`: the first page a
running request allocates after admission swaps two entries of its table, so it fails at that step.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from unittest import mock

import httpx
import pytest
from tiny_models import make_tiny_model

from hearth.server.process import ServerProcess

PAGE_SIZE = 16
PROMPT = list(range(10, 30))  # two pages at admission; decoding past token 32 allocates a third


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("serve-faults")
    model = make_tiny_model(root / "tiny")
    args = ["--model", str(model), "--kv-cache-memory", "0.02", "--page-size", str(PAGE_SIZE)]
    args += ["--max-model-len", "256", "--kv-integrity-action", "abort"]
    process = ServerProcess(args, root / "server.log")
    with mock.patch.dict(os.environ, {"HEARTH_KV_FAULTS": "table_swap:1"}):
        process.start()
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


@pytest.fixture
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def completion(**extra: object) -> dict[str, object]:
    return {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": 30,
        "ignore_eos": True,
        "temperature": 0,
        **extra,
    }


def test_a_failed_check_is_a_500_with_code_kv_integrity_error(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json=completion())
    assert response.status_code == 500, response.text
    error = response.json()["error"]
    assert error["code"] == "kv_integrity_error"
    assert "integrity" in error["message"]


def test_a_short_answer_that_allocates_no_page_is_untouched(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json=completion(max_tokens=5))
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] == "length"


def test_once_streaming_the_failure_is_an_sse_error_event(http: httpx.Client) -> None:
    with http.stream("POST", "/v1/completions", json=completion(stream=True)) as response:
        assert response.status_code == 200
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    payloads = [json.loads(event) for event in events[:-1]]
    texts = [p for p in payloads if "choices" in p and p["choices"] and p["choices"][0].get("text")]
    assert texts, "the tokens before the failing step were streamed"
    assert payloads[-1]["error"]["code"] == "kv_integrity_error"
    assert all(p["choices"][0].get("finish_reason") is None for p in payloads if p.get("choices"))


def test_metrics_count_the_failures(http: httpx.Client) -> None:
    http.post("/v1/completions", json=completion())
    text = http.get("/metrics").text
    match = re.search(r'^hearth_kv_integrity_failures_total\{model_name="tiny"\} (\S+)$', text, re.M)
    assert match is not None, text[-2000:]
    assert float(match.group(1)) >= 1
