"""The lean draft chain (`hearth.engine.speculative.lean_draft`): its greedy proposals are transformers' greedy
continuation of the draft model (over the context window it sees), it rolls back to the request's tokens,
and the `draft` proposer takes it for small batches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import make_tiny_model

from hearth import LLM
from hearth.engine.speculative.lean_draft import CONTEXT_WINDOW_TOKENS, LeanDraftRunner
from hearth.engine.speculative.proposer import ProposalRequest


@pytest.fixture(scope="module", autouse=True)
def compiled_kernels() -> None:
    from hearth.ops import cpu_kernels

    cpu_kernels.start_build()
    if cpu_kernels.paged_decode_attention_kernel(wait=True) is None:
        pytest.skip("the CPU kernels did not build here")


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def draft_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    # A bf16 checkpoint (as models/demo-draft): the chain's linears take the bf16 kernel.
    return make_tiny_model(
        tmp_path_factory.mktemp("lean") / request.param, request.param, seed=3, weights_dtype="bfloat16"
    )


def transformers_greedy(model_dir: Path, token_ids: list[int], num_tokens: int) -> list[int]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    out = model.generate(
        torch.tensor([token_ids]), max_new_tokens=num_tokens, do_sample=False, min_new_tokens=num_tokens
    )
    return out[0, len(token_ids) :].tolist()


def lean_runner(model_dir: Path, window: int) -> LeanDraftRunner:
    llm = LLM(str(model_dir), dtype="float32", num_threads=1, kv_cache_memory_gib=0.01)
    runner = LeanDraftRunner.build(llm.engine.worker.model, llm.engine.model_config.vocab_size)
    assert runner is not None
    runner.context_window = window
    return runner


def prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 400, (length,), generator=generator).tolist()


def test_proposals_are_transformers_greedy_and_roll_back(draft_dir):
    runner = lean_runner(draft_dir, window=1000)
    tokens = prompt(37, seed=0)
    sequence = runner.new_sequence()
    first = runner.propose(sequence, tokens, 6)
    assert first == transformers_greedy(draft_dir, tokens, 6)
    # The target kept two drafts and sampled its own token after them: the KV of the rejected rest goes.
    kept = tokens + first[:2] + [(first[2] + 1) % 400]
    assert runner.propose(sequence, kept, 5) == transformers_greedy(draft_dir, kept, 5)
    assert sequence.token_ids == kept + runner.propose(runner.new_sequence(), kept, 5)[:4]
    # Several tokens accepted at once (one multi-token feed), then a rollback behind the held tokens.
    longer = kept + [7, 8, 9]
    assert runner.propose(sequence, longer, 4) == transformers_greedy(draft_dir, longer, 4)
    shorter = tokens[:30] + [11]
    assert runner.propose(sequence, shorter, 3) == transformers_greedy(draft_dir, shorter, 3)


def test_the_draft_sees_the_last_window_tokens_of_a_long_context(draft_dir):
    runner = lean_runner(draft_dir, window=16)
    tokens = prompt(700, seed=1)  # past the first capacity (512): the per-layer tensors grow
    sequence = runner.new_sequence()
    assert runner.propose(sequence, tokens, 4) == transformers_greedy(draft_dir, tokens[-16:], 4)
    assert sequence.offset == 700 - 16
    grown = tokens + prompt(600, seed=2)
    assert runner.propose(sequence, grown, 3) == transformers_greedy(draft_dir, grown[700 - 16 :], 3)


def test_draft_proposer_takes_the_lean_chain_for_small_batches(draft_dir, tmp_path):
    target = make_tiny_model(tmp_path / "target", "llama", seed=4)
    llm = LLM(
        str(target),
        dtype="float32",
        num_threads=1,
        speculative_method="draft",
        speculative_model=str(draft_dir),
        num_speculative_tokens=3,
    )
    proposer = llm.engine.speculator.proposer
    tokens = prompt(20, seed=5)
    proposals = proposer.propose([ProposalRequest("a", tokens, 20, 3)])
    assert proposer.lean is not None and "a" in proposer._lean_sequences
    assert proposals == [transformers_greedy(draft_dir, tokens, 3)]
    # A batch over the limit takes the paged path, which proposes the same tokens (over the same window
    # of the last CONTEXT_WINDOW_TOKENS: these prompts are longer).
    batch = [ProposalRequest(f"r{i}", prompt(140 + i, seed=i), 140 + i, 3) for i in range(5)]
    paged = proposer.propose(batch)
    assert not any(f"r{i}" in proposer._lean_sequences for i in range(5))
    assert proposer._sequences["r0"].offset == 140 - CONTEXT_WINDOW_TOKENS > 0
    assert paged == [proposer.lean.propose(proposer.lean.new_sequence(), r.token_ids, 3) for r in batch]
    proposer.request_finished("a")
    assert "a" not in proposer._lean_sequences
