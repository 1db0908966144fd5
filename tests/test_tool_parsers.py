"""Tool-call parsers on model-like text, and the streaming extractor against the one-shot parse."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hearth.server.tool_calls import ToolCallExtractor, extract_all
from hearth.server.tool_parsers import ToolParser, available_tool_parsers, get_tool_parser

QWEN_TWO_CALLS = (
    "Let me check both cities.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tōkyō"}}\n</tool_call>'
)
KIMI_CALLS = (
    "Sure.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
    '{"city": "Beijing"}<|tool_call_end|><|tool_call_begin|>functions.search:1<|tool_call_argument_begin|>'
    '{"q": "x"}<|tool_call_end|><|tool_calls_section_end|>'
)
GLM_CALL = (
    "Checking.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n"
    "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"
)
LLAMA_CALLS = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "time", "parameters": {}}'

SAMPLES = {
    "hermes": [
        QWEN_TWO_CALLS,
        "no calls here, just <tool text",
        "<tool_call>{broken json}</tool_call> after",
    ],
    "kimi_k2": [KIMI_CALLS, "plain answer"],
    "glm45": [GLM_CALL, "plain <tool_call"],
    "llama3_json": [
        LLAMA_CALLS,
        '{"name": "f", "parameters": {"a": 1}}',
        "Hello {not a call}",
        '{"name": "f", "par',
    ],
}


def _calls(calls: list) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in calls]


def test_registry_names_the_builtin_formats_and_rejects_unknown() -> None:
    assert {"hermes", "llama3_json", "kimi_k2", "glm45"} <= set(available_tool_parsers())
    assert isinstance(get_tool_parser("hermes"), ToolParser)
    with pytest.raises(KeyError, match="choose one of"):
        get_tool_parser("nope")


def test_hermes_parses_calls_and_keeps_outside_text_as_content() -> None:
    result = get_tool_parser("hermes").parse(QWEN_TWO_CALLS, final=True)
    assert _calls(result.tool_calls) == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}),
        ("get_weather", {"city": "Tōkyō"}),
    ]
    assert result.content.strip() == "Let me check both cities."


def test_hermes_invalid_json_stays_content() -> None:
    result = get_tool_parser("hermes").parse("a <tool_call>{nope}</tool_call> b", final=True)
    assert result.tool_calls == []
    assert result.content == "a <tool_call>{nope}</tool_call> b"


def test_hermes_unterminated_last_call_counts_when_final() -> None:
    parser = get_tool_parser("hermes")
    text = '<tool_call>\n{"name": "f", "arguments": {"x": [1, 2]}}\n'
    partial = parser.parse(text, final=False).tool_calls
    assert [(call.name, call.arguments) for call in partial] == [("f", '{"x": [1, 2]}')]
    assert _calls(parser.parse(text, final=True).tool_calls) == [("f", {"x": [1, 2]})]


def test_hermes_holds_back_a_half_written_tag_while_streaming() -> None:
    parser = get_tool_parser("hermes")
    assert parser.parse("Hello <tool_c", final=False).content == "Hello "
    assert parser.parse("Hello <tool_c", final=True).content == "Hello <tool_c"


def test_kimi_k2_names_ids_and_drops_section_markers() -> None:
    result = get_tool_parser("kimi_k2").parse(KIMI_CALLS, final=True)
    assert _calls(result.tool_calls) == [("get_weather", {"city": "Beijing"}), ("search", {"q": "x"})]
    assert [call.id for call in result.tool_calls] == ["functions.get_weather:0", "functions.search:1"]
    assert result.content == "Sure."


def test_glm45_reads_typed_argument_values() -> None:
    result = get_tool_parser("glm45").parse(GLM_CALL, final=True)
    assert _calls(result.tool_calls) == [("get_weather", {"city": "Oslo", "days": 3})]
    assert result.content == "Checking."


def test_llama3_json_parses_semicolon_separated_calls() -> None:
    result = get_tool_parser("llama3_json").parse(LLAMA_CALLS, final=True)
    assert _calls(result.tool_calls) == [("get_weather", {"city": "Rome"}), ("time", {})]
    assert result.content == ""


def test_llama3_json_prose_stays_content_and_a_named_truncated_call_is_a_call() -> None:
    parser = get_tool_parser("llama3_json")
    assert parser.parse("Hello {not a call}", final=True).content == "Hello {not a call}"
    truncated = parser.parse('{"name": "f", "par', final=True)
    assert _calls(truncated.tool_calls) == [("f", {})] and truncated.content == ""


def _stream(extractor: ToolCallExtractor, text: str, rng: random.Random) -> tuple[str, list]:
    content, pos = "", 0
    while pos < len(text):
        step = rng.randint(1, 7)
        delta = extractor.feed(text[pos : pos + step], final=pos + step >= len(text))
        content += delta.content
        pos += step
    if not extractor.finished:
        delta = extractor.feed("", final=True)
        content += delta.content
    return content, list(extractor.calls)


@pytest.mark.parametrize("parser_name", sorted(SAMPLES))
def test_streaming_matches_one_shot_parse_for_any_chunking(parser_name: str) -> None:
    parser = get_tool_parser(parser_name)
    for text in SAMPLES[parser_name]:
        expected_content, expected_calls = extract_all(ToolCallExtractor(parser), text)
        for seed in range(20):
            content, calls = _stream(ToolCallExtractor(parser), text, random.Random(seed))
            assert _calls(calls) == _calls(expected_calls), (text, seed)
            assert content == (expected_content or ""), (text, seed)


def test_streaming_never_shows_a_partial_tag_as_content() -> None:
    extractor = ToolCallExtractor(get_tool_parser("hermes"))
    shown = ""
    for char in QWEN_TWO_CALLS:
        shown += extractor.feed(char).content
        assert "<" not in shown
    assert extractor.feed("", final=True).content == ""


def test_forced_named_call_parses_the_models_arguments() -> None:
    parser = get_tool_parser("hermes")
    prefix = parser.forced_prefix("get_weather")
    assert prefix is not None
    extractor = ToolCallExtractor(parser, prefix, forced_function="get_weather")
    content, calls = extract_all(extractor, '{"city": "Lima"}}\n')
    assert content is None
    assert _calls(calls) == [("get_weather", {"city": "Lima"})]


def test_forced_named_call_keeps_unparseable_arguments_as_raw_text() -> None:
    parser = get_tool_parser("hermes")
    extractor = ToolCallExtractor(parser, parser.forced_prefix("f") or "", forced_function="f")
    content, calls = extract_all(extractor, "garbage words}")
    assert content is None
    assert [(call.name, call.arguments) for call in calls] == [("f", "garbage words")]


def test_hermes_forced_prefix_follows_the_templates_spacing() -> None:
    parser = get_tool_parser("hermes")
    parser.adapt_to_template("""{{- '<tool_call>\\n{"name": "' + name + '"}\\n</tool_call>' }}""")
    assert parser.forced_prefix("f") == '<tool_call>\n{"name": "f", "arguments": '
    parser.adapt_to_template("""{{- '<tool_call>{"name": "' + name + '"}</tool_call>' }}""")
    assert parser.forced_prefix("f") == '<tool_call>{"name": "f", "arguments": '
    assert parser.forced_prefix(None) == '<tool_call>{"name": "'


# ---- every format, streamed incrementally -----------------------------------------------------------

QWEN3_CODER_CALLS = (
    "I'll look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n<parameter=zip>\n01234\n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=get_time>\n</function>\n</tool_call>"
)
MISTRAL_LIST = 'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Nice"}}, {"name": "t", "arguments": {}}]'
MISTRAL_V11 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Lyon", "q": "a}b"}[TOOL_CALLS]get_time[ARGS]{}'
PYTHONIC_CALLS = '[get_weather(city="Rome", days=2), get_time(zone="UTC")]'
DEEPSEEK_V3_CALLS = (
    "ok<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
    '{"city": "Seoul"}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n'
    "{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
)
DEEPSEEK_V31_CALL = (
    '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Pune"}<｜tool▁call▁end｜>'
    "<｜tool▁calls▁end｜>"
)
HARMONY_CALL = (
    '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Bergen"}<|call|>'
)
HARMONY_FINAL = "<|channel|>final<|message|>It is sunny.<|return|>"

EXPECTED = {
    QWEN3_CODER_CALLS: (
        "qwen3_coder",
        "I'll look.",
        [("get_weather", {"city": "São Paulo", "days": 3, "zip": "01234"}), ("get_time", {})],
    ),
    MISTRAL_LIST: ("mistral", "Sure.", [("get_weather", {"city": "Nice"}), ("t", {})]),
    MISTRAL_V11: ("mistral", "", [("get_weather", {"city": "Lyon", "q": "a}b"}), ("get_time", {})]),
    PYTHONIC_CALLS: (
        "pythonic",
        "",
        [("get_weather", {"city": "Rome", "days": 2}), ("get_time", {"zone": "UTC"})],
    ),
    DEEPSEEK_V3_CALLS: ("deepseek_v3", "ok", [("get_weather", {"city": "Seoul"}), ("get_time", {})]),
    DEEPSEEK_V31_CALL: ("deepseek_v3", "", [("get_weather", {"city": "Pune"})]),
    HARMONY_CALL: ("openai", "", [("get_weather", {"city": "Bergen"})]),
    HARMONY_FINAL: ("openai", "It is sunny.", []),
    QWEN_TWO_CALLS: (
        "hermes",
        "Let me check both cities.",
        [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_weather", {"city": "Tōkyō"})],
    ),
    KIMI_CALLS: ("kimi_k2", "Sure.", [("get_weather", {"city": "Beijing"}), ("search", {"q": "x"})]),
    GLM_CALL: ("glm45", "Checking.", [("get_weather", {"city": "Oslo", "days": 3})]),
    LLAMA_CALLS: ("llama3_json", "", [("get_weather", {"city": "Rome"}), ("time", {})]),
}
STREAM_SAMPLES = [
    *((name, text) for text, (name, _, _) in EXPECTED.items()),
    ("pythonic", "[1, 2] is a list"),
    ("pythonic", "[get_weather(city='x'), broken("),
    ("mistral", "no calls"),
    ("openai", "plain text, no channels"),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": {"b": [1, "}"]}}}</tool_call>'),
    ("hermes", '<tool_call>{"arguments": {"a": 1}, "name": "late_name"}</tool_call>'),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": bad}}</tool_call> tail'),
    ("qwen3_coder", "<tool_call>\n<function=f>\n<parameter=a>\nunterminated"),
]
QWEN3_CODER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "zip": {"type": "string"},
                },
            },
        },
    }
]


def _parser(name: str) -> ToolParser:
    return get_tool_parser(name).for_request(QWEN3_CODER_TOOLS)


@pytest.mark.parametrize("text", list(EXPECTED), ids=[name for name, _, _ in EXPECTED.values()])
def test_each_format_gives_its_calls_and_content(text: str) -> None:
    name, content, calls = EXPECTED[text]
    got_content, got_calls = extract_all(ToolCallExtractor(_parser(name)), text)
    assert _calls(got_calls) == calls
    assert (got_content or "") == content


def test_every_required_format_is_registered() -> None:
    required = {
        "hermes",
        "qwen3_coder",
        "mistral",
        "llama3_json",
        "pythonic",
        "deepseek_v3",
        "kimi_k2",
        "glm45",
    }
    assert required | {"openai"} <= set(available_tool_parsers())


def _chunked(text: str, sizes: list[int]) -> list[str]:
    chunks, pos = [], 0
    for size in sizes:
        if pos >= len(text):
            break
        chunks.append(text[pos : pos + size])
        pos += size
    if pos < len(text):
        chunks.append(text[pos:])
    return chunks


def _stream_deltas(parser: ToolParser, chunks: list[str]) -> tuple[str, dict[int, dict]]:
    """Content and, per call index, the name/id of its first delta and its concatenated argument deltas."""
    extractor = ToolCallExtractor(parser)
    content = ""
    calls: dict[int, dict] = {}
    for k, chunk in enumerate(chunks):
        delta = extractor.feed(chunk, final=k == len(chunks) - 1)
        content += delta.content
        for call in delta.tool_calls:
            if call.name is not None:
                assert call.index not in calls, "a call's name and id come once, on its first delta"
                assert call.index == len(calls), "calls appear in order"
                calls[call.index] = {"name": call.name, "id": call.id, "arguments": ""}
            calls[call.index]["arguments"] += call.arguments
    return content, calls


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sample=st.sampled_from(STREAM_SAMPLES),
    sizes=st.lists(st.integers(min_value=1, max_value=12), max_size=200),
)
def test_any_split_gives_the_same_calls_and_the_same_concatenated_deltas(
    sample: tuple[str, str], sizes: list[int]
) -> None:
    name, text = sample
    one_shot = ToolCallExtractor(_parser(name))
    expected_content, expected_calls = extract_all(one_shot, text)
    content, calls = _stream_deltas(_parser(name), _chunked(text, sizes))
    assert content == (expected_content or "")
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (call.name, call.arguments) for call in expected_calls
    ]


@pytest.mark.parametrize("name, text", STREAM_SAMPLES)
def test_arguments_stream_in_several_deltas_when_fed_a_character_at_a_time(name: str, text: str) -> None:
    extractor = ToolCallExtractor(_parser(name))
    argument_deltas = 0
    for k, char in enumerate(text):
        delta = extractor.feed(char, final=k == len(text) - 1)
        argument_deltas += sum(1 for call in delta.tool_calls if call.arguments)
    _, expected_calls = extract_all(ToolCallExtractor(_parser(name)), text)
    _, calls = _stream_deltas(_parser(name), list(text))
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (call.name, call.arguments) for call in expected_calls
    ]
    long_json_args = [c for c in extractor.calls if len(c.arguments) > 8 and name not in ("pythonic",)]
    if long_json_args:
        assert argument_deltas > len(extractor.calls), "arguments of a call arrive in more than one delta"
