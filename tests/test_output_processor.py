"""OutputProcessor: core outputs of any number of tokens -> text deltas, stop strings, logprobs and usage."""

from __future__ import annotations

import pytest
from tiny_models import make_tiny_model

from hearth.engine.messages import CoreOutput
from hearth.engine.output_processor import OutputProcessor
from hearth.engine.outputs import TokenLogprob
from hearth.engine.sampling_params import SamplingParams
from hearth.model.tokenizer import Tokenizer

PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", arch="llama"))


def _core(request_id: str, tokens: list[int], **fields: object) -> CoreOutput:
    return CoreOutput(request_id, tokens, num_prompt_tokens=len(PROMPT), num_cached_tokens=0, **fields)  # type: ignore[arg-type]


def test_several_tokens_per_output_give_the_same_text_as_one_at_a_time(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("hello there, a longer answer with café and 😀 in it", add_special_tokens=False)
    one, many = OutputProcessor(tokenizer), OutputProcessor(tokenizer)
    params = SamplingParams(max_tokens=100)
    one.add_request("a", PROMPT, params)
    many.add_request("a", PROMPT, params)
    text_one = "".join(one.process([_core("a", [t])]).request_outputs[0].new_text for t in ids)
    text_many = "".join(
        many.process([_core("a", ids[i : i + 3])]).request_outputs[0].new_text for i in range(0, len(ids), 3)
    )
    assert text_one == text_many == tokenizer.decode(ids)


def test_a_stop_string_inside_a_token_list_cuts_the_tokens_and_asks_the_core_to_abort(
    tokenizer: Tokenizer,
) -> None:
    ids = tokenizer.encode("one two STOP three four", add_special_tokens=False)
    processor = OutputProcessor(tokenizer)
    processor.add_request("a", PROMPT, SamplingParams(max_tokens=100, stop=["STOP"], logprobs=0))
    logprobs = [TokenLogprob(t, -0.5) for t in ids]
    processed = processor.process([_core("a", ids, new_logprobs=logprobs)])
    [output] = processed.request_outputs
    assert processed.abort_request_ids == ["a"]
    assert output.finish_reason == "stop" and output.stop_reason == "STOP"
    assert output.new_text.rstrip() == "one two"
    kept = len(output.new_token_ids)
    assert kept < len(ids) and output.completion_tokens == kept
    assert tokenizer.decode(ids[:kept]).endswith("STOP")
    assert [lp.token_id for lp in output.new_logprobs or []] == ids[:kept]
    # The core's tokens that were already in flight are dropped.
    assert processor.process([_core("a", [5])]).request_outputs == []
    assert not processor.has_request("a")


def test_a_trailing_stop_token_is_counted_but_not_shown(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("done", add_special_tokens=False)
    eos = min(tokenizer.eos_token_ids)
    processor = OutputProcessor(tokenizer)
    processor.add_request("a", PROMPT, SamplingParams(max_tokens=100, skip_special_tokens=False))
    [output] = processor.process(
        [_core("a", [*ids, eos], finish_reason="stop", ends_with_stop_token=True)]
    ).request_outputs
    assert output.new_text == "done" and output.completion_tokens == len(ids) + 1
    assert output.finish_reason == "stop" and output.stop_reason is None


def test_held_back_text_is_released_when_the_request_ends_for_another_reason(tokenizer: Tokenizer) -> None:
    processor = OutputProcessor(tokenizer)
    processor.add_request("a", PROMPT, SamplingParams(max_tokens=100, stop=["hello world"]))
    ids = tokenizer.encode("say hello", add_special_tokens=False)
    [first] = processor.process([_core("a", ids)]).request_outputs
    assert "hello" not in first.new_text  # may be the start of the stop string
    [last] = processor.process([_core("a", [], finish_reason="length")]).request_outputs
    assert (first.new_text + last.new_text) == "say hello" and last.finish_reason == "length"


def test_abort_drops_the_state_and_reports_the_tokens_so_far(tokenizer: Tokenizer) -> None:
    processor = OutputProcessor(tokenizer)
    processor.add_request("a", PROMPT, SamplingParams(max_tokens=100))
    processor.process([_core("a", [10, 11])])
    output = processor.abort("a", "engine died")
    assert output is not None and output.finish_reason == "abort" and output.completion_tokens == 2
    assert processor.abort("a", "again") is None
