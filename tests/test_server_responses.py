"""`/v1/responses` through the real `openai` SDK (and the OpenAI Agents SDK) against the demo model, which was
trained on weather tool calls, so function tools round-trip for real."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from hearth.server.process import ServerProcess

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
QUESTION = "What's the weather in Paris?"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("responses")
    with ServerProcess(
        ["--kv-cache-memory", "0.05", "--max-model-len", "2048"], root / "server.log"
    ) as process:
        yield process


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _call(response: openai.types.responses.Response) -> openai.types.responses.ResponseFunctionToolCall:
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1, response.output
    return calls[0]


def test_a_function_tool_is_called_with_json_arguments(client: openai.OpenAI) -> None:
    response = client.responses.create(model="demo", input=QUESTION, tools=[WEATHER], temperature=0)
    assert response.status == "completed" and response.object == "response"
    call = _call(response)
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.status == "completed"
    assert isinstance(json.loads(call.arguments)["city"], str)
    usage = response.usage
    assert usage is not None and usage.input_tokens > 0 and usage.output_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens >= 0


def test_the_stream_follows_the_documented_event_sequence(client: openai.OpenAI) -> None:
    with client.responses.stream(model="demo", input=QUESTION, tools=[WEATHER], temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = [event.delta for event in events if event.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 1, "arguments stream as several deltas"
    assert "".join(deltas) == _call(final).arguments
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and final.status == "completed"


def test_a_function_call_output_round_trips_through_previous_response_id(client: openai.OpenAI) -> None:
    first = client.responses.create(model="demo", input=QUESTION, tools=[WEATHER], temperature=0)
    call = _call(first)
    second = client.responses.create(
        model="demo",
        previous_response_id=first.id,
        input=[
            {
                "type": "function_call_output",
                "call_id": call.call_id,
                "output": '{"temp_c": 21, "sky": "sunny"}',
            }
        ],
        tools=[WEATHER],
        temperature=0,
    )
    assert second.previous_response_id == first.id
    assert second.output_text.strip()
    assert second.usage is not None
    # The follow-up's prompt starts with the first turn's, which the prefix cache still holds.
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // 2


def test_the_whole_conversation_sent_again_gives_the_same_prompt(client: openai.OpenAI) -> None:
    first = client.responses.create(model="demo", input=QUESTION, tools=[WEATHER], temperature=0)
    call = _call(first)
    output = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 21}'}
    chained = client.responses.create(
        model="demo",
        previous_response_id=first.id,
        input=[output],
        tools=[WEATHER],
        temperature=0,
        store=False,
    )
    explicit = client.responses.create(
        model="demo",
        input=[
            {"role": "user", "content": QUESTION},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            output,
        ],
        tools=[WEATHER],
        temperature=0,
        store=False,
    )
    assert chained.usage.input_tokens == explicit.usage.input_tokens
    assert chained.output_text == explicit.output_text


def test_stored_responses_can_be_retrieved_and_deleted(client: openai.OpenAI) -> None:
    response = client.responses.create(model="demo", input="Hello!", max_output_tokens=8, temperature=0)
    assert client.responses.retrieve(response.id).id == response.id
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    unstored = client.responses.create(model="demo", input="Hello!", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_max_output_tokens_makes_the_response_incomplete(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model="demo", input="Tell me a long story.", max_output_tokens=2, temperature=0
    )
    assert response.status == "incomplete"
    assert (
        response.incomplete_details is not None and response.incomplete_details.reason == "max_output_tokens"
    )
    assert response.usage.output_tokens == 2


def test_text_format_json_schema_is_enforced(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "ok": {"type": "boolean"}},
        "required": ["city", "ok"],
        "additionalProperties": False,
    }
    response = client.responses.create(
        model="demo",
        input="Answer in JSON.",
        instructions="You answer in JSON only.",
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}},
        max_output_tokens=60,
        temperature=0,
    )
    answer = json.loads(response.output_text)
    assert set(answer) == {"city", "ok"} and isinstance(answer["ok"], bool)


def test_a_required_tool_choice_forces_a_call(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model="demo",
        input="Hello there, how are you?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0,
    )
    assert _call(response).name == "get_weather"


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
        ({"input": "hi", "previous_response_id": "resp_missing"}, 404, "previous_response_id"),
        ({"input": [{"type": "image_generation_call", "id": "x"}]}, 400, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, None),
        ({"input": "hi", "background": True}, 400, "background"),
        ({"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
        ({"input": []}, 400, "input"),
        ({"input": "hi", "model": "other"}, 404, "model"),
    ],
)
def test_bad_requests_get_openai_errors(
    server: ServerProcess, body: dict, status: int, param: str | None
) -> None:
    response = httpx.post(server.url + "/v1/responses", json=body, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param


def test_unknown_ids_and_bad_json_get_openai_errors(server: ServerProcess) -> None:
    for method in ("GET", "DELETE"):
        response = httpx.request(method, server.url + "/v1/responses/resp_nope", timeout=10)
        assert response.status_code == 404 and response.json()["error"]["type"] == "invalid_request_error"
    response = httpx.post(server.url + "/v1/responses", content=b"{not json", timeout=10)
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"


def test_the_openai_agents_sdk_runs_a_one_tool_agent(server: ServerProcess) -> None:
    agents = pytest.importorskip("agents")
    import asyncio

    cities: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city"""
        cities.append(city)
        return json.dumps({"temp_c": 21, "sky": "sunny"})

    async def run() -> str:
        agents.set_tracing_disabled(True)
        model = agents.OpenAIResponsesModel(
            model="demo", openai_client=openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused")
        )
        agent = agents.Agent(
            name="weather",
            tools=[get_weather],
            model=model,
            model_settings=agents.ModelSettings(temperature=0),
        )
        result = await agents.Runner.run(agent, QUESTION, max_turns=4)
        return str(result.final_output)

    final = asyncio.run(run())
    assert cities, "the agent called its tool"
    assert final.strip()
