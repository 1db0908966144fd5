"""The reasoning-parser contract, the registry, and the streaming extractor over it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from hearth.contracts.registry import Registry


@dataclass
class ReasoningResult:
    reasoning: str
    content: str


class ReasoningParser(ABC):
    """Splits one model output into reasoning and content.

    Contract: `parse(text, final, in_reasoning)` is called on growing prefixes of the output and is monotone:
    for a longer prefix, both `reasoning` and `content` extend the earlier ones; undecided text (a half-written
    tag) is left out until it is decided. `in_reasoning` says the prompt already opened the thinking block (a
    template that ends the generation prompt with `<think>`), so the answer starts inside it.
    """

    name: ClassVar[str]
    needs_special_tokens: ClassVar[bool] = False

    @abstractmethod
    def parse(self, text: str, final: bool, in_reasoning: bool) -> ReasoningResult: ...

    def starts_in_reasoning(self, prompt_text: str) -> bool:
        """Whether an answer to this rendered prompt starts inside the thinking block."""
        return False


REASONING_PARSERS: Registry[type[ReasoningParser]] = Registry("reasoning parser")
REASONING_PARSERS.add("deepseek_r1", "hearth.server.reasoning_parsers.think:DeepSeekR1ReasoningParser")
REASONING_PARSERS.add("qwen3", "hearth.server.reasoning_parsers.think:Qwen3ReasoningParser")
REASONING_PARSERS.add("glm45", "hearth.server.reasoning_parsers.think:Glm45ReasoningParser")
REASONING_PARSERS.add("kimi_k2", "hearth.server.reasoning_parsers.think:KimiK2ReasoningParser")
REASONING_PARSERS.add("openai_gptoss", "hearth.server.reasoning_parsers.harmony:HarmonyReasoningParser")


def register_reasoning_parser(name: str) -> Callable[[type[ReasoningParser]], type[ReasoningParser]]:
    """Class decorator for a parser defined outside this package."""
    return REASONING_PARSERS.register(name)


def available_reasoning_parsers() -> list[str]:
    return list(REASONING_PARSERS.names())


def get_reasoning_parser(name: str) -> ReasoningParser:
    """A new parser for `name`; an UnknownNameError naming the known ones otherwise."""
    return REASONING_PARSERS.get(name)()


class ReasoningExtractor:
    """Feed text deltas, get (reasoning delta, content delta)."""

    def __init__(self, parser: ReasoningParser, in_reasoning: bool = False) -> None:
        self.parser = parser
        self.in_reasoning = in_reasoning
        self._text = ""
        self._sent_reasoning = 0
        self._sent_content = 0
        self.reasoning = ""  # everything so far
        self.finished = False

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        if self.finished:
            raise RuntimeError("feed() after the final delta")
        self.finished = final
        self._text += delta
        result = self.parser.parse(self._text, final, self.in_reasoning)
        new_reasoning = result.reasoning[self._sent_reasoning :]
        new_content = result.content[self._sent_content :]
        self._sent_reasoning = max(self._sent_reasoning, len(result.reasoning))
        self._sent_content = max(self._sent_content, len(result.content))
        self.reasoning = result.reasoning
        return new_reasoning, new_content
