"""The async front (the engine core in its own process): streaming per step, abort and stop strings free
pages in the core, validation errors reach the caller, stats come from the core."""

from __future__ import annotations

import asyncio

import pytest

from hearth.engine.async_engine import AsyncEngine
from hearth.engine.config import EngineConfig
from hearth.engine.sampling_params import InvalidParamError, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_llama):
    engine = AsyncEngine(EngineConfig(model=str(tiny_llama), dtype="float32", page_size=4))
    yield engine
    engine.shutdown()


async def test_streams_one_output_per_token_and_matches_offline(engine):
    prompt = list(range(10, 30))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = [o async for o in engine.generate(prompt, params, "stream-1")]
    assert len(outputs) == 12
    assert all(len(o.new_token_ids) == 1 for o in outputs)
    assert outputs[-1].finish_reason == "length" and not any(o.finished for o in outputs[:-1])
    assert outputs[-1].completion_tokens == 12 and outputs[-1].prompt_tokens == 20
    streamed = [t for o in outputs for t in o.new_token_ids]
    again = [t async for o in engine.generate(prompt, params, "stream-2") for t in o.new_token_ids]
    assert streamed == again


async def test_concurrent_requests_all_finish(engine):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    async def one(i: int) -> int:
        return sum([len(o.new_token_ids) async for o in engine.generate([i + 5] * (i + 3), params, f"c-{i}")])

    counts = await asyncio.gather(*(one(i) for i in range(16)))
    assert counts == [6] * 16


async def test_closing_the_stream_aborts_and_frees_pages(engine):
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    stream = engine.generate(list(range(50, 90)), params, "to-abort")
    async for _ in stream:
        break
    await stream.aclose()
    for _ in range(100):
        stats = engine.stats()
        if stats.num_running == 0 and stats.kv_pages_used == 0:
            break
        await asyncio.sleep(0.02)
    assert stats.num_running == 0 and stats.kv_pages_used == 0


async def test_explicit_abort_ends_the_stream_with_abort(engine):
    params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
    outputs = []

    async def consume():
        async for o in engine.generate(list(range(60, 70)), params, "abort-me"):
            outputs.append(o)

    task = asyncio.create_task(consume())
    while not outputs:
        await asyncio.sleep(0.005)
    await engine.abort("abort-me")
    await asyncio.wait_for(task, 10)
    assert outputs[-1].finish_reason == "abort"
    assert len(outputs) < 500


async def test_prompt_longer_than_context_is_rejected(engine):
    with pytest.raises(InvalidParamError) as info:
        async for _ in engine.generate([5] * (engine.max_model_len + 1), SamplingParams(), "too-long"):
            pass
    assert info.value.param == "prompt"
    # the engine keeps serving
    outs = [
        o async for o in engine.generate([5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True), "after")
    ]
    assert outs[-1].finished


async def test_a_token_id_outside_the_vocabulary_is_rejected_before_any_output(engine):
    with pytest.raises(InvalidParamError) as info:
        async for _ in engine.generate([5, engine.vocab_size], SamplingParams(max_tokens=2), "bad-id"):
            pytest.fail("no output may come before the rejection")
    assert info.value.param == "prompt"


async def _wait_idle(engine: AsyncEngine):
    for _ in range(200):
        stats = engine.stats()
        if stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_pages_used == 0:
            break
        await asyncio.sleep(0.02)
    return stats


async def test_a_stop_string_ends_the_request_in_the_core_too(engine):
    prompt = list(range(30, 50))
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    text = "".join([o.new_text async for o in engine.generate(prompt, greedy, "no-stop")])
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip() and text.find(stop) > 0, text
    stopped = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True, stop=[stop])
    outputs = [o async for o in engine.generate(prompt, stopped, "stop-string")]
    assert outputs[-1].finish_reason == "stop" and outputs[-1].stop_reason == stop
    assert "".join(o.new_text for o in outputs) == text[: text.find(stop)]
    # The core was running it to max_tokens: it is aborted there, and its pages freed.
    stats = await _wait_idle(engine)
    assert stats.num_running == 0 and stats.kv_pages_used == 0


async def test_stats_come_from_the_core_and_count_generated_tokens(engine):
    before = engine.stats().generation_tokens_total
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    [o async for o in engine.generate([7, 8, 9], params, "counted")]
    stats = await _wait_idle(engine)
    assert stats.generation_tokens_total >= before + 5
    assert stats.kv_pages_total * 4 == engine.num_kv_tokens


def test_core_environment_bounds_allocator_and_onednn_state(monkeypatch) -> None:
    from hearth.engine.async_engine import _core_environment
    from hearth.ops.row_buckets import bucket_rows

    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "4096")  # the user's own setting wins
    env = _core_environment()
    assert env["MALLOC_ARENA_MAX"] == "2"
    # Room for every row bucket times a model's handful of weight shapes: a smaller cache thrashes (issue 19).
    buckets = {bucket_rows(rows) for rows in range(1, 2049)}
    assert int(env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"]) >= 8 * len(buckets)
    assert env["MALLOC_MMAP_THRESHOLD_"] == "4096"


def test_core_environment_spins_openmp_threads_briefly_unless_the_user_chose(monkeypatch) -> None:
    from hearth.engine.async_engine import OPENMP_SPIN_COUNT, _core_environment

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    env = _core_environment()
    assert env["GOMP_SPINCOUNT"] == str(OPENMP_SPIN_COUNT) and "OMP_WAIT_POLICY" not in env
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    env = _core_environment()
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and "GOMP_SPINCOUNT" not in env
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.setenv("GOMP_SPINCOUNT", "5")
    assert _core_environment()["GOMP_SPINCOUNT"] == "5"


def test_in_process_engines_get_the_core_allocator_settings(monkeypatch) -> None:
    from hearth.engine import memory_defaults

    calls: list[tuple[int, int]] = []

    class FakeLibc:
        def mallopt(self, param: int, value: int) -> int:
            calls.append((param, value))
            return 1

    monkeypatch.setattr(memory_defaults.ctypes, "CDLL", lambda name: FakeLibc())
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "4096")  # the user's own setting: glibc already read it
    monkeypatch.setenv("HEARTH_CORE_MEMORY_DEFAULTS", "0")
    memory_defaults.apply_in_process()
    assert not calls and "ONEDNN_PRIMITIVE_CACHE_CAPACITY" not in memory_defaults.os.environ
    monkeypatch.delenv("HEARTH_CORE_MEMORY_DEFAULTS")
    memory_defaults.apply_in_process()
    assert sorted(calls) == [(-8, 2), (-1, 4 * 1024 * 1024)]  # arenas and trim; the mmap threshold was set
    assert memory_defaults.os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "1024"
