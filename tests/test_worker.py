"""The worker: StepInput in, logits and tokens out. Logits against transformers' for the same prefixes,
the draft acceptance rule, per-request state, the KV dtype, and every tensor on the worker's device."""

from __future__ import annotations

from itertools import count

import pytest
import torch
from hf_oracle import _load, hf_greedy

from hearth import LLM, SamplingParams
from hearth.engine.config import EngineConfig
from hearth.engine.request import Request
from hearth.engine.scheduler import ScheduledRequest as Row
from hearth.engine.step_input import StepInputBuilder
from hearth.engine.worker import Worker, kv_layout_for, resolve_device
from hearth.model.config import ModelConfig
from tests.test_persistent_batch import flatten


def flatten_rows(rows, check_page_tags=False):
    return flatten(rows, check_page_tags, page_size=PAGE_SIZE)


PAGE_SIZE = 4


class Requests:
    """Requests with pages handed out by a counter (the worker only reads ids; no allocator needed)."""

    def __init__(self) -> None:
        self._pages = count(1)

    def new(self, request_id: str, prompt: list[int], params: SamplingParams | None = None) -> Request:
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt),
            params=params or SamplingParams(temperature=0),
            prefix_root=b"",
            arrival_index=0,
            max_model_len=200,
        )
        self.grow(request, len(prompt))
        return request

    def grow(self, request: Request, num_tokens: int) -> None:
        while len(request.page_ids) * PAGE_SIZE < num_tokens:
            request.page_ids.append(next(self._pages))
            request.page_generations.append(1)


def advance(rows: list[Row], tokens: dict[str, int] | None = None) -> None:
    """The scheduler's side after a step: tokens computed, new tokens appended."""
    for row in rows:
        row.request.num_computed_tokens += row.num_new_tokens
    for request_id, token in (tokens or {}).items():
        request = next(row.request for row in rows if row.request.request_id == request_id)
        request.token_ids.append(token)
        request.output_token_ids.append(token)


def hf_next_logits(model_dir, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return _load(str(model_dir))(torch.tensor([token_ids])).logits[0, -1].float()


@pytest.fixture(scope="module")
def llama(tiny_model_factory):
    model_dir = tiny_model_factory("llama")
    return model_dir, LLM(str(model_dir), dtype="float32", page_size=PAGE_SIZE).engine.worker


def test_logits_of_a_mixed_batch_match_transformers(llama):
    model_dir, worker = llama
    requests = Requests()
    a = requests.new("a", [(7 * i + 3) % 500 for i in range(10)])
    b = requests.new("b", [(5 * i + 1) % 500 for i in range(13)])
    c = requests.new("c", [11, 12, 13, 14, 15])
    first = [Row(a, 10), Row(b, 6), Row(c, 5)]  # b is a mid-prompt chunk: no logits
    logits = worker.forward(flatten_rows(first))
    assert logits.shape[0] == 2
    torch.testing.assert_close(logits[0], hf_next_logits(model_dir, a.token_ids), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits[1], hf_next_logits(model_dir, c.token_ids), rtol=1e-4, atol=1e-4)
    advance(first, {"a": 17, "c": 23})
    for request in (a, c):
        requests.grow(request, request.num_tokens)
    second = [Row(a, 1), Row(c, 1), Row(b, 7)]  # two decodes, then the rest of b's prompt
    logits = worker.forward(flatten_rows(second))
    for row, request in enumerate((a, c, b)):
        torch.testing.assert_close(
            logits[row], hf_next_logits(model_dir, request.token_ids), rtol=1e-4, atol=1e-4
        )


@pytest.mark.parametrize(
    "drafts,kept",
    [
        ([1, 2, 3], 3),  # every draft right: the three drafts' successors and one more
        ([1, 2, -1], 2),  # the third draft wrong: cut there, its right token replaces it
        ([-1, 2, 3], 0),  # the first wrong: only the correct next token
        ([], 0),
    ],
)
def test_greedy_drafts_keep_the_longest_agreeing_run(llama, drafts, kept):
    model_dir, worker = llama
    prompt = [(13 * i + 2) % 500 for i in range(9)]
    greedy = hf_greedy(model_dir, prompt, 5)
    requests = Requests()
    request = requests.new("d", prompt)
    builder = StepInputBuilder(PAGE_SIZE)
    prefill = [Row(request, len(prompt))]
    assert worker.execute(builder.build(prefill)).sampled_token_ids == [greedy[:1]]
    advance(prefill, {"d": greedy[0]})
    wrong = next(t for t in range(3, 500) if t not in greedy)
    draft_ids = [greedy[i] if i > 0 else wrong for i in drafts]  # -1: a token greedy does not pick
    requests.grow(request, request.num_tokens + len(draft_ids))
    output = worker.execute(builder.build([Row(request, 1 + len(draft_ids), draft_ids)]))
    assert output.sampled_token_ids == [greedy[1 : kept + 2]]
    assert output.logprobs is None


def test_a_seeded_request_restarts_its_stream_only_after_it_finished(llama):
    _, worker = llama
    requests = Requests()
    request = requests.new("s", [3, 1, 4, 1, 5], SamplingParams(temperature=1.0, seed=7))
    builder = StepInputBuilder(PAGE_SIZE)

    def sample() -> list[int]:
        request.num_computed_tokens = 0  # recompute the same prompt each time: same logits
        return [worker.execute(builder.build([Row(request, 5)])).sampled_token_ids[0][0] for _ in range(4)]

    first = sample()
    builder.request_finished("s")
    again = sample()
    assert again == first  # a fresh generator from the same seed
    assert len(set(first)) > 1  # one stream, advancing (not re-seeded every step)


def test_logprobs_come_per_kept_token(llama):
    _, worker = llama
    requests = Requests()
    with_logprobs = requests.new("l", [9, 8, 7], SamplingParams(temperature=0, logprobs=2))
    without = requests.new("n", [6, 5, 4])
    output = worker.execute(StepInputBuilder(PAGE_SIZE).build([Row(with_logprobs, 3), Row(without, 3)]))
    assert output.logprobs is not None and output.logprobs[1] == []
    (logprob,) = output.logprobs[0]
    assert logprob.token_id == output.sampled_token_ids[0][0] and len(logprob.top) == 2


def test_bfloat16_kv_cache_under_a_float32_model(tiny_model_factory):
    model_dir = tiny_model_factory("qwen3")
    llm = LLM(str(model_dir), dtype="float32", page_size=PAGE_SIZE, kv_cache_dtype="bfloat16")
    assert llm.engine.worker.kv_pool.storage.dtype is torch.bfloat16
    assert llm.engine.worker.model.lm_head.weight.dtype is torch.float32
    prompt = [(3 * i + 1) % 500 for i in range(12)]
    result = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert len(result.token_ids) == 6
    assert result.token_ids[0] == hf_greedy(model_dir, prompt, 1)[0]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
def test_torch_reference_backend_matches_transformers(tiny_model_factory, monkeypatch, arch):
    monkeypatch.setenv("HEARTH_ATTENTION_BACKEND", "torch_ref")
    overrides = {"sliding_window": 6} if arch == "mistral" else {}
    model_dir = tiny_model_factory(arch, **overrides)
    llm = LLM(str(model_dir), dtype="float32", page_size=PAGE_SIZE, max_num_batched_tokens=16)
    assert llm.engine.worker.attention.name == "torch_ref"
    prompts = [[(11 * i + n) % 500 for i in range(n)] for n in (3, 14, 23)]
    results = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    for prompt, result in zip(prompts, results):
        assert result.token_ids == hf_greedy(model_dir, prompt, 10)


def test_every_tensor_of_a_step_lives_on_the_worker_device(tiny_model_factory):
    """A worker on the meta device: a tensor made on the CPU by mistake would meet meta tensors and raise."""
    model_dir = tiny_model_factory("qwen2")
    config = EngineConfig(model=str(model_dir), dtype="float32", page_size=PAGE_SIZE)
    model_config = ModelConfig.from_dir(model_dir)
    layout = kv_layout_for(config, model_config, torch.float32)
    worker = Worker(
        config, model_config, torch.float32, layout, 32, 100, 500, [0], device=torch.device("meta")
    )
    requests = Requests()
    a, b = requests.new("a", [1, 2, 3, 4, 5, 6]), requests.new("b", [7, 8, 9])
    b.num_computed_tokens = 2
    logits = worker.forward(flatten_rows([Row(b, 1), Row(a, 6)]))
    assert logits.device.type == "meta" and logits.shape == (2, model_config.vocab_size)
    assert worker.kv_pool.storage.device.type == "meta"


def test_device_option():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            resolve_device("cuda")
    with pytest.raises(ValueError, match="device must be one of"):
        EngineConfig(model="m", device="tpu")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_with_drafts_stays_token_exact(tiny_model_factory, arch):
    """Drafts that are partly right (a proposer's guesses) go through schedule -> worker -> update: the
    output is transformers' greedy output, whatever was accepted or rolled back on the way."""
    import random

    from hearth.engine.messages import EngineRequest

    model_dir = tiny_model_factory(arch)
    engine = LLM(str(model_dir), dtype="float32", page_size=PAGE_SIZE).engine
    prompts = {f"p{n}": [(7 * i + n) % 500 for i in range(n)] for n in (3, 10, 17)}
    expected = {request_id: hf_greedy(model_dir, prompt, 16) for request_id, prompt in prompts.items()}
    for request_id, prompt in prompts.items():
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        engine.add_request(EngineRequest(request_id, prompt, params))
    rng = random.Random(0)
    produced: dict[str, list[int]] = {request_id: [] for request_id in prompts}
    multi_token_steps = 0
    while engine.has_work:
        for request in engine.scheduler.running:
            done = len(request.output_token_ids)
            truth = expected[request.request_id][done + 1 : done + 1 + rng.randrange(0, 5)]
            request.draft_token_ids = [t if rng.random() < 0.7 else (t + 1) % 500 for t in truth]
        for output in engine.step():
            produced[output.request_id].extend(output.new_token_ids)
            multi_token_steps += len(output.new_token_ids) > 1
    assert produced == expected
    assert multi_token_steps > 3  # drafts were accepted along the way
    assert engine.stats().kv_pages_used == 0


def test_draft_masks_follow_the_grammar_through_the_drafts(tiny_model_factory):
    from hearth.engine.structured_output import StructuredOutput, StructuredOutputManager
    from hearth.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(tiny_model_factory("llama"))
    manager = StructuredOutputManager(tokenizer, tokenizer.eos_token_ids)
    answer = tokenizer.encode('{"a": [1, 2]}', add_special_tokens=False)
    bad = tokenizer.encode("]", add_special_tokens=False)[0]  # no JSON object starts with it
    drafts = answer[:4] + [bad] + answer[4:6]
    matcher = manager.new_matcher(StructuredOutput.json_object())
    masks = manager.compute_draft_bitmask(matcher, drafts)
    assert masks.shape[0] == 5  # states after 0..4 drafts; the fifth draft is not allowed
    for i in range(5):
        fresh = manager.new_matcher(StructuredOutput.json_object())
        for token in drafts[:i]:
            assert fresh.accept(token)
        assert torch.equal(masks[i], manager.compute_bitmask([fresh])[1][0])
    assert manager.compute_bitmask([matcher])[1].equal(masks[:1])  # the matcher is back where it was


def test_constrained_request_with_drafts_gives_the_same_json(tiny_model_factory):
    import random

    from hearth.engine.messages import EngineRequest
    from hearth.engine.structured_output import StructuredOutput

    engine = LLM(str(tiny_model_factory("llama")), dtype="float32", page_size=PAGE_SIZE).engine
    params = SamplingParams(temperature=0, max_tokens=40, structured_output=StructuredOutput.json_object())
    prompt = [5, 6, 7, 8, 9]

    def run(request_id: str, draft_source: list[int] | None) -> tuple[list[int], str | None]:
        engine.add_request(EngineRequest(request_id, prompt, params))
        rng = random.Random(1)
        tokens, finish_reason = [], None
        while engine.has_work:
            for request in engine.scheduler.running:
                if draft_source is not None:
                    done = len(request.output_token_ids)
                    truth = draft_source[done + 1 : done + 1 + rng.randrange(0, 5)]
                    request.draft_token_ids = [t if rng.random() < 0.7 else (t + 3) % 500 for t in truth]
            for output in engine.step():
                tokens.extend(output.new_token_ids)
                finish_reason = output.finish_reason or finish_reason
        return tokens, finish_reason

    plain, plain_finish = run("plain", None)
    drafted, drafted_finish = run("drafted", plain)
    assert plain_finish in ("stop", "length")
    assert (drafted, drafted_finish) == (plain, plain_finish)
