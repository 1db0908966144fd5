"""Structured output: `response_format` json_object / json_schema enforced by constrained decoding.

A tiny random-weight model has no wish to write JSON, so whatever it answers under a constraint is the
grammar's doing. Random models wander into long strings, so answers cut off by max_tokens ("length") are
only checked to be cut-off JSON; every answer that finishes with "stop" must be complete, valid JSON.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
import torch
from tiny_models import make_tiny_model

from hearth.engine.llm import LLM
from hearth.engine.messages import EngineRequest
from hearth.engine.sampling_params import InvalidParamError, SamplingParams
from hearth.engine.structured_output import StructuredOutput, StructuredOutputManager
from hearth.model.tokenizer import Tokenizer
from hearth.server.process import ServerProcess

# Bounded everything: enums, booleans, small integers and short strings, so a random model gets to the end.
SCHEMA = {
    "type": "object",
    "properties": {
        "tool": {"enum": ["search", "read_file", "finish"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "urgent": {"type": "boolean"},
        "note": {"type": "string", "maxLength": 6},
    },
    "required": ["tool", "count", "urgent", "note"],
    "additionalProperties": False,
}
SEEDS = range(8)
API_KEY = "test-key"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("structured") / "tiny")


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(str(model_dir), dtype="float32", page_size=16, kv_cache_memory_gib=0.02, max_model_len=512)


def _sampled(spec: StructuredOutput | None, seed: int, max_tokens: int = 120) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, structured_output=spec)


def _greedy(spec: StructuredOutput | None, max_tokens: int = 60) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_output=spec)


def _assert_schema_answer(text: str, finish_reason: str) -> None:
    if finish_reason == "stop":
        jsonschema.validate(json.loads(text), SCHEMA)
    else:
        assert finish_reason == "length"
        assert text.lstrip().startswith("{")


# ---- the spec and the mask ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "nonsense"},
        {"type": "object", "properties": 5},
        {"type": "integer", "minimum": 5, "maximum": 1},
        {"$ref": "#/$defs/missing"},
    ],
)
def test_bad_schema_is_an_invalid_response_format(schema: dict) -> None:
    with pytest.raises(InvalidParamError) as caught:
        SamplingParams(structured_output=StructuredOutput.json_schema(schema))
    assert caught.value.param == "response_format"


def test_strict_rejects_unknown_keywords_and_non_strict_ignores_them() -> None:
    schema = {"type": "string", "format": "no-such-format"}
    with pytest.raises(InvalidParamError):
        SamplingParams(structured_output=StructuredOutput.json_schema(schema, strict=True))
    SamplingParams(structured_output=StructuredOutput.json_schema(schema, strict=False))


def test_bad_lark_grammar_is_an_invalid_response_format() -> None:
    with pytest.raises(InvalidParamError, match="grammar"):
        SamplingParams(structured_output=StructuredOutput.lark_grammar("start: undefined_rule"))
    SamplingParams(structured_output=StructuredOutput.lark_grammar('start: "yes" | "no"'))


def test_mask_allows_only_grammar_tokens_and_never_padded_columns(model_dir: Path) -> None:
    tokenizer = Tokenizer.from_dir(model_dir)
    manager = StructuredOutputManager(tokenizer, tokenizer.eos_token_ids)
    matcher = manager.new_matcher(StructuredOutput.json_object())
    padded_width = tokenizer.vocab_size + 40
    logits = torch.zeros(3, padded_width)
    manager.mask_logits(logits, [None, matcher, None])

    assert torch.equal(logits[0], torch.zeros(padded_width))  # unconstrained rows are untouched
    assert torch.equal(logits[2], torch.zeros(padded_width))
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert allowed and all(token_id < tokenizer.vocab_size for token_id in allowed)
    assert all(tokenizer.decode([token_id]).startswith("{") for token_id in allowed)
    assert tokenizer.encode("{", add_special_tokens=False)[0] in allowed


def test_matcher_terminates_when_the_object_closes(model_dir: Path) -> None:
    tokenizer = Tokenizer.from_dir(model_dir)
    manager = StructuredOutputManager(tokenizer, tokenizer.eos_token_ids)
    matcher = manager.new_matcher(StructuredOutput.json_schema(SCHEMA))
    answer = '{"tool": "search", "count": 7, "urgent": true, "note": "ok"}'
    token_ids = tokenizer.encode(answer, add_special_tokens=False)
    for token_id in token_ids[:-1]:
        assert matcher.accept(token_id)
        assert not matcher.is_terminated
    assert matcher.accept(token_ids[-1])
    assert matcher.is_terminated
    rejecting = manager.new_matcher(StructuredOutput.json_schema(SCHEMA))
    assert not rejecting.accept(tokenizer.encode("[", add_special_tokens=False)[0])


# ---- through the engine ---------------------------------------------------------------------------------


def test_json_object_answers_are_json_objects(llm: LLM) -> None:
    spec = StructuredOutput.json_object()
    seeds = range(6)
    results = llm.generate(["Reply in JSON."] * len(seeds), [_sampled(spec, seed, 120) for seed in seeds])
    finished = [r for r in results if r.finish_reason == "stop"]
    assert finished, [r.text for r in results]
    for result in results:
        assert result.text.startswith("{")
    for result in finished:
        assert isinstance(json.loads(result.text), dict)
        # The grammar ends the request at the closing brace, before any EOS is sampled.
        assert not set(result.token_ids) & llm.engine.eos_token_ids


def test_json_schema_answers_fit_the_schema(llm: LLM) -> None:
    spec = StructuredOutput.json_schema(SCHEMA)
    results = llm.generate(["Pick a tool."] * len(SEEDS), [_sampled(spec, seed) for seed in SEEDS])
    assert sum(r.finish_reason == "stop" for r in results) >= len(SEEDS) // 2, [r.text for r in results]
    for result in results:
        _assert_schema_answer(result.text, result.finish_reason)


def test_unconstrained_neighbour_is_unaffected(llm: LLM) -> None:
    alone = llm.generate(["An ordinary request"], _greedy(None, 24))[0]
    spec = StructuredOutput.json_schema(SCHEMA)
    batch = llm.generate(
        ["Pick a tool.", "An ordinary request", "Pick a tool again."],
        [_greedy(spec), _greedy(None, 24), _greedy(spec)],
    )
    assert batch[1].token_ids == alone.token_ids
    assert batch[1].text == alone.text
    for result in (batch[0], batch[2]):
        _assert_schema_answer(result.text, result.finish_reason)


def test_padded_vocabulary_columns_are_never_sampled(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path / "padded", vocab_size=576)  # tokenizer has 512 ids
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory_gib=0.01, max_model_len=256)
    spec = StructuredOutput.json_schema(SCHEMA)
    results = llm.generate(["Pick."] * 4, [_sampled(spec, seed, 100) for seed in range(4)])
    for result in results:
        assert max(result.token_ids) < 512
        _assert_schema_answer(result.text, result.finish_reason)


def test_preemption_keeps_the_grammar_state(model_dir: Path, llm: LLM) -> None:
    spec = StructuredOutput.json_schema(SCHEMA)
    prompts = [f"Request number {i}: pick a tool." for i in range(4)]
    expected = llm.generate(prompts, _greedy(spec, 40))
    # 2 layers x 2 KV heads x 16 dims x fp32 x (K, V) = 512 bytes per token: 14 pages of 8 tokens.
    tight = LLM(str(model_dir), dtype="float32", page_size=8, kv_cache_memory_gib=14 * 8 * 512 / 2**30)
    results = tight.generate(prompts, _greedy(spec, 40))
    assert tight.engine.stats().num_preemptions_total > 0
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
    for result in results:
        _assert_schema_answer(result.text, result.finish_reason)


def test_aborting_a_constrained_request_frees_everything(llm: LLM) -> None:
    engine = llm.engine
    spec = StructuredOutput.json_object()
    request_id = "abort-me"
    engine.add_request(EngineRequest(request_id, llm.tokenizer.encode("Abort me"), _sampled(spec, 1, 200)))
    for _ in range(5):
        engine.step()
    request = engine._requests[request_id]
    assert request.grammar is not None and request.page_ids
    [output] = engine.abort([request_id])
    assert output.finish_reason == "abort"
    assert request.grammar is None
    assert request_id not in engine._requests
    assert engine.stats().kv_pages_used == 0
    assert all(count == 0 for count in engine.kv.allocator.ref_counts)


def test_a_schema_used_twice_compiles_once(llm: LLM) -> None:
    manager = llm.engine.structured
    first = manager.new_matcher(StructuredOutput.json_schema(SCHEMA))
    cached = len(manager._templates)
    second = manager.new_matcher(StructuredOutput.json_schema(dict(SCHEMA)))
    assert len(manager._templates) == cached
    assert first.raw is not second.raw  # each request still gets its own state


# ---- through a real server --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    args = ["--model", str(model_dir), "--api-key", API_KEY, "--max-model-len", "512"]
    args += ["--kv-cache-memory", "0.05", "--page-size", "16"]
    process = ServerProcess(args, tmp_path_factory.mktemp("structured-serve") / "server.log")
    with process:
        yield process
    assert process.process is not None and process.process.returncode == 0, process.log()[-3000:]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "action", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "Choose the next action."}]


def test_chat_json_schema_with_n_choices(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model="tiny", messages=MESSAGES, response_format=SCHEMA_FORMAT, n=4, seed=7, max_tokens=120
    )
    assert len(response.choices) == 4
    assert sum(c.finish_reason == "stop" for c in response.choices) >= 2
    for choice in response.choices:
        _assert_schema_answer(choice.message.content or "", choice.finish_reason)


def test_chat_stream_gives_the_same_json_as_non_stream(client: openai.OpenAI) -> None:
    kwargs = dict(model="tiny", messages=MESSAGES, response_format=SCHEMA_FORMAT, seed=3, max_tokens=120)
    whole = client.chat.completions.create(**kwargs)
    text, finish = "", None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert text == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    _assert_schema_answer(text, finish)


def test_chat_json_object(client: openai.OpenAI) -> None:
    answers = [
        client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            response_format={"type": "json_object"},
            seed=seed,
            max_tokens=160,
        ).choices[0]
        for seed in SEEDS
    ]
    assert any(a.finish_reason == "stop" for a in answers)
    for answer in answers:
        assert (answer.message.content or "").startswith("{")
        if answer.finish_reason == "stop":
            assert isinstance(json.loads(answer.message.content or ""), dict)


def test_completions_accept_response_format(server: ServerProcess) -> None:
    body = {"model": "tiny", "prompt": "JSON:", "max_tokens": 120, "seed": 1, "n": 3}
    body["response_format"] = SCHEMA_FORMAT
    response = httpx.post(
        server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120
    )
    assert response.status_code == 200, response.text
    for choice in response.json()["choices"]:
        _assert_schema_answer(choice["text"], choice["finish_reason"])


@pytest.mark.parametrize(
    "response_format",
    [
        {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "nonsense"}}},
        {"type": "json_schema", "json_schema": {"name": "no-schema"}},
        {"type": "json_schema"},
        {"type": "xml"},
    ],
)
def test_bad_response_format_is_a_400(client: openai.OpenAI, response_format: dict) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="tiny", messages=MESSAGES, response_format=response_format, max_tokens=8
        )
    error = caught.value.response.json()["error"]  # OpenAI's error object, as sent
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"].startswith("response_format")
    assert error["message"]


def test_server_survives_bad_schemas_and_serves_after(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"minimum": "a"}}},
        )
    response = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4)
    assert response.choices[0].finish_reason in ("stop", "length")


# ---- forced tool calls (Hermes format, the server's default parser) ----------------------------------------

FORECAST = {
    "type": "object",
    "properties": {"unit": {"enum": ["C", "F"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["unit", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "forecast", "parameters": FORECAST}},
    {
        "type": "function",
        "function": {"name": "stop_now", "parameters": {"type": "object", "additionalProperties": False}},
    },
]


def test_named_tool_choice_arguments_fit_the_parameters(client: openai.OpenAI) -> None:
    for seed in SEEDS:
        response = client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "forecast"}},
            seed=seed,
            max_tokens=60,
        )
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls or []
        assert call.function.name == "forecast"
        jsonschema.validate(json.loads(call.function.arguments), FORECAST)


def test_required_tool_choice_picks_a_listed_tool_with_fitting_arguments(client: openai.OpenAI) -> None:
    names = set()
    for seed in SEEDS:
        choice = (
            client.chat.completions.create(
                model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", seed=seed, max_tokens=60
            )
        ).choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls or []
        names.add(call.function.name)
        arguments = json.loads(call.function.arguments)
        if call.function.name == "forecast":
            jsonschema.validate(arguments, FORECAST)
        else:
            assert call.function.name == "stop_now" and arguments == {}
    assert names == {"forecast", "stop_now"}


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": {"type": "json_object"}, "tool_choice": "required"}, "response_format"),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}
                ],
                "tool_choice": "required",
            },
            "tools",
        ),
    ],
)
def test_unenforceable_tool_requests_are_400s(server: ServerProcess, extra: dict, param: str) -> None:
    body = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 8, **extra}
    response = httpx.post(
        server.url + "/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
