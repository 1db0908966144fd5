"""Workloads: what requests a benchmark sends, as jobs the load shape schedules.

A job is one request (random, shared-prefix, replay) or one whole agent session (agentic): the
session's next turn depends on the server's previous answer, so a job drives its own requests
through the `send` callback it is given. Workloads register by name in `WORKLOADS`.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hearth.bench.client import CHAT, COMPLETIONS, RequestResult, RequestSpec
from hearth.bench.textgen import TextSource, TokenizerTextSource
from hearth.contracts.registry import Registry

Send = Callable[[RequestSpec], Awaitable[RequestResult]]


@dataclass
class Job:
    """One unit of load. `run(send)` sends `num_requests` requests (fewer if one fails).
    `arrival_s`, when set (replay), is when the job starts relative to the run's start."""

    run: Callable[[Send], Awaitable[None]]
    num_requests: int
    arrival_s: float | None = None


class Workload(ABC):
    """Builds the jobs of one benchmark run. Contract: `jobs()` is deterministic for a given
    seed and round index."""

    name: str = ""
    default_endpoint: str = COMPLETIONS

    @abstractmethod
    def jobs(self, endpoint: str, round_index: int = 0) -> list[Job]:
        """Fresh jobs; a sweep passes each load point its own `round_index` so that its prompts
        differ from the previous point's and the server's cache starts cold."""


def _round_seed(seed: int, round_index: int) -> int:
    return seed + 1_000_003 * round_index


def _single(spec: RequestSpec) -> Job:
    async def run(send: Send) -> None:
        await send(spec)

    return Job(run=run, num_requests=1)


def _prompt_kind(text_source: TextSource, prompt_format: str) -> str:
    if prompt_format != "auto":
        return prompt_format
    # With the server's tokenizer, text has exact lengths; without it, token ids do.
    return "text" if isinstance(text_source, TokenizerTextSource) else "token-ids"


def _request(
    endpoint: str, kind: str, text: str, ids: list[int], num_tokens: int, max_tokens: int
) -> RequestSpec:
    if endpoint == CHAT:
        return RequestSpec(
            endpoint=CHAT,
            max_tokens=max_tokens,
            messages=[{"role": "user", "content": text}],
            planned_input_tokens=num_tokens,
        )
    prompt: str | list[int] = ids if kind == "token-ids" else text
    return RequestSpec(
        endpoint=COMPLETIONS, max_tokens=max_tokens, prompt=prompt, planned_input_tokens=num_tokens
    )


def _lengths(mean_tokens: int, range_ratio: float, count: int, rng: random.Random) -> list[int]:
    low = max(1, math.floor(mean_tokens * (1 - range_ratio)))
    high = max(low, math.ceil(mean_tokens * (1 + range_ratio)))
    return [rng.randint(low, high) for _ in range(count)]


@dataclass(frozen=True)
class RandomConfig:
    num_prompts: int = 100
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0
    prompt_format: str = "auto"  # auto | text | token-ids
    seed: int = 0


class RandomWorkload(Workload):
    """Independent prompts with uniformly random lengths around the means (as `vllm bench serve`)."""

    name = "random"

    def __init__(self, config: RandomConfig, text_source: TextSource) -> None:
        if not 0 <= config.range_ratio < 1:
            raise ValueError("--random-range-ratio must be in [0, 1)")
        self.config = config
        self.text_source = text_source

    def jobs(self, endpoint: str, round_index: int = 0) -> list[Job]:
        c = self.config
        rng = random.Random(_round_seed(c.seed, round_index))
        kind = _prompt_kind(self.text_source, c.prompt_format)
        input_lens = _lengths(c.input_len, c.range_ratio, c.num_prompts, rng)
        output_lens = _lengths(c.output_len, c.range_ratio, c.num_prompts, rng)
        jobs = []
        for input_len, output_len in zip(input_lens, output_lens, strict=True):
            if kind == "token-ids" and endpoint == COMPLETIONS:
                ids, text = self.text_source.token_ids(input_len, rng), ""
            else:
                ids, text = [], self.text_source.text(input_len, rng)
            jobs.append(_single(_request(endpoint, kind, text, ids, input_len, output_len)))
        return jobs


@dataclass(frozen=True)
class SharedPrefixConfig:
    num_prompts: int = 100
    num_prefixes: int = 4
    prefix_len: int = 1024
    suffix_len: int = 128
    output_len: int = 64
    prompt_format: str = "auto"
    seed: int = 0


class SharedPrefixWorkload(Workload):
    """Groups of requests that share a long prefix and differ in a short suffix, shuffled."""

    name = "shared-prefix"

    def __init__(self, config: SharedPrefixConfig, text_source: TextSource) -> None:
        if config.num_prefixes < 1:
            raise ValueError("--num-prefixes must be at least 1")
        self.config = config
        self.text_source = text_source

    def jobs(self, endpoint: str, round_index: int = 0) -> list[Job]:
        c = self.config
        rng = random.Random(_round_seed(c.seed, round_index))
        kind = _prompt_kind(self.text_source, c.prompt_format)
        use_ids = kind == "token-ids" and endpoint == COMPLETIONS
        num_tokens = c.prefix_len + c.suffix_len
        prefixes = [
            (self.text_source.token_ids(c.prefix_len, rng), self.text_source.text(c.prefix_len, rng))
            for _ in range(c.num_prefixes)
        ]
        specs = []
        for i in range(c.num_prompts):
            prefix_ids, prefix_text = prefixes[i % c.num_prefixes]
            if use_ids:
                spec = _request(
                    endpoint, kind, "", prefix_ids + self.text_source.token_ids(c.suffix_len, rng),
                    num_tokens, c.output_len,
                )  # fmt: skip
            else:
                text = prefix_text + "\n" + self.text_source.text(c.suffix_len, rng)
                spec = _request(endpoint, kind, text, [], num_tokens, c.output_len)
            specs.append(spec)
        rng.shuffle(specs)
        return [_single(spec) for spec in specs]


def render_messages_as_text(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    """Flatten a chat for /v1/completions: plain role-prefixed blocks, tools as JSON up front."""
    blocks = []
    if tools:
        blocks.append("tools: " + json.dumps(tools, separators=(",", ":")))
    for message in messages:
        content = message.get("content") or ""
        if message.get("tool_calls"):
            content += " " + json.dumps(message["tool_calls"], separators=(",", ":"))
        blocks.append(f"{message['role']}: {content}")
    blocks.append("assistant:")
    return "\n\n".join(blocks)


@dataclass(frozen=True)
class AgenticConfig:
    num_sessions: int = 16
    turns_per_session: int = 6
    system_prompt_len: int = 1024
    num_tools: int = 8
    tool_description_len: int = 64
    user_turn_len: int = 128
    tool_result_len: int = 256
    output_len: int = 48
    tool_call_ratio: float = 0.5  # share of turns (before the last) that end in a tool call
    think_time_s: float = 0.5  # mean of an exponential pause between turns (tool run / user)
    affinity_share: float = 1.0  # share of sessions that send x-session-affinity
    seed: int = 0


AFFINITY_HEADER = "x-session-affinity"


class AgenticWorkload(Workload):
    """Synthetic agent sessions. Every session shares one system prompt and one set of tool
    schemas; each turn re-sends the whole history plus a new user or tool-result message; the
    server's answers join the history, with synthetic tool calls on tool-call turns."""

    name = "agentic"
    default_endpoint = CHAT

    def __init__(self, config: AgenticConfig, text_source: TextSource) -> None:
        if config.turns_per_session < 1 or config.num_sessions < 1:
            raise ValueError("agentic needs at least one session and one turn per session")
        for share_name in ("tool_call_ratio", "affinity_share"):
            if not 0 <= getattr(config, share_name) <= 1:
                raise ValueError(f"--{share_name.replace('_', '-')} must be in [0, 1]")
        self.config = config
        self.text_source = text_source

    def _tools(self, rng: random.Random) -> list[dict[str, Any]]:
        return [
            {
                "type": "function",
                "function": {
                    "name": f"tool_{i}",
                    "description": self.text_source.text(self.config.tool_description_len, rng),
                    "parameters": {
                        "type": "object",
                        "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
                        "required": ["query"],
                    },
                },
            }
            for i in range(self.config.num_tools)
        ]

    def jobs(self, endpoint: str, round_index: int = 0) -> list[Job]:
        c = self.config
        rng = random.Random(_round_seed(c.seed, round_index))
        system_prompt = self.text_source.text(c.system_prompt_len, rng)
        tools = self._tools(rng)
        num_affine = round(c.affinity_share * c.num_sessions)
        return [
            Job(
                run=self._session_runner(
                    endpoint, f"session-{i}", i < num_affine, system_prompt, tools, rng.randrange(2**32)
                ),
                num_requests=c.turns_per_session,
            )
            for i in range(c.num_sessions)
        ]

    def _session_runner(
        self,
        endpoint: str,
        session_id: str,
        affine: bool,
        system_prompt: str,
        tools: list[dict[str, Any]],
        seed: int,
    ) -> Callable[[Send], Awaitable[None]]:
        c = self.config

        async def run(send: Send) -> None:
            rng = random.Random(seed)
            headers = {AFFINITY_HEADER: session_id} if affine else {}
            history: list[dict[str, Any]] = [{"role": "system", "content": system_prompt}]
            new_messages: list[dict[str, Any]] = [
                {"role": "user", "content": self.text_source.text(c.user_turn_len, rng)}
            ]
            for turn in range(c.turns_per_session):
                history.extend(new_messages)
                planned = c.system_prompt_len + c.num_tools * c.tool_description_len
                planned += sum(self.text_source.count_tokens(m.get("content") or "") for m in history[1:])
                spec = RequestSpec(
                    endpoint=endpoint,
                    max_tokens=c.output_len,
                    headers=headers,
                    session_id=session_id,
                    turn=turn,
                    planned_input_tokens=planned,
                )
                if endpoint == CHAT:
                    spec.messages = [dict(m) for m in history]
                    spec.tools = tools
                else:
                    spec.prompt = render_messages_as_text(history, tools)
                result = await send(spec)
                if not result.success:
                    return  # a broken session cannot go on; the failure is already recorded
                is_last = turn == c.turns_per_session - 1
                calls = result.tool_calls
                if not calls and not is_last and rng.random() < c.tool_call_ratio:
                    calls = [self._synthetic_call(session_id, turn, rng)]
                assistant: dict[str, Any] = {"role": "assistant", "content": result.generated_text}
                if calls:
                    assistant["tool_calls"] = calls
                history.append(assistant)
                if is_last:
                    return
                if calls:
                    new_messages = [
                        {
                            "role": "tool",
                            "tool_call_id": call.get("id") or f"call_{session_id}_{turn}_{k}",
                            "content": self.text_source.text(c.tool_result_len, rng),
                        }
                        for k, call in enumerate(calls)
                    ]
                else:
                    new_messages = [{"role": "user", "content": self.text_source.text(c.user_turn_len, rng)}]
                if c.think_time_s > 0:
                    await asyncio.sleep(rng.expovariate(1.0 / c.think_time_s))

        return run

    def _synthetic_call(self, session_id: str, turn: int, rng: random.Random) -> dict[str, Any]:
        arguments = {"query": self.text_source.text(8, rng), "limit": rng.randint(1, 50)}
        return {
            "id": f"call_{session_id}_{turn}",
            "type": "function",
            "function": {"name": f"tool_{rng.randrange(max(1, self.config.num_tools))}",
                         "arguments": json.dumps(arguments)},
        }  # fmt: skip


@dataclass(frozen=True)
class ReplayConfig:
    trace_path: str
    speed: float = 1.0  # >1 replays faster than recorded
    num_prompts: int | None = None  # first N lines only
    default_output_len: int = 64
    prompt_format: str = "auto"
    seed: int = 0


class ReplayWorkload(Workload):
    """Replays a JSONL trace. Each line: `timestamp` (s), optional `session_id`, and either
    `messages` (sent as-is), `prompt`, or `input_tokens` (random text of that length; within a
    session it extends the session's previous prompt, so histories grow as in the original),
    plus `output_tokens` or `max_tokens`."""

    name = "replay"
    default_endpoint = CHAT

    def __init__(self, config: ReplayConfig, text_source: TextSource) -> None:
        if config.speed <= 0:
            raise ValueError("--replay-speed must be positive")
        self.config = config
        self.text_source = text_source
        self.records = self._load(Path(config.trace_path))

    def _load(self, path: Path) -> list[dict[str, Any]]:
        if not path.is_file():
            raise FileNotFoundError(f"trace file {path} not found")
        records = []
        with path.open() as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as exc:
                    raise ValueError(f"{path}:{line_no}: not JSON ({exc})") from exc
                if not isinstance(record, dict) or "timestamp" not in record:
                    raise ValueError(f"{path}:{line_no}: each line needs a 'timestamp'")
                if not any(key in record for key in ("messages", "prompt", "input_tokens")):
                    raise ValueError(f"{path}:{line_no}: needs 'messages', 'prompt' or 'input_tokens'")
                records.append(record)
        records.sort(key=lambda r: float(r["timestamp"]))
        if self.config.num_prompts is not None:
            records = records[: self.config.num_prompts]
        if not records:
            raise ValueError(f"trace file {path} has no requests")
        return records

    def jobs(self, endpoint: str, round_index: int = 0) -> list[Job]:
        c = self.config
        rng = random.Random(_round_seed(c.seed, round_index))
        kind = _prompt_kind(self.text_source, c.prompt_format)
        start_s = float(self.records[0]["timestamp"])
        session_prompts: dict[str, tuple[str, list[int], int]] = {}
        jobs = []
        for index, record in enumerate(self.records):
            session_id = str(record.get("session_id", f"request-{index}"))
            max_tokens = int(record.get("output_tokens") or record.get("max_tokens") or c.default_output_len)
            tools = record.get("tools")
            if "messages" in record:
                messages = record["messages"]
                spec = RequestSpec(endpoint=endpoint, max_tokens=max_tokens, session_id=session_id)
                if endpoint == CHAT:
                    spec.messages, spec.tools = messages, tools
                else:
                    spec.prompt = render_messages_as_text(messages, tools)
            elif "prompt" in record:
                text = str(record["prompt"])
                spec = _request(endpoint, "text", text, [], self.text_source.count_tokens(text), max_tokens)
            else:
                num_tokens = int(record["input_tokens"])
                old_text, old_ids, old_len = session_prompts.get(session_id, ("", [], 0))
                extra_len = max(0, num_tokens - old_len)
                text = (old_text + " " + self.text_source.text(extra_len, rng)).strip()
                ids = (old_ids + self.text_source.token_ids(extra_len, rng))[:num_tokens]
                session_prompts[session_id] = (text, ids, max(num_tokens, old_len))
                spec = _request(endpoint, kind, text, ids, num_tokens, max_tokens)
            spec.session_id = session_id
            job = _single(spec)
            job.arrival_s = (float(record["timestamp"]) - start_s) / c.speed
            jobs.append(job)
        return jobs


WORKLOADS: Registry[type[Workload]] = Registry("workload")
for _workload in (RandomWorkload, SharedPrefixWorkload, AgenticWorkload, ReplayWorkload):
    WORKLOADS.add(_workload.name, _workload)
