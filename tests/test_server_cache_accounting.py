"""Usage says where cached prompt tokens came from (`cached_tokens_by_source`), the same in chat/completions,
Responses and Messages, streamed or not: device prefix-cache hits on a repeated prompt, host-tier hits once
a small device pool has evicted it (`--kv-offload-memory`)."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from hearth.engine.llm import LLM
from hearth.server.process import ServerProcess

PAGE = 16
NUM_PAGES = 12
SOURCES = ("device", "tier", "store", "peer")


def bytes_per_page(model: Path) -> int:
    llm = LLM(str(model), device="cpu", num_threads=1, page_size=PAGE, dtype="float32")
    try:
        return llm.engine.worker.kv_pool.layout.bytes_per_page
    finally:
        llm.engine.close()


def text_of(model: Path, seed: int, min_tokens: int, max_tokens: int) -> str:
    """A user message whose chat prompt has between min_tokens and max_tokens tokens."""
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    rng = random.Random(seed)
    words: list[str] = []
    for _ in range(1000):
        words.append(rng.choice(["weather", "paris", "tool", "cloud", "river", "seven", "lamp", "stone"]))
        text = " ".join(words)
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        length = len(tokenizer.encode(rendered, add_special_tokens=False))
        if length >= min_tokens:
            assert length <= max_tokens, length
            return text
    raise AssertionError("no text of that length")


@pytest.fixture(scope="module")
def server(
    tiny_model_factory, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerProcess, Path]]:
    model = tiny_model_factory("llama")
    pool_gib = NUM_PAGES * bytes_per_page(model) / (1 << 30)
    args = ["--model", str(model), "--served-model-name", "m", "--device", "cpu", "--num-threads", "1",
            "--dtype", "float32", "--page-size", str(PAGE), "--kv-cache-memory", str(pool_gib),
            "--kv-offload-memory", "0.01", "--max-model-len", "512"]  # fmt: skip
    with ServerProcess(args, tmp_path_factory.mktemp("cache") / "server.log") as process:
        yield process, model


def sse(response: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]


def usage_of(url: str, api: str, text: str, stream: bool) -> tuple[int, dict[str, int]]:
    """(cached tokens, cached tokens by source) as the API reports them."""
    messages = [{"role": "user", "content": text}]
    common = {"model": "m", "temperature": 0, "stream": stream}
    if api == "chat":
        body = {**common, "messages": messages, "max_tokens": 4, "stream_options": {"include_usage": True}}
    elif api == "responses":
        body = {**common, "input": messages, "max_output_tokens": 4}
    else:
        body = {**common, "messages": messages, "max_tokens": 4}
    path = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}[api]
    with httpx.stream("POST", url + path, json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        if stream:
            events = sse(response)
        else:
            response.read()
            events = [response.json()]
    if api == "chat":
        usage = next(e["usage"] for e in reversed(events) if e.get("usage"))
        details = usage["prompt_tokens_details"]
        return details["cached_tokens"], details["cached_tokens_by_source"]
    if api == "responses":
        final = events[-1]["response"] if stream else events[-1]
        details = final["usage"]["input_tokens_details"]
        return details["cached_tokens"], details["cached_tokens_by_source"]
    usages = [e.get("usage") or e.get("message", {}).get("usage") for e in events]
    usage = [u for u in usages if u][-1]
    return usage["cache_read_input_tokens"], usage["cached_tokens_by_source"]


CASES = [(api, stream) for api in ("chat", "responses", "messages") for stream in (False, True)]


def test_device_hits_are_reported_alike_by_every_api_streamed_or_not(server) -> None:
    process, model = server
    text = text_of(model, 1, 60, 90)
    cached, by_source = usage_of(process.url, "chat", text, False)
    assert cached == 0 and by_source == dict.fromkeys(SOURCES, 0)
    for api, stream in CASES:
        cached, by_source = usage_of(process.url, api, text, stream)
        assert cached >= 3 * PAGE and cached % PAGE == 0, (api, stream)
        assert by_source == {"device": cached, "tier": 0, "store": 0, "peer": 0}, (api, stream)


def test_pages_evicted_to_the_host_tier_are_reported_as_tier_hits(server) -> None:
    process, model = server
    text = text_of(model, 2, 90, 110)  # 5-6 full pages
    filler = text_of(model, 3, 170, 184)  # with its answer, every page of the pool
    for api, stream in CASES:
        assert usage_of(process.url, "chat", text, False)[0] >= 0  # text's pages on the device
        usage_of(process.url, "chat", filler, False)  # ... pushed out to host memory
        cached, by_source = usage_of(process.url, api, text, stream)
        assert cached >= 5 * PAGE, (api, stream)
        # A leading page the filler shares (the chat template) may stay on the device; the rest is the tier's.
        assert by_source["tier"] >= 4 * PAGE and by_source["device"] <= PAGE, (api, stream, by_source)
        assert by_source["device"] + by_source["tier"] == cached, (api, stream, by_source)
        assert by_source["store"] == by_source["peer"] == 0
