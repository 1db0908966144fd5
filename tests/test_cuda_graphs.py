"""Decode CUDA graphs (`hearth.engine.cuda_graphs`): the sizes, the padding to them, which steps qualify,
and the whole engine on the graph path token for token against eager and transformers.

Without a GPU the "graphs" are the captured closures run eagerly over the same static buffers (the
padding rows, the scratch page and the attention backend's graph-safe decode path are all exercised);
on a GPU the engine test captures and replays real graphs."""

from __future__ import annotations

import pytest
import torch

from hearth.engine import cuda_graphs
from hearth.engine.cuda_graphs import (
    bucket_for,
    capture_sizes,
    is_plain_decode,
    pad_decode_step,
    wants_decode_graphs,
)
from hearth.engine.step_input import StepInput
from hearth.ops.attention.torch_ref import TorchRefBackend
from hearth.ops.attention.triton import TritonBackend
from hearth.parallel.state import ParallelState


def decode_step(seq_lens: list[int], page_size: int = 4) -> StepInput:
    """Plain decode rows; row r owns pages 10r, 10r+1, ... ."""
    width = max(-(-n // page_size) for n in seq_lens)
    table: list[int] = []
    for row, n in enumerate(seq_lens):
        pages = [10 * row + p for p in range(-(-n // page_size))]
        table += pages + [0] * (width - len(pages))
    return StepInput(
        token_ids=[5 + row for row in range(len(seq_lens))],
        positions=[n - 1 for n in seq_lens],
        query_start_loc=list(range(len(seq_lens) + 1)),
        seq_lens=seq_lens,
        num_decode_rows=len(seq_lens),
        page_table=table,
        page_table_width=width,
        slot_mapping=[(10 * row + (n - 1) // page_size) * page_size + (n - 1) % page_size
                      for row, n in enumerate(seq_lens)],
        logits_indices=list(range(len(seq_lens))),
        sampling=[],
    )  # fmt: skip


def test_capture_sizes_are_small_powers_then_steps_of_16_up_to_the_limit() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    with pytest.raises(ValueError):
        capture_sizes(0)


def test_bucket_is_the_smallest_size_that_holds_the_rows() -> None:
    sizes = capture_sizes(40)
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 5, 8, 9, 16, 17, 33, 40)] == [
        1,
        2,
        4,
        8,
        8,
        16,
        16,
        32,
        40,
        40,
    ]
    assert bucket_for(41, sizes) is None  # past the largest: eager


def test_padding_rows_read_and_write_only_the_scratch_page() -> None:
    step = decode_step([5, 9, 2])  # widths 2, 3, 1 pages
    padded = pad_decode_step(step, rows=4, scratch_page=99, page_size=4)
    tokens, positions, slots, lens = (padded.values[i * 4 : (i + 1) * 4] for i in range(4))
    assert tokens == [5, 6, 7, 0] and positions == [4, 8, 1, 0]
    assert slots == step.slot_mapping + [99 * 4] and lens == [5, 9, 2, 1]
    assert padded.width == 3 and len(padded.page_table) == 4 * 3
    assert padded.page_table[:9] == step.page_table and padded.page_table[9:] == [99, 99, 99]
    assert pad_decode_step(step, rows=3, scratch_page=99, page_size=4).values[:3] == [5, 6, 7]
    with pytest.raises(ValueError):
        pad_decode_step(step, rows=2, scratch_page=99, page_size=4)


def test_only_plain_decode_steps_qualify() -> None:
    assert is_plain_decode(decode_step([3, 7]))
    prefill = decode_step([3, 7])
    prefill.token_ids, prefill.positions = [1, 2, 3, 9], [0, 1, 2, 6]
    prefill.num_decode_rows = 1
    prefill.query_start_loc = [0, 3, 4]
    assert not is_plain_decode(prefill)
    unsampled = decode_step([3, 7])
    unsampled.logits_indices = [1]  # a row that does not sample (another rank's, say)
    assert not is_plain_decode(unsampled)
    assert not is_plain_decode(StepInput([], [], [0], [], 0, [], 0, [], [], []))  # no rows


def test_graphs_are_wanted_on_cuda_only_unless_eager_is_forced() -> None:
    one = ParallelState()
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert wants_decode_graphs(False, cuda, TritonBackend, one)
    assert not wants_decode_graphs(True, cuda, TritonBackend, one)  # --enforce-eager
    assert not wants_decode_graphs(False, cpu, TritonBackend, one)
    assert not wants_decode_graphs(False, cuda, TorchRefBackend, one)  # no graph-safe decode path
    assert not wants_decode_graphs(False, cuda, TritonBackend, ParallelState(tp_size=2))


def test_a_backend_without_a_graph_safe_path_is_refused() -> None:
    backend = TorchRefBackend(device="cpu", page_size=4, max_num_seqs=4, max_pages_per_seq=4)
    with pytest.raises(ValueError, match="graph-safe"):
        cuda_graphs.DecodeGraphs(
            lambda *a: torch.zeros(1), backend, scratch_page=0, max_rows=4, capture=False
        )


@pytest.mark.triton
@pytest.mark.parametrize(
    ("arch", "overrides", "kv_cache_dtype"),
    # MLA with dense layers only: on CUDA a float32 MoE layer runs the per-expert loop, which reads
    # counts on the host and cannot be captured (such models decode eagerly; bf16 MoE is captured).
    [
        ("llama", {}, "auto"),
        ("deepseek_v3", {"first_k_dense_replace": 3}, "auto"),
        ("mistral", {"sliding_window": 6}, "auto"),
        ("llama", {}, "fp8_e4m3"),
    ],
    ids=["llama", "mla", "sliding-window", "fp8-kv"],
)
def test_engine_on_decode_graphs_matches_eager(
    tiny_model_factory, monkeypatch, arch, overrides, kv_cache_dtype
) -> None:
    """Three rows (padded to 4), then two and one as rows finish: every decode step replays a graph; the
    tokens are eager's (and, for llama, transformers')."""
    pytest.importorskip("triton")
    from hf_oracle import hf_greedy

    from hearth import LLM, SamplingParams
    from hearth.engine import worker as worker_module

    monkeypatch.setenv("HEARTH_ATTENTION_BACKEND", "triton")
    monkeypatch.setenv("HEARTH_TRITON_KERNELS", "1")
    if not torch.cuda.is_available():  # the graph path without a GPU: closures over the static buffers
        monkeypatch.setattr(worker_module, "wants_decode_graphs", lambda eager, *rest: not eager)
    model_dir = tiny_model_factory(arch, **overrides)
    prompts = [[(7 * i + 3 * n) % 400 + 3 for i in range(n)] for n in (1, 9, 21)]
    lengths = [7, 3, 5]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    options = {
        "dtype": "float32", "page_size": 4, "max_num_seqs": 6, "kv_cache_memory_gib": 0.01,
        "kv_cache_dtype": kv_cache_dtype,
    }  # fmt: skip
    llm = LLM(str(model_dir), **options)
    graphs = llm.engine.worker.decode_graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 6]
    assert graphs.scratch_page == llm.engine.kv.num_pages  # one page past the allocator's
    assert llm.engine.worker.kv_pool.num_pages == llm.engine.kv.num_pages + 1
    results = llm.generate(prompts, params)
    assert graphs.num_replays >= max(lengths) - 1  # every step after the prefill
    eager = LLM(str(model_dir), enforce_eager=True, **options)
    assert eager.engine.worker.decode_graphs is None
    eager_results = eager.generate(prompts, params)
    for prompt, n, result, eager_result in zip(prompts, lengths, results, eager_results, strict=True):
        assert result.token_ids == eager_result.token_ids, f"prompt of {len(prompt)} tokens"
        if arch == "llama" and kv_cache_dtype == "auto":
            assert result.token_ids == hf_greedy(model_dir, prompt, n), f"prompt of {len(prompt)} tokens"
