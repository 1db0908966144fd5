"""Workloads: request shapes, agentic sessions that re-send their history, replay traces, load shapes."""

from __future__ import annotations

import json
import math
import random

import pytest

from hearth.bench.client import CHAT, COMPLETIONS, ClientOptions
from hearth.bench.fake_server import STATE_KEY, FakeServerConfig, start_fake_server
from hearth.bench.runner import LoadShape, arrival_times_s, run_jobs
from hearth.bench.textgen import TokenizerTextSource, WordTextSource
from hearth.bench.workloads import (
    AFFINITY_HEADER,
    AgenticConfig,
    AgenticWorkload,
    RandomConfig,
    RandomWorkload,
    ReplayConfig,
    ReplayWorkload,
    SharedPrefixConfig,
    SharedPrefixWorkload,
)


@pytest.fixture
async def server():
    runner, url = await start_fake_server(FakeServerConfig())
    yield url, runner.app[STATE_KEY]
    await runner.cleanup()


async def _run(url, jobs, shape=LoadShape()):
    return await run_jobs(jobs, shape, ClientOptions(base_url=url, model="m"))


async def test_agentic_sessions_resend_their_whole_history(server):
    url, state = server
    config = AgenticConfig(
        num_sessions=3, turns_per_session=4, system_prompt_len=40, num_tools=2, user_turn_len=10,
        tool_result_len=12, output_len=5, tool_call_ratio=0.5, think_time_s=0.0, affinity_share=1.0, seed=3,
    )  # fmt: skip
    outcome = await _run(url, AgenticWorkload(config, WordTextSource()).jobs(CHAT))
    assert len(outcome.results) == 12 and all(r.success for r in outcome.results)
    by_session: dict[str, list[dict]] = {}
    for request in state.requests:
        by_session.setdefault(request["headers"][AFFINITY_HEADER], []).append(request["body"])
    assert sorted(by_session) == ["session-0", "session-1", "session-2"]
    system_prompts = {bodies[0]["messages"][0]["content"] for bodies in by_session.values()}
    assert len(system_prompts) == 1  # one system prompt shared by all sessions
    saw_tool_turn = False
    for bodies in by_session.values():
        assert len(bodies) == 4
        for previous, current in zip(bodies, bodies[1:], strict=False):
            prev_messages, messages = previous["messages"], current["messages"]
            # The whole previous request comes back, then the server's answer, then new messages.
            assert messages[: len(prev_messages)] == prev_messages
            answer = messages[len(prev_messages)]
            assert answer["role"] == "assistant" and answer["content"] == " w0 w1 w2 w3 w4"
            new = messages[len(prev_messages) + 1 :]
            if "tool_calls" in answer:
                saw_tool_turn = True
                assert [m["role"] for m in new] == ["tool"]
                assert new[0]["tool_call_id"] == answer["tool_calls"][0]["id"]
            else:
                assert [m["role"] for m in new] == ["user"]
        assert all(body["tools"] == bodies[0]["tools"] and len(body["tools"]) == 2 for body in bodies)
    assert saw_tool_turn


async def test_agentic_affinity_share_and_completions_flattening(server):
    url, state = server
    config = AgenticConfig(num_sessions=4, turns_per_session=2, system_prompt_len=8, num_tools=1,
                           think_time_s=0.0, affinity_share=0.5)  # fmt: skip
    outcome = await _run(url, AgenticWorkload(config, WordTextSource()).jobs(COMPLETIONS))
    assert all(r.success for r in outcome.results)
    with_header = [r for r in state.requests if AFFINITY_HEADER in r["headers"]]
    assert len(with_header) == 4  # 2 of 4 sessions, 2 turns each
    prompts = [r["body"]["prompt"] for r in state.requests]
    assert all(isinstance(p, str) and p.startswith("tools: ") for p in prompts)
    # A later turn's prompt carries the earlier one (minus its trailing "assistant:" cue).
    firsts = [p for p in prompts if p.count("assistant:") == 1]
    seconds = [p for p in prompts if p.count("assistant:") == 2]
    assert len(firsts) == 4 and len(seconds) == 4
    assert all(any(s.startswith(f[: -len("assistant:")]) for f in firsts) for s in seconds)


async def test_failed_turn_ends_its_session_and_is_counted():
    runner, url = await start_fake_server(FakeServerConfig(fail_every=2))
    try:
        config = AgenticConfig(num_sessions=1, turns_per_session=5, think_time_s=0.0, system_prompt_len=4)
        outcome = await _run(url, AgenticWorkload(config, WordTextSource()).jobs(CHAT))
    finally:
        await runner.cleanup()
    assert [r.success for r in outcome.results] == [True, False]


def test_random_workload_lengths_and_token_id_prompts():
    config = RandomConfig(num_prompts=50, input_len=100, output_len=20, range_ratio=0.5, seed=1)
    jobs = RandomWorkload(config, WordTextSource(10, 20)).jobs(COMPLETIONS)
    assert len(jobs) == 50
    sent = []

    async def capture(spec):
        sent.append(spec)

    import asyncio

    for job in jobs:
        asyncio.run(job.run(capture))
    lengths = [len(spec.prompt) for spec in sent]
    assert min(lengths) >= 50 and max(lengths) <= 150 and len(set(lengths)) > 10
    assert all(10 <= token_id < 20 for spec in sent for token_id in spec.prompt)
    assert all(10 <= spec.max_tokens <= 30 for spec in sent)


def test_tokenizer_text_source_hits_exact_lengths(tmp_path):
    from tests.tiny_models import write_tokenizer

    write_tokenizer(tmp_path)
    source = TokenizerTextSource(tmp_path)
    rng = random.Random(0)
    assert [source.count_tokens(source.text(n, rng)) for n in (5, 50, 300)] == [5, 50, 300]
    assert all(id_ not in source.tokenizer.get_added_tokens_decoder() for id_ in source.token_ids(200, rng))


async def test_shared_prefix_groups_share_their_prefix(server):
    url, state = server
    config = SharedPrefixConfig(num_prompts=12, num_prefixes=3, prefix_len=64, suffix_len=8, output_len=2)
    outcome = await _run(url, SharedPrefixWorkload(config, WordTextSource()).jobs(COMPLETIONS))
    prefixes = {tuple(r["body"]["prompt"][:64]) for r in state.requests}
    assert len(prefixes) == 3
    # 3 cold requests, then every other request finds its 64-token prefix cached.
    assert sum(r.cached_tokens for r in outcome.results) == 9 * 64


async def test_replay_follows_timestamps_and_grows_session_prompts(server, tmp_path):
    url, state = server
    trace = tmp_path / "trace.jsonl"
    lines = [
        {"timestamp": 10.0, "session_id": "a", "input_tokens": 32, "output_tokens": 2},
        {
            "timestamp": 10.2,
            "session_id": "b",
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 1,
        },
        {"timestamp": 10.4, "session_id": "a", "input_tokens": 48, "output_tokens": 3},
    ]
    trace.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    workload = ReplayWorkload(ReplayConfig(trace_path=str(trace), speed=2.0), WordTextSource())
    jobs = workload.jobs(COMPLETIONS)
    assert [job.arrival_s for job in jobs] == pytest.approx([0.0, 0.1, 0.2])
    outcome = await _run(url, jobs)
    assert outcome.duration_s >= 0.2
    first_a, message_b, second_a = (r["body"] for r in state.requests)
    assert len(first_a["prompt"]) == 32 and second_a["prompt"][:32] == first_a["prompt"]
    assert len(second_a["prompt"]) == 48 and second_a["max_tokens"] == 3
    assert "user: hello" in message_b["prompt"]


def test_replay_rejects_bad_traces(tmp_path):
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"timestamp": 0, "output_tokens": 3}\n')
    with pytest.raises(ValueError, match="needs 'messages'"):
        ReplayWorkload(ReplayConfig(trace_path=str(trace)), WordTextSource())
    with pytest.raises(FileNotFoundError):
        ReplayWorkload(ReplayConfig(trace_path=str(tmp_path / "none.jsonl")), WordTextSource())


def test_poisson_arrivals_have_the_requested_mean_rate():
    times = arrival_times_s(4000, request_rate=20.0, seed=0)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 20.0, rel=0.05)
    assert arrival_times_s(3, math.inf, 0) == [0.0, 0.0, 0.0]


async def test_max_concurrency_bounds_in_flight_requests():
    runner, url = await start_fake_server(FakeServerConfig(ttft_s=0.05))
    try:
        jobs = RandomWorkload(RandomConfig(num_prompts=12, input_len=4, output_len=2), WordTextSource()).jobs(
            COMPLETIONS
        )
        outcome = await _run(url, jobs, LoadShape(max_concurrency=3))
    finally:
        await runner.cleanup()
    assert outcome.max_concurrent_requests == 3 and len(outcome.results) == 12
    assert outcome.duration_s >= 4 * 0.05  # 12 requests, 3 at a time
