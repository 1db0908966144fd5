"""`hearth eval`: teacher-forced scores through the engine, tool-call validity, and the command's output."""

from __future__ import annotations

import json
import os

import torch
from hf_oracle import _load

from hearth.engine.llm import LLM
from hearth.eval.cli import parse_config
from hearth.eval.scoring import score_texts, text_logprobs
from hearth.eval.tool_calls import tool_call_problem

WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def test_tool_call_validity_rule():
    ok = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    assert tool_call_problem(ok, WEATHER) is None
    assert tool_call_problem("It is sunny.", WEATHER) == "no <tool_call>...</tool_call>"
    assert "not offered" in tool_call_problem(ok.replace("get_weather", "get_time"), WEATHER)
    assert "schema" in tool_call_problem(ok.replace('"city": "Paris"', '"town": "Paris"'), WEATHER)
    assert tool_call_problem("<tool_call>{oops}</tool_call>", WEATHER) == "call is not JSON"


def test_text_logprobs_match_transformers(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", enable_prefix_caching=False, kv_cache_memory_gib=0.02)
    ids = list(range(5, 45))
    got = text_logprobs(llm, ids)
    with torch.no_grad():
        logits = _load(str(tiny_llama))(input_ids=torch.tensor([ids])).logits[0, :-1].double()
    torch.testing.assert_close(got, torch.log_softmax(logits, -1), rtol=1e-4, atol=1e-4)


def test_chunked_scoring_equals_one_prefill(tiny_llama):
    """Chunks of 16 (the INT4 kernel's row counts) attend to the KV earlier chunks wrote: the same logprobs
    as one prefill, for lengths that end mid-chunk and on a chunk boundary plus one token."""
    llm = LLM(str(tiny_llama), dtype="float32", enable_prefix_caching=False, kv_cache_memory_gib=0.02)
    for ids in (list(range(5, 45)), list(range(7, 40))):  # 40 and 33 tokens
        whole = text_logprobs(llm, ids)
        chunked = text_logprobs(llm, ids, chunk_tokens=16)
        assert chunked.shape == whole.shape
        torch.testing.assert_close(chunked, whole, rtol=1e-4, atol=1e-4)


def test_scores_against_itself_and_against_fp8_kv(tiny_llama):
    ref = LLM(
        str(tiny_llama), enable_prefix_caching=False, kv_cache_memory_gib=0.02, kv_cache_dtype="float32"
    )
    fp8 = LLM(
        str(tiny_llama), enable_prefix_caching=False, kv_cache_memory_gib=0.02, kv_cache_dtype="fp8_e4m3"
    )
    texts = [list(range(3, 60)), list(range(100, 140))]
    scores = score_texts({"ref": ref, "same": ref, "fp8": fp8}, "ref", texts)
    assert scores["same"].agree == scores["same"].num_tokens == 95 and abs(scores["same"].kl) < 1e-9
    assert scores["same"].perplexity == scores["ref"].perplexity
    assert 0 < scores["fp8"].kl < 0.05 and scores["fp8"].agree >= 0.8 * 95


def test_eval_command_writes_json_and_markdown(tiny_llama, tmp_path):
    from hearth.cli import main

    eval_set = tmp_path / "set.json"
    prompt = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": WEATHER}
    eval_set.write_text(
        json.dumps({"texts": ["hello world, this is a held-out text"] * 2, "tool_prompts": [prompt]})
    )
    out, md = tmp_path / "out.json", tmp_path / "out.md"
    assert parse_config("a:kv_cache_dtype=fp8_e4m3,page_size=8") == (
        "a",
        {"kv_cache_dtype": "fp8_e4m3", "page_size": 8},
    )
    code = main(
        [
            "eval",
            "--model",
            str(tiny_llama),
            "--eval-set",
            str(eval_set),
            "--config",
            "ref:kv_cache_dtype=bfloat16",
            "--config",
            "fp8:kv_cache_dtype=fp8_e4m3",
            "--config",
            "int4:quantization=int4,int4_activations=float,score_chunk=16",
            "--max-new-tokens",
            "8",
            "--kv-cache-memory",
            "0.02",
            "--json",
            str(out),
            "--markdown",
            str(md),
        ]
    )
    assert code == 0
    results = json.loads(out.read_text())
    assert set(results["configs"]) == {"ref", "fp8", "int4"}
    assert results["configs"]["int4"]["options"]["score_chunk"] == 16
    assert "HEARTH_INT4_ACTIVATIONS" not in os.environ  # set only while that configuration was built
    fp8 = results["configs"]["fp8"]
    assert fp8["kv_tokens_ratio"] == 2.0 or abs(fp8["kv_tokens_ratio"] - 2.0) < 0.01
    assert 0 <= fp8["greedy_agreement"] <= 1 and fp8["tool_calls"]["num_prompts"] == 1
    assert "| fp8 |" in md.read_text()
