"""hearth.contracts: the messages between processes and ranks import neither torch nor another layer."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgspec

from hearth.contracts.sampling import SamplerParams
from hearth.contracts.step import NewRequest, PageUpdate, StepInput, StepOutput, TokenLogprob
from hearth.engine.sampling_params import SamplingParams

SRC = Path(__file__).resolve().parent.parent / "src"


def test_the_contracts_import_without_torch():
    code = (
        "import sys, hearth.contracts.step, hearth.contracts.sampling; "
        "bad = sorted(m for m in sys.modules if m == 'torch' or (m.startswith('hearth.') and "
        "not m.startswith('hearth.contracts'))); print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(SRC)},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_step_and_its_output_round_trip_through_msgpack():
    step = StepInput(
        slots=[3],
        starts=[0],
        num_new_tokens=[2],
        new_requests=[NewRequest(3, "r", 2, [5, 6], SamplerParams(temperature=0.0, seed=4))],
        page_updates=[PageUpdate(3, 0, [9], [91])],
        finished_slots=[1],
    )
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(step), type=StepInput) == step
    output = StepOutput([[7]], [[TokenLogprob(7, -0.5, [(8, -1.0)])]], draft_token_ids=[[1, 2]])
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(output), type=StepOutput)
    assert decoded.sampled_token_ids == [[7]] and decoded.draft_token_ids == [[1, 2]]
    assert decoded.logprobs is not None and decoded.logprobs[0][0].top == [(8, -1.0)]


def test_sampler_params_say_greedy_and_penalties_like_the_request_params():
    assert SamplerParams(temperature=0.0).greedy and SamplerParams(top_k=1).greedy
    assert not SamplerParams().greedy
    assert SamplerParams(repetition_penalty=1.1).needs_penalties and not SamplerParams().needs_penalties


def test_sampler_params_carry_logit_bias_and_prompt_logprobs_to_the_workers():
    params = SamplingParams(logit_bias={5: 2.5, 9: -100.0}, prompt_logprobs=3).sampler_params()
    assert params.logit_bias == {5: 2.5, 9: -100.0} and params.prompt_logprobs == 3
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplerParams)
    assert decoded == params
