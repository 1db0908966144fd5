"""`--reasoning-parser`: a model's thinking comes back as `reasoning_content` in chat completions, a reasoning
item in Responses and a thinking block in Messages, from text the real engine generates (a scripted
checkpoint, see scripted_model.py), streamed and not; tool-call arguments written over several tokens
stream as several deltas in every API."""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import openai
import pytest
from scripted_model import scripted_model

from hearth.server.process import ServerProcess

MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
THINKING = "Need the weather."
ANSWER = [
    "<think>",
    THINKING,
    "</think>",
    "<tool_call>",
    '{"name": "get_weather", "arguments": ',
    '{"city": ',
    '"Paris"}',
    "}",
    "</tool_call>",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("reasoning")
    model = scripted_model(root, ANSWER, MESSAGES, TOOLS)
    args = [
        "--model",
        str(model),
        "--kv-cache-memory",
        "0.02",
        "--max-model-len",
        "512",
        "--reasoning-parser",
        "qwen3",
    ]
    with ServerProcess(args, root / "server.log") as process:
        yield process


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_chat_returns_reasoning_content_apart_from_the_call(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(model="scripted", messages=MESSAGES, tools=TOOLS, temperature=0)
    message = response.choices[0].message
    assert message.model_extra["reasoning_content"] == THINKING
    assert message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert response.choices[0].finish_reason == "tool_calls"


def test_chat_streams_reasoning_then_arguments_in_several_deltas(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="scripted", messages=MESSAGES, tools=TOOLS, temperature=0, stream=True
    )
    reasoning, content, argument_deltas, names = "", "", [], []
    for chunk in stream:
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
        for call in delta.tool_calls or []:
            if call.function.name:
                names.append(call.function.name)
                assert call.id and call.type == "function"
            if call.function.arguments:
                argument_deltas.append(call.function.arguments)
    assert reasoning == THINKING and content == "" and names == ["get_weather"]
    assert len(argument_deltas) >= 2
    assert json.loads("".join(argument_deltas)) == {"city": "Paris"}


def test_responses_give_a_reasoning_item_then_the_call(client: openai.OpenAI) -> None:
    tools = [{"type": "function", **TOOLS[0]["function"]}]
    response = client.responses.create(
        model="scripted", input=MESSAGES[0]["content"], tools=tools, temperature=0
    )
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "function_call"]
    assert response.output[0].content[0].text == THINKING
    assert response.usage.output_tokens_details.reasoning_tokens > 0
    with client.responses.stream(
        model="scripted", input=MESSAGES[0]["content"], tools=tools, temperature=0
    ) as stream:
        events = list(stream)
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    arguments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert reasoning == THINKING and len(arguments) >= 2
    assert json.loads("".join(arguments)) == {"city": "Paris"}


def test_messages_give_a_thinking_block_then_tool_use(server: ServerProcess) -> None:
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    tools = [{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}]
    message = client.messages.create(
        model="scripted", max_tokens=64, messages=MESSAGES, tools=tools, extra_body={"temperature": 0}
    )
    assert [block.type for block in message.content] == ["thinking", "tool_use"]
    assert message.content[0].thinking == THINKING
    assert message.content[1].input == {"city": "Paris"} and message.stop_reason == "tool_use"
    with client.messages.stream(
        model="scripted", max_tokens=64, messages=MESSAGES, tools=tools, extra_body={"temperature": 0}
    ) as stream:
        events = list(stream)
    thinking = "".join(
        e.delta.thinking
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "thinking_delta"
    )
    partial = [
        e.delta.partial_json
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    ]
    assert thinking == THINKING and len(partial) >= 2
