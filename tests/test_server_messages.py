"""`/v1/messages` and `/v1/messages/count_tokens` through the real `anthropic` SDK against the demo model,
which was trained on weather tool calls, so tool_use / tool_result round-trips for real."""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import httpx
import pytest

from hearth.server.process import ServerProcess

API_KEY = "test-key"
WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
QUESTION = [{"role": "user", "content": "What's the weather in Paris?"}]
GREEDY = {"temperature": 0}  # the SDK no longer names temperature; the API still takes it


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("messages")
    args = ["--kv-cache-memory", "0.05", "--max-model-len", "2048", "--api-key", API_KEY]
    with ServerProcess(args, root / "server.log") as process:
        yield process


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0)


def _tool_use(message: anthropic.types.Message) -> anthropic.types.ToolUseBlock:
    blocks = [block for block in message.content if block.type == "tool_use"]
    assert len(blocks) == 1, message.content
    return blocks[0]


def test_a_tool_is_used_with_an_object_input(client: anthropic.Anthropic) -> None:
    message = client.messages.create(
        model="demo", max_tokens=64, messages=QUESTION, tools=[WEATHER], extra_body=GREEDY
    )
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    block = _tool_use(message)
    assert block.name == "get_weather" and block.id.startswith("toolu_")
    assert isinstance(block.input["city"], str)
    assert message.stop_reason == "tool_use"
    usage = message.usage
    assert usage.input_tokens > 0 and usage.output_tokens > 0
    assert usage.cache_read_input_tokens is not None and usage.cache_creation_input_tokens == 0


def test_a_tool_result_round_trips_and_reads_the_cache(client: anthropic.Anthropic) -> None:
    first = client.messages.create(
        model="demo", max_tokens=64, messages=QUESTION, tools=[WEATHER], extra_body=GREEDY
    )
    block = _tool_use(first)
    result = {
        "type": "tool_result",
        "tool_use_id": block.id,
        "content": json.dumps({"temp_c": 21, "sky": "sunny"}),
    }
    second = client.messages.create(
        model="demo",
        max_tokens=64,
        messages=[
            *QUESTION,
            {"role": "assistant", "content": first.content},
            {"role": "user", "content": [result]},
        ],
        tools=[WEATHER],
        extra_body=GREEDY,
    )
    assert second.stop_reason in ("end_turn", "tool_use")
    assert second.content
    # The second turn's prompt starts with the first's, which the prefix cache still holds.
    assert second.usage.cache_read_input_tokens >= first.usage.input_tokens // 2


def test_the_stream_follows_the_documented_events(client: anthropic.Anthropic) -> None:
    with client.messages.stream(
        model="demo", max_tokens=64, messages=QUESTION, tools=[WEATHER], extra_body=GREEDY
    ) as stream:
        events = [event for event in stream if not event.type.startswith(("input_json", "text"))]
        final = stream.get_final_message()
    kinds = [event.type for event in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    deltas = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert len(deltas) > 1, "tool input streams as several input_json_delta events"
    assert json.loads("".join(deltas)) == _tool_use(final).input
    assert events[-2].delta.stop_reason == "tool_use" and final.stop_reason == "tool_use"
    assert events[0].message.usage.input_tokens > 0


def test_a_tool_use_cut_by_max_tokens_keeps_the_input_written_so_far(client: anthropic.Anthropic) -> None:
    full = client.messages.create(
        model="demo", max_tokens=64, messages=QUESTION, tools=[WEATHER], extra_body=GREEDY
    )
    cut = client.messages.create(
        model="demo",
        max_tokens=full.usage.output_tokens - 3,
        messages=QUESTION,
        tools=[WEATHER],
        extra_body=GREEDY,
    )
    assert cut.stop_reason == "max_tokens"
    block = _tool_use(cut)
    assert isinstance(block.input, dict) and set(block.input) <= {"city"}
    city = block.input.get("city", "")
    assert _tool_use(full).input["city"].startswith(city)


def test_stop_sequences_stop_and_are_reported(client: anthropic.Anthropic) -> None:
    message = client.messages.create(
        model="demo",
        max_tokens=64,
        messages=[{"role": "user", "content": "Tell me about the weather."}],
        stop_sequences=[" "],
        extra_body=GREEDY,
    )
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == " "
    assert " " not in message.content[0].text


def test_max_tokens_is_the_stop_reason_when_it_runs_out(client: anthropic.Anthropic) -> None:
    message = client.messages.create(
        model="demo",
        max_tokens=2,
        messages=[{"role": "user", "content": "Tell me a long story."}],
        extra_body=GREEDY,
    )
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 2


@pytest.mark.parametrize(
    "tool_choice, expect_tool",
    [({"type": "any"}, True), ({"type": "tool", "name": "get_weather"}, True), ({"type": "none"}, False)],
)
def test_tool_choice_any_tool_and_none(
    client: anthropic.Anthropic, tool_choice: dict, expect_tool: bool
) -> None:
    message = client.messages.create(
        model="demo",
        max_tokens=48,
        messages=[{"role": "user", "content": "Hello, how are you today?"}],
        tools=[WEATHER],
        tool_choice=tool_choice,
        extra_body=GREEDY,
    )
    uses = [block for block in message.content if block.type == "tool_use"]
    assert bool(uses) == expect_tool
    if expect_tool:
        assert uses[0].name == "get_weather" and message.stop_reason == "tool_use"


def test_count_tokens_counts_the_prompt_a_create_would_send(client: anthropic.Anthropic) -> None:
    counted = client.messages.count_tokens(
        model="demo", messages=QUESTION, tools=[WEATHER], system="Be brief."
    )
    message = client.messages.create(
        model="demo", max_tokens=1, messages=QUESTION, tools=[WEATHER], system="Be brief.", extra_body=GREEDY
    )
    usage = message.usage
    assert counted.input_tokens == usage.input_tokens + usage.cache_read_input_tokens


def _post(
    server: ServerProcess, body: object, path: str = "/v1/messages", key: str = API_KEY
) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, headers={"x-api-key": key}, timeout=30)


@pytest.mark.parametrize(
    "body, status, kind",
    [
        ({"model": "demo", "messages": QUESTION}, 400, "invalid_request_error"),  # no max_tokens
        ({"model": "other", "max_tokens": 8, "messages": QUESTION}, 404, "not_found_error"),
        (
            {
                "model": "demo",
                "max_tokens": 8,
                "messages": [
                    {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}
                ],
            },
            400,
            "invalid_request_error",
        ),
        (
            {
                "model": "demo",
                "max_tokens": 8,
                "messages": QUESTION,
                "tools": [{"type": "bash_20250124", "name": "bash"}],
            },
            400,
            "invalid_request_error",
        ),
        (
            {"model": "demo", "max_tokens": 8, "messages": QUESTION, "temperature": 1.5},
            400,
            "invalid_request_error",
        ),
        (
            {
                "model": "demo",
                "max_tokens": 8,
                "messages": QUESTION,
                "tool_choice": {"type": "tool"},
                "tools": [WEATHER],
            },
            400,
            "invalid_request_error",
        ),
        (b"{nope", 400, "invalid_request_error"),
    ],
)
def test_bad_requests_get_anthropic_errors(
    server: ServerProcess, body: object, status: int, kind: str
) -> None:
    response = _post(server, body)
    assert response.status_code == status, response.text
    payload = response.json()
    assert payload["type"] == "error" and payload["error"]["type"] == kind and payload["error"]["message"]


def test_a_wrong_key_gets_an_anthropic_authentication_error(server: ServerProcess) -> None:
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        response = _post(server, {"model": "demo", "max_tokens": 8, "messages": QUESTION}, path, key="wrong")
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"


def test_count_tokens_errors_have_the_anthropic_shape(server: ServerProcess) -> None:
    response = _post(server, {"model": "demo", "messages": []}, "/v1/messages/count_tokens")
    assert response.status_code == 400 and response.json()["type"] == "error"


def test_the_sdk_raises_its_own_error_types(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="nope", max_tokens=8, messages=QUESTION)
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(
            model="demo", max_tokens=8, messages=[{"role": "user", "content": [{"type": "document"}]}]
        )
