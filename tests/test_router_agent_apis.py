"""The Responses and Messages APIs through a real `hearth route`, mixed and prefill/decode, on the demo model:
the official SDKs' round trips, stored responses found where they live, and the prefill side's cached tokens
in every usage, streamed or not."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from hearth.server.process import ServerProcess, free_port

SECRET = "agent-apis-secret"
COMMON = ["--max-model-len", "2048", "--kv-cache-memory", "0.05", "--page-size", "8"]
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
ANTHROPIC_WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": WEATHER["parameters"],
}
QUESTION = "What's the weather in Paris?"


class RouterProcess:
    def __init__(self, args: list[str], log: Path) -> None:
        self.port = free_port()
        command = [
            sys.executable,
            "-m",
            "hearth.cli",
            "route",
            "--port",
            str(self.port),
            "--health-interval-s",
            "0.2",
        ]
        self._log = log.open("wb")
        self.process = subprocess.Popen([*command, *args], stdout=self._log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 120
        while True:
            assert self.process.poll() is None, log.read_text()
            try:
                health = httpx.get(self.url + "/health", timeout=5).json()
                if health["healthy_workers"] == health["workers"]:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("agent_apis")
    os.environ["HEARTH_KV_TRANSFER_SECRET"] = SECRET  # inherited by the servers, never on a command line
    mixed = ServerProcess(COMMON, root / "mixed.log")
    prefill = ServerProcess([*COMMON, "--role", "prefill"], root / "prefill.log")
    decode = ServerProcess([*COMMON, "--role", "decode", "--kv-transfer-timeout", "4"], root / "decode.log")
    servers = [mixed, prefill, decode]
    routers: list[RouterProcess] = []
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready(timeout_s=900)
        routers.append(RouterProcess(["--worker", mixed.url], root / "router_mixed.log"))
        routers.append(
            RouterProcess(["--prefill", prefill.url, "--decode", decode.url], root / "router_pd.log")
        )
        yield {"mixed": routers[0], "pd": routers[1], "prefill": prefill, "decode": decode}
    finally:
        for router in routers:
            router.stop()
        for server in servers:
            server.stop()
        os.environ.pop("HEARTH_KV_TRANSFER_SECRET", None)


MODES = ["mixed", "pd"]


def _openai(deployment: dict[str, Any], mode: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=deployment[mode].url + "/v1", api_key="unused", max_retries=0)


def _anthropic(deployment: dict[str, Any], mode: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=deployment[mode].url, api_key="unused", max_retries=0)


@pytest.mark.parametrize("mode", MODES)
def test_responses_round_trip_through_the_router(deployment: dict[str, Any], mode: str) -> None:
    client = _openai(deployment, mode)
    first = client.responses.create(model="demo", input=QUESTION, tools=[WEATHER], temperature=0)
    call = next(item for item in first.output if item.type == "function_call")
    assert call.name == "get_weather" and json.loads(call.arguments)
    second = client.responses.create(
        model="demo",
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 21}'}],
        tools=[WEATHER],
        temperature=0,
    )
    assert second.status == "completed" and second.output
    # Stored where it was answered, found from the router.
    assert client.responses.retrieve(second.id).id == second.id
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)


@pytest.mark.parametrize("mode", MODES)
def test_responses_usage_reports_the_cached_prefix_streamed_or_not(
    deployment: dict[str, Any], mode: str
) -> None:
    client = _openai(deployment, mode)
    prompt = "Tell me about the weather in Oslo and Bergen."
    client.responses.create(model="demo", input=prompt, max_output_tokens=4, temperature=0, store=False)
    again = client.responses.create(
        model="demo", input=prompt, max_output_tokens=4, temperature=0, store=False
    )
    assert again.usage.input_tokens_details.cached_tokens >= again.usage.input_tokens // 2
    with client.responses.stream(
        model="demo", input=prompt, max_output_tokens=4, temperature=0, store=False
    ) as s:
        events = list(s)
    kinds = [event.type for event in events]
    # At max_output_tokens the stream ends with response.incomplete (the SDK's get_final_response wants
    # response.completed), so the final response is read from the last event.
    assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete"
    final = events[-1].response
    assert final.usage.input_tokens_details.cached_tokens == again.usage.input_tokens_details.cached_tokens


@pytest.mark.parametrize("mode", MODES)
def test_messages_round_trip_and_cache_reads_through_the_router(
    deployment: dict[str, Any], mode: str
) -> None:
    client = _anthropic(deployment, mode)
    messages = [{"role": "user", "content": QUESTION}]
    first = client.messages.create(
        model="demo",
        max_tokens=48,
        messages=messages,
        tools=[ANTHROPIC_WEATHER],
        extra_body={"temperature": 0},
    )
    block = next(b for b in first.content if b.type == "tool_use")
    follow_up = [
        *messages,
        {"role": "assistant", "content": first.content},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": block.id, "content": '{"temp_c": 21}'}],
        },
    ]
    second = client.messages.create(
        model="demo",
        max_tokens=32,
        messages=follow_up,
        tools=[ANTHROPIC_WEATHER],
        extra_body={"temperature": 0},
    )
    counted = client.messages.count_tokens(model="demo", messages=follow_up, tools=[ANTHROPIC_WEATHER])
    usage = second.usage
    assert usage.cache_read_input_tokens > 0
    assert usage.input_tokens + usage.cache_read_input_tokens == counted.input_tokens
    with client.messages.stream(
        model="demo",
        max_tokens=32,
        messages=follow_up,
        tools=[ANTHROPIC_WEATHER],
        extra_body={"temperature": 0},
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert final.usage.cache_read_input_tokens >= usage.cache_read_input_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == counted.input_tokens


def test_the_router_answers_messages_errors_in_anthropics_shape(deployment: dict[str, Any]) -> None:
    response = httpx.post(deployment["mixed"].url + "/v1/messages", content=b"{oops", timeout=10)
    assert response.status_code == 400
    assert response.json()["type"] == "error" and response.json()["error"]["type"] == "invalid_request_error"
    upstream = httpx.post(
        deployment["pd"].url + "/v1/messages", json={"model": "demo", "messages": []}, timeout=30
    )
    assert upstream.status_code == 400 and upstream.json()["type"] == "error"
