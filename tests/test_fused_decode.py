"""The compiled all-layers decode step (`hearth.model.fused_decode`, `ops/csrc/decode_stack.cpp`): taken where
the model and the step qualify, its tokens those of transformers and of the Python layers, and left alone
elsewhere."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf_files import hf_gguf_greedy, hf_gguf_model, write_gguf
from hf_oracle import hf_greedy

from hearth import LLM, SamplingParams
from hearth.model.fused_decode import DecodeStackRunner
from hearth.ops import cpu_kernels

pytestmark = pytest.mark.skipif(
    cpu_kernels.paged_decode_attention_kernel(wait=True) is None,
    reason="no C++ toolchain for torch extensions",
)

PROMPTS = [[(7 * i + 3) % 500 for i in range(n)] for n in (5, 19, 33, 2)]
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


class StackCalls:
    """Counts the steps the stack ran (and checks no other path ran them)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.rows: list[int] = []
        run = DecodeStackRunner.run

        def counted(runner, hidden, *args):  # type: ignore[no-untyped-def]
            self.rows.append(hidden.shape[0])
            return run(runner, hidden, *args)

        monkeypatch.setattr(DecodeStackRunner, "run", counted)


def _generate(model: Path, monkeypatch: pytest.MonkeyPatch, fused: bool, **options) -> tuple[LLM, list]:
    monkeypatch.setenv("HEARTH_FUSED_DECODE", "1" if fused else "0")
    llm = LLM(str(model), dtype="float32", page_size=8, device="cpu", kv_cache_memory_gib=0.02, **options)
    return llm, [r.token_ids for r in llm.generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize("linear,embedding", [("Q4_1", "Q8_0"), ("Q8_0", "F32"), ("Q4_0", "Q8_0")])
def test_gguf_decode_runs_on_the_stack_with_transformers_tokens(
    tiny_model_factory, tmp_path, monkeypatch, linear, embedding
):
    source = tiny_model_factory("llama", hidden_size=64, intermediate_size=128)
    path = write_gguf(source, tmp_path / f"tiny-{linear}.gguf", linear, embedding)
    calls = StackCalls(monkeypatch)
    llm, tokens = _generate(path, monkeypatch, fused=True)
    assert isinstance(llm.engine.worker.model._decode_stack_runner, DecodeStackRunner)
    assert calls.rows and max(calls.rows) == len(PROMPTS)  # the decode steps of the whole batch
    hf = hf_gguf_model(path)
    assert tokens == [hf_gguf_greedy(hf, prompt, PARAMS.max_tokens) for prompt in PROMPTS]
    _, unfused = _generate(path, monkeypatch, fused=False)
    assert unfused == tokens


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: biases on q/k/v
def test_bf16_weights_decode_on_the_stack_with_transformers_tokens(tiny_model_factory, monkeypatch, arch):
    model = tiny_model_factory(arch, weights_dtype="bfloat16")
    calls = StackCalls(monkeypatch)
    _, tokens = _generate(model, monkeypatch, fused=True)
    assert calls.rows
    assert tokens == [hf_greedy(model, prompt, PARAMS.max_tokens) for prompt in PROMPTS]


def test_fp8_kv_decode_on_the_stack_equals_the_python_layers(tiny_model_factory, tmp_path, monkeypatch):
    source = tiny_model_factory("llama", hidden_size=64, intermediate_size=128)
    path = write_gguf(source, tmp_path / "tiny-fp8kv.gguf", "Q4_1", "Q8_0")
    calls = StackCalls(monkeypatch)
    _, fused = _generate(path, monkeypatch, fused=True, kv_cache_dtype="fp8_e4m3")
    assert calls.rows
    _, unfused = _generate(path, monkeypatch, fused=False, kv_cache_dtype="fp8_e4m3")
    assert fused == unfused


def test_a_long_context_at_batch_1_cuts_the_keys_into_chunks_with_transformers_tokens(
    tiny_model_factory, tmp_path, monkeypatch
):
    """One sequence, 3 KV heads, 2 threads: the stack's attention cuts each KV head's ~300 keys into a chunk a
    thread and merges them (`decode_attention_merge`); its tokens stay those of transformers and the Python layers."""
    import torch

    source = tiny_model_factory(
        "llama", hidden_size=192, intermediate_size=256, num_attention_heads=6, num_key_value_heads=3
    )
    path = write_gguf(source, tmp_path / "tiny-3kv.gguf", "Q4_1", "Q8_0")
    prompt = [(11 * i + 5) % 500 for i in range(300)]
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        calls = StackCalls(monkeypatch)
        monkeypatch.setenv("HEARTH_FUSED_DECODE", "1")
        llm = LLM(str(path), dtype="float32", page_size=8, device="cpu", kv_cache_memory_gib=0.02)
        fused = llm.generate([prompt], PARAMS)[0].token_ids
        assert calls.rows and max(calls.rows) == 1
        monkeypatch.setenv("HEARTH_FUSED_DECODE", "0")
        llm = LLM(str(path), dtype="float32", page_size=8, device="cpu", kv_cache_memory_gib=0.02)
        unfused = llm.generate([prompt], PARAMS)[0].token_ids
    finally:
        torch.set_num_threads(before)
    assert fused == unfused == hf_gguf_greedy(hf_gguf_model(path), prompt, PARAMS.max_tokens)


def test_sliding_window_decode_on_the_stack_equals_transformers(tiny_model_factory, monkeypatch):
    model = tiny_model_factory("mistral", weights_dtype="bfloat16", sliding_window=9)
    calls = StackCalls(monkeypatch)
    _, tokens = _generate(model, monkeypatch, fused=True)
    assert calls.rows
    assert tokens == [hf_greedy(model, prompt, PARAMS.max_tokens) for prompt in PROMPTS]


def test_models_the_stack_does_not_run_keep_the_python_layers(tiny_model_factory, monkeypatch):
    model = tiny_model_factory("qwen3")  # q/k norms; float32 weights without a bf16 copy
    calls = StackCalls(monkeypatch)
    llm, tokens = _generate(model, monkeypatch, fused=True)
    assert llm.engine.worker.model._decode_stack_runner is False and not calls.rows
    assert tokens == [hf_greedy(model, prompt, PARAMS.max_tokens) for prompt in PROMPTS]


def test_int8_activations_on_the_stack_equal_the_python_layers(tiny_model_factory, tmp_path, monkeypatch):
    """W4A8 and W8A8 (the opt-in): the stack rounds the activations exactly as the Python layers do."""
    monkeypatch.setenv("HEARTH_INT4_ACTIVATIONS", "int8")
    source = tiny_model_factory("llama", hidden_size=64, intermediate_size=128)
    path = write_gguf(source, tmp_path / "tiny-a8.gguf", "Q4_1", "Q8_0")
    calls = StackCalls(monkeypatch)
    llm, fused = _generate(path, monkeypatch, fused=True)
    assert calls.rows and llm.engine.worker.model.lm_head_quantized.int8_activations
    _, unfused = _generate(path, monkeypatch, fused=False)
    assert fused == unfused


def test_a_failing_stage_raises_on_the_caller_and_leaves_no_thread_behind(
    tiny_model_factory, tmp_path, monkeypatch
):
    """A check that fails inside the stack's parallel region (here RoPE's slot check on thread 0) comes back as
    the kernel's error: every thread passes every barrier, so nothing hangs, and the next step runs."""
    import torch

    source = tiny_model_factory("llama", hidden_size=64, intermediate_size=128)
    path = write_gguf(source, tmp_path / "tiny-fail.gguf", "Q4_1", "Q8_0")
    llm, tokens = _generate(path, monkeypatch, fused=True)
    runner = llm.engine.worker.model._decode_stack_runner
    assert isinstance(runner, DecodeStackRunner)
    config = llm.engine.model_config
    rows = 2
    hidden = torch.randn(rows, config.hidden_size)
    half = config.head_dim // 2
    cos, sin = torch.ones(rows, half), torch.zeros(rows, half)
    num_slots = runner.kv_pool.layer(0)[0].shape[0]
    page_table = torch.zeros(rows, 4, dtype=torch.long)
    lens = torch.ones(rows, dtype=torch.long)
    firsts = torch.zeros(rows, dtype=torch.long)
    bad_slots = torch.tensor([0, num_slots + 5])
    with pytest.raises(RuntimeError, match="out of range"):
        runner.stack.forward(hidden, None, cos, sin, bad_slots, page_table, lens, firsts, 8)
    with pytest.raises(RuntimeError, match="int64"):
        runner.stack.forward(hidden, None, cos, sin, bad_slots.int(), page_table, lens, firsts, 8)
    assert [r.token_ids for r in llm.generate(PROMPTS, PARAMS)] == tokens  # the engine still answers alike
