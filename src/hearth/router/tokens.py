"""Prompt text and token estimates, from an OpenAI request body, without torch or transformers.

The router never renders the chat template: it only needs a stable text per prompt (so equal
prefixes give equal keys) and a token count good enough to compare loads.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

CHARS_PER_TOKEN = 4


def prompt_text(body: dict[str, Any]) -> str:
    """The prompt as one string: chat messages (role-tagged) and tools, or the completion prompt; Anthropic
    Messages (`system` first) and Responses (`instructions`, then the `input` items) likewise."""
    messages = body.get("messages")
    if messages is None and "input" in body:
        return _responses_text(body)
    if isinstance(messages, list):
        parts: list[str] = []
        tools = body.get("tools")
        if tools:
            # Tools render before the history in every common template, so they belong to the prefix.
            parts.append(json.dumps(tools, sort_keys=True, separators=(",", ":")))
        system = body.get("system")
        if system:
            parts.append(f"<|system|>{_content_text({'content': system})}")
        for message in messages:
            if isinstance(message, dict):
                parts.append(f"<|{message.get('role', '')}|>{_content_text(message)}")
        return "\n".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return prompt[0]
    return ""


def _responses_text(body: dict[str, Any]) -> str:
    parts: list[str] = []
    if body.get("tools"):
        parts.append(json.dumps(body["tools"], sort_keys=True, separators=(",", ":")))
    if isinstance(body.get("instructions"), str):
        parts.append(f"<|system|>{body['instructions']}")
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    for item in items if isinstance(items, list) else []:
        if isinstance(item, dict):
            text = _content_text(item) or str(item.get("output") or item.get("arguments") or "")
            parts.append(f"<|{item.get('role') or item.get('type', '')}|>{text}")
    return "\n".join(parts)


def prompt_token_ids(body: dict[str, Any]) -> list[int] | None:
    """Token ids when the client sent them (`prompt` as a list of ints), else None."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt[:8]):
        return prompt
    return None


def _content_text(message: dict[str, Any]) -> str:
    content = message.get("content")
    text = ""
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        text = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    calls = message.get("tool_calls")
    if calls:
        text += json.dumps(calls, sort_keys=True, separators=(",", ":"))
    return text


def max_output_tokens(body: dict[str, Any], default_tokens: int = 256) -> int:
    for field in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        value = body.get(field)
        if isinstance(value, int) and value > 0:
            return value
    return default_tokens


class TokenEstimator(ABC):
    """Turns prompt text into a token count and, when it can, token ids.

    Contract: `count(text)` is cheap and never fails; `encode(text)` returns the ids a real
    tokenizer would give, or None when this estimator has no vocabulary.
    """

    name: str

    @abstractmethod
    def count(self, text: str) -> int: ...

    @abstractmethod
    def encode(self, text: str) -> list[int] | None: ...


class CharEstimator(TokenEstimator):
    """chars/4: within ~20% for English and code, and costs nothing."""

    name = "chars"

    def count(self, text: str) -> int:
        return (len(text) + CHARS_PER_TOKEN - 1) // CHARS_PER_TOKEN

    def encode(self, text: str) -> list[int] | None:
        return None


class TokenizerEstimator(TokenEstimator):
    """The checkpoint's own `tokenizer.json` through the `tokenizers` library (Rust, no torch)."""

    name = "tokenizer"

    def __init__(self, tokenizer_dir: str | Path) -> None:
        from tokenizers import Tokenizer

        path = Path(tokenizer_dir)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"--tokenizer: no tokenizer.json at {path}")
        self._tokenizer = Tokenizer.from_file(str(path))

    def count(self, text: str) -> int:
        return len(self.encode(text))

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids


def make_estimator(tokenizer_dir: str | None) -> TokenEstimator:
    return TokenizerEstimator(tokenizer_dir) if tokenizer_dir else CharEstimator()
