"""`hearth serve` end to end: a real server process on 127.0.0.1 with a tiny model, driven through the
official `openai` client (and raw HTTP where the client would hide what we check)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from tiny_models import make_tiny_model

from hearth.server.process import ServerProcess

API_KEY = "test-key"
MAX_MODEL_LEN = 512
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
HELLO = [{"role": "user", "content": "Hello! What is the weather like?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("serve")
    model = make_tiny_model(root / "tiny")
    args = [
        "--model",
        str(model),
        "--api-key",
        API_KEY,
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--kv-cache-memory",
        "0.05",
        "--page-size",
        "16",
        "--max-num-seqs",
        "64",
    ]
    process = ServerProcess(args, root / "server.log")
    with process:
        yield process
    assert process.process is not None and process.process.returncode == 0, process.log()[-3000:]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        yield c


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


# ---- completions and chat ---------------------------------------------------------------------------


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")


def test_chat_non_streaming_returns_text_and_full_usage(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model="tiny", messages=HELLO, max_tokens=8, extra_body={"ignore_eos": True}
    )
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason == "length"
    usage = response.usage
    assert usage is not None and usage.completion_tokens == 8 and usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + 8
    assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens is not None


def test_chat_stream_matches_non_stream_and_reports_usage(client: openai.OpenAI) -> None:
    kwargs = dict(model="tiny", messages=HELLO, max_tokens=12, temperature=0.0)
    whole = client.chat.completions.create(**kwargs)
    stream = client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    text, finish, usage, roles = "", None, None, []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.role:
                roles.append(choice.delta.role)
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert roles == ["assistant"]
    assert text == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_sse_framing_is_openais(http: httpx.Client) -> None:
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for event in events[:-2]:
        assert event.startswith("data: ")
        assert json.loads(event[len("data: ") :])["object"] == "text_completion"


@pytest.mark.parametrize(
    "prompt", ["The quick brown fox", ["one prompt", "another prompt"], [10, 20, 30, 40]]
)
def test_completions_accept_text_lists_and_token_ids(client: openai.OpenAI, prompt: object) -> None:
    response = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=5, temperature=0.0, extra_body={"ignore_eos": True}
    )
    num_prompts = len(prompt) if isinstance(prompt, list) and isinstance(prompt[0], str) else 1
    assert [c.index for c in response.choices] == list(range(num_prompts))
    assert all(c.finish_reason == "length" for c in response.choices)
    assert response.usage is not None and response.usage.completion_tokens == 5 * num_prompts


def test_completions_stream_matches_non_stream(client: openai.OpenAI) -> None:
    kwargs = dict(model="tiny", prompt="Once upon a time", max_tokens=10, temperature=0.0)
    whole = client.completions.create(**kwargs)
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(**kwargs, stream=True) if c.choices
    )
    assert streamed == whole.choices[0].text


def test_repeated_prefix_reports_cached_tokens(client: openai.OpenAI, http: httpx.Client) -> None:
    system = "You are an agent. " + " ".join(f"tool{i} does thing {i}." for i in range(15))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "first turn"}]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    messages[-1]["content"] = "second turn"
    second = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    assert first.usage is not None and second.usage is not None
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 16 * 4, cached  # the shared system prompt spans several full pages
    assert cached < second.usage.prompt_tokens
    metrics = http.get("/metrics").text
    hits = [line for line in metrics.splitlines() if line.startswith("hearth_prefix_cache_hit_tokens")]
    assert hits and float(hits[0].split()[-1]) >= cached


def test_cache_salt_isolates_the_prefix_cache(client: openai.OpenAI) -> None:
    prompt = "Tenant data: " + " ".join(f"row {i} holds value {i * 7}." for i in range(12))

    def cached(salt: str) -> int:
        response = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=1, extra_body={"cache_salt": salt}
        )
        return response.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-a") > 0
    assert cached("tenant-b") == 0


def test_session_affinity_header_is_accepted_and_logged(server: ServerProcess, http: httpx.Client) -> None:
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    response = http.post("/v1/completions", json=body, headers={"x-session-affinity": "session-42"})
    assert response.status_code == 200
    deadline = time.monotonic() + 5
    while "session-affinity=session-42" not in server.log():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_stop_string_cuts_the_answer(client: openai.OpenAI) -> None:
    kwargs = dict(
        model="tiny", prompt="def main():", max_tokens=24, temperature=0.0, extra_body={"ignore_eos": True}
    )
    full = client.completions.create(**kwargs).choices[0].text
    assert len(full) > 6
    stop = full[4:6]
    cut = full.index(stop)
    stopped = client.completions.create(**kwargs, stop=[stop]).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == full[:cut]


def test_n_choices_are_independent_and_counted(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model="tiny",
        messages=HELLO,
        n=3,
        max_tokens=6,
        seed=7,
        temperature=1.0,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert len({c.message.content for c in response.choices}) > 1
    assert response.usage is not None and response.usage.completion_tokens == 18
    stream = client.chat.completions.create(
        model="tiny", messages=HELLO, n=2, max_tokens=5, stream=True, extra_body={"ignore_eos": True}
    )
    finished = {c.index: c.finish_reason for chunk in stream for c in chunk.choices if c.finish_reason}
    assert finished == {0: "length", 1: "length"}


def test_chat_logprobs_have_sorted_alternatives(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model="tiny",
        messages=HELLO,
        max_tokens=5,
        temperature=0.0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = response.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert entry.logprob <= 0.0
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert entry.logprob == pytest.approx(tops[0], abs=1e-4)  # greedy picks the most likely token
    if not any(
        "\ufffd" in e.token for e in content
    ):  # a token holding part of a UTF-8 character shows as U+FFFD
        assert "".join(e.token for e in content) == response.choices[0].message.content


def test_completion_logprobs(client: openai.OpenAI) -> None:
    choice = client.completions.create(
        model="tiny", prompt="Hello", max_tokens=4, logprobs=2, extra_body={"ignore_eos": True}
    ).choices[0]
    assert len(choice.logprobs.tokens) == 4 and len(choice.logprobs.token_logprobs) == 4
    assert all(len(top) <= 2 and top for top in choice.logprobs.top_logprobs)
    assert choice.logprobs.text_offset[0] == 0


# ---- tool calls -------------------------------------------------------------------------------------


def _streamed_tool_calls(stream: openai.Stream) -> tuple[str, dict[int, dict[str, str]], str | None]:
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += delta.id or ""
                call["name"] += (delta.function.name or "") if delta.function else ""
                call["arguments"] += (delta.function.arguments or "") if delta.function else ""
            finish = choice.finish_reason or finish
    return content, calls, finish


def test_named_tool_choice_returns_that_call_streamed_and_not(client: openai.OpenAI) -> None:
    kwargs = dict(
        model="tiny",
        messages=HELLO,
        tools=[WEATHER_TOOL],
        max_tokens=12,
        temperature=0.0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    whole = client.chat.completions.create(**kwargs)
    message = whole.choices[0].message
    assert message.tool_calls and message.tool_calls[0].function.name == "get_weather"
    assert message.tool_calls[0].id.startswith("call_")
    assert whole.choices[0].finish_reason in ("tool_calls", "length")
    content, calls, finish = _streamed_tool_calls(client.chat.completions.create(**kwargs, stream=True))
    assert content == "" and message.content is None
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (call.function.name, call.function.arguments) for call in message.tool_calls
    ]
    assert finish == whole.choices[0].finish_reason


def test_auto_tool_choice_stream_and_non_stream_agree(client: openai.OpenAI) -> None:
    history = HELLO + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
    ]
    for seed in range(3):
        kwargs = dict(model="tiny", messages=history, tools=[WEATHER_TOOL], max_tokens=16, seed=seed)
        whole = client.chat.completions.create(**kwargs).choices[0]
        content, calls, finish = _streamed_tool_calls(client.chat.completions.create(**kwargs, stream=True))
        assert content == (whole.message.content or "")
        assert [(c["name"], c["arguments"]) for c in calls.values()] == [
            (t.function.name, t.function.arguments) for t in whole.message.tool_calls or []
        ]
        assert finish == whole.finish_reason


# ---- bad input --------------------------------------------------------------------------------------


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def test_invalid_json_is_a_400(http: httpx.Client) -> None:
    response = http.post(
        "/v1/chat/completions",
        content=b'{"model": "tiny", "messages": [',
        headers={"content-type": "application/json"},
    )
    assert _error(response, 400)["code"] == "invalid_json"


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"max_tokens": "ten"}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"messages": "hello"}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name"),
        (
            {"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"top_logprobs": 3}, "top_logprobs"),
    ],
)
def test_bad_parameters_are_400s_naming_the_param(http: httpx.Client, patch: dict, param: str) -> None:
    body = {"model": "tiny", "messages": HELLO, "max_tokens": 4, **patch}
    assert _error(http.post("/v1/chat/completions", json=body), 400)["param"] == param


def test_nan_is_a_400(http: httpx.Client) -> None:
    raw = b'{"model": "tiny", "prompt": "hi", "max_tokens": 2, "temperature": NaN}'
    response = http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    _error(response, 400)


def test_unknown_model_is_a_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as excinfo:
        client.chat.completions.create(model="gpt-17", messages=HELLO, max_tokens=2)
    assert excinfo.value.code == "model_not_found"


def test_prompt_longer_than_context_is_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.completions.create(model="tiny", prompt=[5] * (MAX_MODEL_LEN + 10), max_tokens=2)
    assert excinfo.value.code == "context_length_exceeded"
    assert excinfo.value.param == "prompt"


def test_a_long_history_is_measured_against_the_context(client: openai.OpenAI) -> None:
    # Over 32 KiB of body: rendered and tokenized off the event loop, with the same checks.
    history = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}: " + "words " * 200}
        for i in range(30)
    ]
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.chat.completions.create(model="tiny", messages=history, max_tokens=2)
    assert excinfo.value.code == "context_length_exceeded" and excinfo.value.param == "messages"


def test_max_tokens_past_context_is_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=MAX_MODEL_LEN)
    assert excinfo.value.param == "max_tokens"


def test_api_key_guards_v1_but_not_health(server: ServerProcess) -> None:
    bare = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert _error(bare, 401)["code"] == "invalid_api_key"
    wrong = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_unknown_route_is_an_openai_error(http: httpx.Client) -> None:
    _error(http.get("/v1/nothing-here"), 404)


# ---- side endpoints ---------------------------------------------------------------------------------


def test_tokenize_and_detokenize_round_trip(http: httpx.Client) -> None:
    tokens = http.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] == MAX_MODEL_LEN
    assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"] == "Hello world"
    chat = http.post("/tokenize", json={"messages": HELLO}).json()
    assert chat["count"] > tokens["count"]
    _error(http.post("/detokenize", json={"tokens": [10**9]}), 400)


def test_metrics_expose_latency_histograms_and_engine_gauges(
    http: httpx.Client, client: openai.OpenAI
) -> None:
    client.completions.create(model="tiny", prompt="warm", max_tokens=3, extra_body={"ignore_eos": True})
    text = http.get("/metrics").text
    for name in (
        "hearth_time_to_first_token_seconds_bucket",
        "hearth_inter_token_latency_seconds_bucket",
        "hearth_e2e_request_latency_seconds_count",
        "hearth_num_requests_running",
        "hearth_num_requests_waiting",
        "hearth_kv_pages_used",
        "hearth_kv_pages_total",
        "hearth_prefix_cache_hit_ratio",
        "hearth_prompt_tokens_total",
        "hearth_cached_tokens_total",
        "hearth_generation_tokens_total",
    ):
        assert name in text, name


def _load(http: httpx.Client) -> dict:
    load = http.get("/load").json()
    assert set(load) == {
        "running_requests",
        "waiting_requests",
        "prefill_tokens",
        "decode_tokens",
        "kv_pages_used",
        "kv_pages_total",
    }
    return load


def _wait_idle(http: httpx.Client, timeout_s: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        load = _load(http)
        if (load["running_requests"], load["waiting_requests"], load["kv_pages_used"]) == (0, 0, 0):
            return load
        assert time.monotonic() < deadline, load
        time.sleep(0.05)


def test_disconnect_mid_stream_aborts_and_frees_pages(http: httpx.Client) -> None:
    _wait_idle(http)
    body = {
        "model": "tiny",
        "prompt": "a long story " * 5,
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    with http.stream("POST", "/v1/completions", json=body) as response:
        events = (line for line in response.iter_lines() if line)
        for _ in range(3):
            assert next(events).startswith("data: ")
        busy = _load(http)
        assert busy["running_requests"] == 1 and busy["kv_pages_used"] > 0 and busy["decode_tokens"] > 0
    # Leaving the `with` closes the connection mid-stream.
    load = _wait_idle(http)
    assert load["decode_tokens"] == 0 and load["prefill_tokens"] == 0


def test_disconnect_while_waiting_for_a_non_streamed_answer_aborts_it(
    server: ServerProcess, http: httpx.Client
) -> None:
    _wait_idle(http)
    # The client gives up long before 480 tokens can be generated (a step of the tiny model takes ~1 ms).
    body = {"model": "tiny", "prompt": "wait for me", "max_tokens": 480, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            server.url + "/v1/completions",
            json=body,
            timeout=0.1,
            headers={"Authorization": f"Bearer {API_KEY}"},
        )
    _wait_idle(http)


async def test_32_concurrent_streaming_clients_all_finish(server: ServerProcess) -> None:
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)

    async def one(i: int) -> tuple[str | None, int]:
        stream = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": f"client {i} says hi"}],
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        finish, tokens = None, 0
        async for chunk in stream:
            finish = next((c.finish_reason for c in chunk.choices if c.finish_reason), finish)
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return finish, tokens

    results = await asyncio.gather(*(one(i) for i in range(32)))
    await client.close()
    assert results == [("length", 16)] * 32
