"""Reasoning parsers: thinking split from the answer, the same however the output is streamed."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hearth.server.output_parsing import OutputParser
from hearth.server.reasoning_parsers import (
    ReasoningExtractor,
    available_reasoning_parsers,
    get_reasoning_parser,
)
from hearth.server.tool_calls import ToolCallExtractor
from hearth.server.tool_parsers import get_tool_parser

CASES = [
    # (parser, prompt ends inside <think>, output, reasoning, content)
    ("qwen3", False, "<think>\nThe user wants X.\n</think>\n\nHere is X.", "The user wants X.", "Here is X."),
    ("qwen3", False, "No thinking here.", "", "No thinking here."),
    ("qwen3", True, "Hmm, X.\n</think>\n\nX it is.", "Hmm, X.", "X it is."),
    ("deepseek_r1", False, "Let me think</think>The answer is 4.", "Let me think", "The answer is 4."),
    ("deepseek_r1", False, "<think>cut off mid-tho", "cut off mid-tho", ""),
    ("glm45", False, "<think>plan</think>done", "plan", "done"),
    (
        "kimi_k2",
        False,
        "<think>call a tool<|tool_calls_section_begin|><|tool_call_begin|>",
        "call a tool",
        "<|tool_calls_section_begin|><|tool_call_begin|>",
    ),
    (
        "openai_gptoss",
        False,
        "<|channel|>analysis<|message|>Think hard.<|end|><|start|>assistant<|channel|>final<|message|>Hi!<|return|>",
        "Think hard.",
        "<|start|>assistant<|channel|>final<|message|>Hi!<|return|>",
    ),
]


def test_required_reasoning_parsers_are_registered() -> None:
    assert {"deepseek_r1", "qwen3", "kimi_k2", "glm45"} <= set(available_reasoning_parsers())
    with pytest.raises(KeyError, match="choose one of"):
        get_reasoning_parser("nope")


@pytest.mark.parametrize("name, in_reasoning, text, reasoning, content", CASES)
def test_splits_reasoning_from_content(
    name: str, in_reasoning: bool, text: str, reasoning: str, content: str
) -> None:
    extractor = ReasoningExtractor(get_reasoning_parser(name), in_reasoning)
    assert extractor.feed(text, final=True) == (reasoning, content)


def test_a_prompt_that_opens_think_starts_the_answer_in_reasoning() -> None:
    parser = get_reasoning_parser("qwen3")
    assert parser.starts_in_reasoning("<|im_start|>assistant\n<think>\n")
    assert not parser.starts_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=st.sampled_from(CASES), sizes=st.lists(st.integers(min_value=1, max_value=9), max_size=100))
def test_any_split_gives_the_same_reasoning_and_content(case: tuple, sizes: list[int]) -> None:
    name, in_reasoning, text, reasoning, content = case
    extractor = ReasoningExtractor(get_reasoning_parser(name), in_reasoning)
    got_reasoning = got_content = ""
    pos = 0
    chunks = []
    for size in sizes:
        chunks.append(text[pos : pos + size])
        pos += size
    chunks.append(text[pos:])
    for k, chunk in enumerate(chunks):
        r, c = extractor.feed(chunk, final=k == len(chunks) - 1)
        got_reasoning += r
        got_content += c
    assert (got_reasoning, got_content) == (reasoning, content)


def test_reasoning_then_a_tool_call_streams_both() -> None:
    text = '<think>need weather</think>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    parser = OutputParser(get_reasoning_parser("qwen3"), False, ToolCallExtractor(get_tool_parser("hermes")))
    reasoning, arguments, names = "", "", []
    for k, char in enumerate(text):
        delta = parser.feed(char, final=k == len(text) - 1)
        reasoning += delta.reasoning
        assert "<" not in delta.content
        for call in delta.tool_calls:
            names += [call.name] if call.name else []
            arguments += call.arguments
    assert reasoning == "need weather"
    assert names == ["get_weather"] and arguments == '{"city": "Oslo"}'
