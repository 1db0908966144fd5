"""Overlap scheduling (`hearth.engine.overlap`): the engine launches step N+1 before reading step N's
tokens, and every output is the serial loop's, token for token (greedy, seeded and unseeded sampling,
logprobs, stops, admissions mid-run, preemptions, aborts)."""

from __future__ import annotations

import pytest

from hearth import LLM, SamplingParams
from hearth.engine.messages import EngineRequest


def prompts_of(lengths: list[int]) -> list[list[int]]:
    return [[(7 * i + 3 * n) % 400 + 3 for i in range(n)] for n in lengths]


def both(model_dir, prompts, params, **options):
    """(serial results, overlapped results, the overlapped LLM). Each engine is built just before it runs:
    building seeds torch's global generator, which unseeded sampling draws from."""
    serial = LLM(str(model_dir), async_scheduling=False, **options).generate(prompts, params)
    overlapped = LLM(str(model_dir), async_scheduling=True, **options)
    return serial, overlapped.generate(prompts, params), overlapped


def test_overlap_is_on_with_a_gpu_and_off_on_a_cpu_unless_asked(tiny_llama) -> None:
    default = LLM(str(tiny_llama)).engine
    assert default.runner.overlaps == (default.worker.device.type != "cpu")
    assert not LLM(str(tiny_llama), device="cpu").engine.runner.overlaps
    assert LLM(str(tiny_llama), device="cpu", async_scheduling=True).engine.runner.overlaps
    assert not LLM(str(tiny_llama), async_scheduling=False).engine.runner.overlaps


def test_overlapped_steps_give_the_serial_loops_tokens_and_logprobs(tiny_llama) -> None:
    prompts = prompts_of([1, 9, 21, 5])
    params = [
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),  # ends while the others go on
        SamplingParams(max_tokens=9, temperature=0.8, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True),  # unseeded: the worker's RNG order
    ]
    expected, got, overlapped = both(tiny_llama, prompts, params, page_size=4)
    assert overlapped.engine.num_overlapped_steps > 0
    for want, have in zip(expected, got, strict=True):
        assert have.token_ids == want.token_ids
        assert have.finish_reason == want.finish_reason
    assert got[0].logprobs == expected[0].logprobs
    assert overlapped.engine.stats().kv_pages_used == 0  # the dropped rows' pages came back


def test_a_stop_token_mid_run_drops_the_launched_row(tiny_llama) -> None:
    prompt = prompts_of([9])
    free_run = LLM(str(tiny_llama), page_size=4).generate(
        prompt, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    )
    stop = free_run[0].token_ids[3]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, stop_token_ids=[stop])
    (expected,), (got,), _ = both(tiny_llama, prompt, params, page_size=4)
    assert got.token_ids == expected.token_ids and got.token_ids[-1] == stop
    assert got.finish_reason == "stop"


def test_admissions_and_preemptions_go_through_the_scheduler(tiny_model_factory) -> None:
    """Two seats for five requests (admissions mid-run) and a KV budget that forces preemptions."""
    model_dir = tiny_model_factory("llama")
    kv_bytes = 12 * 4 * 512  # 12 pages of 4 tokens (2 layers x 2 KV heads x 16 dims x fp32 x K, V)
    prompts = prompts_of([10, 13, 7, 11, 3])
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    options = {"page_size": 4, "max_num_seqs": 2, "kv_cache_memory_gib": kv_bytes / 2**30}
    expected, got, overlapped = both(model_dir, prompts, params, **options)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    assert overlapped.engine.num_overlapped_steps > 0
    assert overlapped.engine.stats().num_preemptions_total > 0
    assert all(count == 0 for count in overlapped.engine.kv.allocator.ref_counts)


def test_an_abort_while_a_step_is_launched_leaves_the_others_exact(tiny_llama) -> None:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = LLM(str(tiny_llama), page_size=4).generate(prompts_of([6]), params)[0].token_ids
    engine = LLM(str(tiny_llama), page_size=4, async_scheduling=True).engine
    for request_id, prompt in zip(("keep", "drop"), prompts_of([6, 11]), strict=True):
        engine.add_request(EngineRequest(request_id, prompt, params))
    tokens: dict[str, list[int]] = {"keep": [], "drop": []}
    for _ in range(3):
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
    assert engine._in_flight is not None  # a step is on the worker
    engine.abort(["drop"])
    while engine.has_work:
        for output in engine.step():
            assert output.request_id == "keep"
            tokens["keep"] += output.new_token_ids
    assert tokens["keep"] == expected
    assert engine.stats().kv_pages_used == 0


@pytest.mark.parametrize("value", ["on", "off"])
def test_the_flag_reaches_the_engine_config(value: str) -> None:
    import argparse

    from hearth.engine.config import EngineConfig

    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_arguments(parser)
    args = parser.parse_args(["--model", "m", "--async-scheduling", value, "--enforce-eager"])
    config = EngineConfig.from_cli_args(args)
    assert config.async_scheduling is (value == "on") and config.enforce_eager
