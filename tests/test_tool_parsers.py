"""Tool-call parsers on model-like text, and the streaming extractor against the one-shot parse."""

from __future__ import annotations

import json
import random

import pytest

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
    assert parser.parse(text, final=False).tool_calls == []
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


def test_llama3_json_prose_and_broken_json_stay_content() -> None:
    parser = get_tool_parser("llama3_json")
    assert parser.parse("Hello {not a call}", final=True).content == "Hello {not a call}"
    broken = parser.parse('{"name": "f", "par', final=True)
    assert broken.tool_calls == [] and broken.content == '{"name": "f", "par'


def _stream(extractor: ToolCallExtractor, text: str, rng: random.Random) -> tuple[str, list]:
    content, calls, pos = "", [], 0
    while pos < len(text):
        step = rng.randint(1, 7)
        delta = extractor.feed(text[pos : pos + step], final=pos + step >= len(text))
        content += delta.content
        calls += delta.tool_calls
        pos += step
    if not extractor.finished:
        delta = extractor.feed("", final=True)
        content += delta.content
        calls += delta.tool_calls
    return content, calls


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
