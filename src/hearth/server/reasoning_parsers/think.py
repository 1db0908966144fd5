"""`<think>...</think>` reasoning: DeepSeek-R1, Qwen3, GLM-4.5, Kimi K2."""

from __future__ import annotations

from typing import ClassVar

from hearth.server.reasoning_parsers.base import ReasoningParser, ReasoningResult
from hearth.server.text_markers import hold_back


class ThinkReasoningParser(ReasoningParser):
    start_tag: ClassVar[str] = "<think>"
    end_tag: ClassVar[str] = "</think>"
    # Markers that end the reasoning without an end tag, and start the content (Kimi K2's tool section).
    implicit_ends: ClassVar[tuple[str, ...]] = ()
    # True: an answer is reasoning until the end tag even without a start tag (R1's templates put `<think>`
    # in the prompt, older ones leave it to the model); an answer that never closes it is all reasoning.
    always_starts_in_reasoning: ClassVar[bool] = False

    def starts_in_reasoning(self, prompt_text: str) -> bool:
        return self.always_starts_in_reasoning or prompt_text.rstrip().endswith(self.start_tag)

    def parse(self, text: str, final: bool, in_reasoning: bool) -> ReasoningResult:
        stripped = text.lstrip()
        if stripped.startswith(self.start_tag):
            body = stripped[len(self.start_tag) :]
        elif not final and self.start_tag.startswith(stripped):
            return ReasoningResult("", "")  # a start tag (or only whitespace) so far
        elif in_reasoning or self.always_starts_in_reasoning:
            body = text
        else:
            return ReasoningResult("", text)
        ends = (self.end_tag, *self.implicit_ends)
        found = [(body.find(marker), marker) for marker in ends if marker in body]
        if not found:
            reasoning = body if final else hold_back(body, ends)
            return ReasoningResult(_trim(reasoning, final), "")
        index, marker = min(found)
        content = body[index + len(marker) :] if marker == self.end_tag else body[index:]
        return ReasoningResult(_trim(body[:index], True), content.lstrip())


def _trim(reasoning: str, final: bool) -> str:
    # Whitespace right after `<think>` and before `</think>` is layout, not reasoning; trailing whitespace is
    # held back while streaming because it may turn out to be that.
    return reasoning.strip() if final else reasoning.lstrip().rstrip()


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    name = "deepseek_r1"
    always_starts_in_reasoning = True


class Qwen3ReasoningParser(ThinkReasoningParser):
    name = "qwen3"


class Glm45ReasoningParser(ThinkReasoningParser):
    name = "glm45"


class KimiK2ReasoningParser(ThinkReasoningParser):
    name = "kimi_k2"
    implicit_ends = ("<|tool_calls_section_begin|>",)
