"""FP8 KV through the engine and the server: scales from the checkpoint or calibration, twice the tokens
held in the same memory, and greedy answers close to a float KV cache."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import httpx
import pytest
import torch

from hearth.engine.fp8_kv_scales import calibrate_kv_amax, calibration_token_ids
from hearth.engine.llm import LLM
from hearth.engine.sampling_params import SamplingParams
from hearth.ops.fp8 import scales_from_amax
from hearth.server.process import ServerProcess

PROMPTS = ["Hello there, how are you", "The weather in Paris is", "def add(a, b):", "Once upon a time"]


def greedy(llm: LLM, max_tokens: int = 16) -> list[list[int]]:
    results = llm.generate(PROMPTS, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    return [list(r.token_ids) for r in results]


def test_calibrated_scales_are_the_measured_maxima_never_one(tiny_llama):
    llm = LLM(str(tiny_llama), kv_cache_dtype="fp8_e4m3", kv_cache_memory_gib=0.01)
    worker = llm.engine.worker
    pool = worker.kv_pool
    assert pool.k_scales is not None and pool.k_scales.shape == (2, 2)
    k_amax, v_amax = calibrate_kv_amax(
        worker.model, pool.layout, pool.device, calibration_token_ids(tiny_llama, 10_000)
    )
    torch.testing.assert_close(pool.k_scales.cpu(), scales_from_amax(k_amax).cpu())
    torch.testing.assert_close(pool.v_scales.cpu(), scales_from_amax(v_amax).cpu())
    assert not torch.any(pool.k_scales == 1.0)


def test_checkpoint_kv_scales_are_used_as_shipped(tiny_llama, tmp_path):
    from safetensors.torch import load_file, save_file

    model = tmp_path / "with-scales"
    shutil.copytree(tiny_llama, model)
    tensors = load_file(model / "model.safetensors")
    for layer in range(2):
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(0.01 * (layer + 1))
        tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor([0.02, 0.03])
    save_file(tensors, model / "model.safetensors")
    llm = LLM(str(model), kv_cache_dtype="fp8_e4m3", kv_cache_memory_gib=0.01)
    pool = llm.engine.worker.kv_pool
    torch.testing.assert_close(pool.k_scales.cpu(), torch.tensor([[0.01, 0.01], [0.02, 0.02]]))
    torch.testing.assert_close(pool.v_scales.cpu(), torch.tensor([[0.02, 0.03], [0.02, 0.03]]))
    # A float KV cache ignores them: the same checkpoint still loads.
    LLM(str(model), kv_cache_memory_gib=0.01)


def test_fp8_kv_holds_twice_the_tokens_and_answers_like_fake_quantized_float_kv(tiny_llama, monkeypatch):
    """The FP8 engine (CPU kernels: fused quantizing write, FP8 decode attention) against a float32-KV engine
    whose store rounds K/V through FP8 with the same scales (torch paths): the same greedy tokens."""
    from hearth.ops import cpu_kernels
    from hearth.ops.fp8 import fake_quantize_fp8

    cpu_kernels.paged_decode_attention_kernel(wait=True)
    bf16 = LLM(str(tiny_llama), kv_cache_dtype="bfloat16", kv_cache_memory_gib=1 / 64)
    fp8 = LLM(str(tiny_llama), kv_cache_dtype="fp8_e4m3", kv_cache_memory_gib=1 / 64)  # whole pages in both
    assert fp8.engine.num_kv_tokens == 2 * bf16.engine.num_kv_tokens
    got = greedy(fp8)

    # Eager: its store is patched after start, which decode CUDA graphs captured at start would not see.
    reference = LLM(str(tiny_llama), kv_cache_dtype="float32", kv_cache_memory_gib=1 / 64, enforce_eager=True)
    pool, scales = reference.engine.worker.kv_pool, fp8.engine.worker.kv_pool
    float_store = pool.store

    def fake_quantizing_store(layer, slot_mapping, k, v):  # type: ignore[no-untyped-def]
        k_scale, v_scale = scales.kv_scales(layer)
        float_store(layer, slot_mapping, fake_quantize_fp8(k, k_scale), fake_quantize_fp8(v, v_scale))

    monkeypatch.setattr(pool, "store", fake_quantizing_store)
    # The fused rotary writes (CPU kernel, Triton on CUDA) would write unrounded K/V past `store`.
    monkeypatch.setattr("hearth.model.layers.rotary_write_kv_kernel", lambda: None)
    monkeypatch.setattr("hearth.model.layers.use_triton_kernels", lambda tensor: False)
    assert greedy(reference) == got


@pytest.fixture(scope="module")
def fp8_server(tmp_path_factory) -> ServerProcess:
    from tiny_models import make_tiny_model

    root = tmp_path_factory.mktemp("serve-fp8")
    model = make_tiny_model(root / "tiny")
    args = [
        "--model",
        str(model),
        "--kv-cache-dtype",
        "fp8_e4m3",
        "--kv-cache-memory",
        "0.02",
        "--max-model-len",
        "256",
    ]
    process = ServerProcess(args, root / "server.log")
    with process:
        yield process


def test_server_serves_fp8_kv_and_reports_tokens_held(fp8_server: ServerProcess, tiny_llama: Path):
    with httpx.Client(base_url=fp8_server.url, timeout=60) as http:
        body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        reply = http.post("/v1/completions", json=body).json()
        metrics = http.get("/metrics").text
    in_process = LLM(str(tiny_llama), kv_cache_dtype="fp8_e4m3", kv_cache_memory_gib=0.02, max_model_len=256)
    expected = in_process.generate(
        [PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    )
    assert reply["choices"][0]["text"] == expected[0].text
    held = re.search(r"hearth_kv_cache_tokens\{[^}]*\} ([0-9.e+]+)", metrics)
    assert held is not None, metrics
    assert float(held.group(1)) == in_process.engine.num_kv_tokens
    log = fp8_server.log()
    assert "float8_e4m3fn" in log and "scales from calibrated" in log
