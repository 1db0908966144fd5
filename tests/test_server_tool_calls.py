"""Tool calls through the live server, from text the model really generates.

The checkpoint here is scripted, not mocked (scripted_model.py): its attention and MLP outputs are zero, so
each next token depends only on the current one, and its LM head maps the end of the chat prompt to a fixed
answer made of added tokens: some text, then two Hermes tool calls, then EOS. The real engine generates that
answer and the real server parses it, streamed and not.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest
from scripted_model import scripted_model

from hearth.server.process import ServerProcess

CALL_1 = {"name": "get_weather", "arguments": {"city": "Paris"}}
CALL_2 = {"name": "get_time", "arguments": {"zone": "Asia/Tokyo"}}
# Each piece is one added token, so the scripted chain never revisits a token.
ANSWER = [
    "Let me check.",
    "<tool_call>",
    json.dumps(CALL_1),
    "</tool_call>",
    "<tool_call>\n",
    json.dumps(CALL_2),
    "\n</tool_call>",
]
TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
    for name in ("get_weather", "get_time")
]
MESSAGES = [{"role": "user", "content": "Weather in Paris and the time in Tokyo?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("scripted")
    model = scripted_model(root, ANSWER, MESSAGES, TOOLS)
    process = ServerProcess(
        ["--model", str(model), "--kv-cache-memory", "0.02", "--max-model-len", "512"], root / "server.log"
    )
    with process:
        yield process


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _calls(tool_calls: list) -> list[dict]:
    return [{"name": c.function.name, "arguments": json.loads(c.function.arguments)} for c in tool_calls]


def test_the_scripted_model_writes_the_calls_as_text(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model="scripted", messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=20, temperature=0.0
    )
    assert response.choices[0].message.content == "".join(ANSWER)
    assert response.choices[0].message.tool_calls is None
    assert response.choices[0].finish_reason == "stop"


def test_calls_are_parsed_into_tool_calls(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model="scripted", messages=MESSAGES, tools=TOOLS, max_tokens=20, temperature=0.0
    )
    choice = response.choices[0]
    assert choice.message.content == "Let me check."
    assert _calls(choice.message.tool_calls) == [CALL_1, CALL_2]
    assert all(c.id.startswith("call_") and c.type == "function" for c in choice.message.tool_calls)
    assert len({c.id for c in choice.message.tool_calls}) == 2
    assert choice.finish_reason == "tool_calls"


def test_streamed_calls_arrive_as_tool_call_deltas(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="scripted", messages=MESSAGES, tools=TOOLS, max_tokens=20, temperature=0.0, n=2, stream=True
    )
    content: dict[int, str] = {0: "", 1: ""}
    calls: dict[int, dict[int, dict]] = {0: {}, 1: {}}
    finish = {}
    for chunk in stream:
        for choice in chunk.choices:
            content[choice.index] += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls[choice.index].setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                assert delta.id and delta.type == "function" and call["id"] is None
                call["id"] = delta.id
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    for index in (0, 1):
        assert content[index] == "Let me check."
        assert [
            {"name": c["name"], "arguments": json.loads(c["arguments"])} for c in calls[index].values()
        ] == [CALL_1, CALL_2]
    assert finish == {0: "tool_calls", 1: "tool_calls"}


def test_without_tools_the_text_is_returned_as_is(client: openai.OpenAI) -> None:
    # The prompt differs (no tool list), but it ends the same way, so the scripted answer is the same.
    stream = client.chat.completions.create(
        model="scripted", messages=MESSAGES, max_tokens=20, temperature=0.0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == "".join(ANSWER)


def test_parallel_tool_calls_false_returns_at_most_one_call(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model="scripted",
        messages=MESSAGES,
        tools=TOOLS,
        max_tokens=20,
        temperature=0.0,
        parallel_tool_calls=False,
    )
    assert _calls(response.choices[0].message.tool_calls) == [CALL_1]
    assert response.choices[0].finish_reason == "tool_calls"


def test_parallel_tool_calls_false_streams_at_most_one_call(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="scripted",
        messages=MESSAGES,
        tools=TOOLS,
        max_tokens=20,
        temperature=0.0,
        parallel_tool_calls=False,
        stream=True,
    )
    names = [
        delta.function.name
        for chunk in stream
        for choice in chunk.choices
        for delta in choice.delta.tool_calls or []
        if delta.function.name
    ]
    assert names == ["get_weather"]


def test_reasoning_effort_with_a_template_that_ignores_it_is_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model="scripted", messages=MESSAGES, max_tokens=2, reasoning_effort="low"
        )
    assert refused.value.body["param"] == "reasoning_effort"
