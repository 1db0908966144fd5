"""Multi-turn traces for `bench_speculative.py`: an agentic coding loop and plain chat.

Agentic: a coding agent with three tools fixes a bug. Turn 1 asks it to read the file; the tool's answer
(the whole file) comes back; turn 2 is its edit; the test tool echoes the call's path and output; turn 3 is
its report; then the user asks for the whole file again with a docstring added (turn 4), the re-emitted code
edit. Every turn's prompt is the whole history so far, rendered by the model's chat template, so each
answer is part of the next prompt (the closed loop). Chat: two turns of small talk and explanations.

Both are closed loops over the model's own greedy answers: every configuration of a run sees the same
prompts only when its answers are the same, which lossless speculation guarantees (the benchmark checks).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {key: {"type": "string"} for key in keys},
                "required": list(keys),
            },
        },
    }
    for name, description, keys in (
        ("read_file", "Read a file of the repository", ("path",)),
        ("write_file", "Replace a file's content", ("path", "content")),
        ("run_tests", "Run the tests of a file", ("path",)),
    )
]

SYSTEM = (
    "You are a coding agent working in a Python repository. Call a tool by answering "
    '<tool_call>{"name": ..., "arguments": {...}}</tool_call> with one of: '
    + ", ".join(json.dumps(t["function"]) for t in TOOLS)
)

FILES = [
    (
        "src/stats.py",
        "mean",
        "mean() divides by len(values) - 1",
        """import math


def mean(values):
    total = 0.0
    for value in values:
        total += value
    return total / (len(values) - 1)


def stdev(values):
    center = mean(values)
    squares = [(value - center) ** 2 for value in values]
    return math.sqrt(sum(squares) / len(values))
""",
    ),
    (
        "src/paths.py",
        "join",
        "join() drops the last part",
        """def join(*parts):
    cleaned = [part.strip("/") for part in parts if part]
    return "/".join(cleaned[:-1])


def parent(path):
    head, _, _ = path.rpartition("/")
    return head or "/"
""",
    ),
    (
        "src/cache.py",
        "get",
        "get() never returns the cached value",
        """class Cache:
    def __init__(self, capacity):
        self.capacity = capacity
        self.items = {}

    def get(self, key, default=None):
        if key in self.items:
            value = self.items.pop(key)
            self.items[key] = value
        return default

    def put(self, key, value):
        self.items.pop(key, None)
        self.items[key] = value
        if len(self.items) > self.capacity:
            self.items.pop(next(iter(self.items)))
""",
    ),
    (
        "src/text.py",
        "word_count",
        "word_count() counts spaces, not words",
        """def word_count(text):
    return text.count(" ")


def title(text):
    return " ".join(word.capitalize() for word in text.split())
""",
    ),
]

CHAT = [
    ("What's a good name for a grey cat?", "Why that one?"),
    ("Explain what a hash table is in two sentences.", "And when is it slow?"),
    ("How do I boil an egg?", "How long for a soft one?"),
    ("Tell me a short joke about computers.", "Another one, please."),
    ("What is the capital of France?", "What is it famous for?"),
    ("Give me three tips for writing clear emails.", "Which one matters most?"),
    ("What does HTTP stand for?", "What does the S in HTTPS add?"),
    ("Suggest a weekend hobby.", "How do I start?"),
]


@dataclass
class Conversation:
    """A closed-loop conversation: `next_prompt` gives the messages up to the next model turn."""

    kind: str
    index: int
    messages: list[dict[str, Any]] = field(default_factory=list)
    turn: int = 0

    @property
    def num_turns(self) -> int:
        return 4 if self.kind == "agentic" else 2

    def start(self) -> list[dict[str, Any]]:
        if self.kind == "agentic":
            path, _, bug, _ = FILES[self.index % len(FILES)]
            self.messages = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Fix the bug in {path}: {bug}. Read the file first."},
            ]
        else:
            first, _ = CHAT[self.index % len(CHAT)]
            self.messages = [{"role": "user", "content": first}]
        return self.messages

    def answered(self, text: str) -> list[dict[str, Any]] | None:
        """Add the model's answer; the messages for the next turn (None: the conversation is over)."""
        self.messages.append({"role": "assistant", "content": text})
        self.turn += 1
        if self.turn >= self.num_turns:
            return None
        if self.kind == "chat":
            self.messages.append({"role": "user", "content": CHAT[self.index % len(CHAT)][1]})
            return self.messages
        path, function, _, source = FILES[self.index % len(FILES)]
        if self.turn == 1:
            self.messages.append({"role": "tool", "content": source})
        elif self.turn == 2:
            result = {"path": path, "passed": 3, "failed": 0, "output": f"{path}::test_{function} PASSED"}
            self.messages.append({"role": "tool", "content": json.dumps(result)})
        else:
            self.messages.append(
                {
                    "role": "user",
                    "content": f"Add a docstring to {function}() and show me the whole of {path} again.",
                }
            )
        return self.messages


def conversations(kind: str, count: int) -> list[Conversation]:
    if kind not in ("agentic", "chat"):
        raise ValueError(f"unknown trace {kind!r}")
    return [Conversation(kind, i) for i in range(count)]
