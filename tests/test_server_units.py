"""Server parts without a model: request validation and error mapping, SSE framing, admission, load, metrics."""

from __future__ import annotations

import json

import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from hearth.engine.engine import EngineStats
from hearth.server.admission import AdmissionController
from hearth.server.errors import APIError, from_validation_error
from hearth.server.generation import resolve_max_tokens
from hearth.server.load import LoadTracker
from hearth.server.metrics import ServerMetrics
from hearth.server.protocol import ChatCompletionRequest, CompletionRequest
from hearth.server.sse import DONE_EVENT, sse_event

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _error_for(model: type, body: dict | bytes) -> APIError:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(ValidationError) as excinfo:
        model.model_validate_json(raw)
    return from_validation_error(excinfo.value)


def test_valid_chat_request_keeps_openai_fields() -> None:
    request = ChatCompletionRequest.model_validate_json(
        json.dumps(
            {
                **CHAT,
                "max_completion_tokens": 5,
                "temperature": 0,
                "stop": "x",
                "stream": True,
                "stream_options": {"include_usage": True},
                "tool_choice": "auto",
                "unknown_new_field": 1,
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
            }
        )
    )
    assert request.max_completion_tokens == 5 and request.temperature == 0.0 and request.stop == "x"
    assert request.stream_options is not None and request.stream_options.include_usage


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"temperature": "hot"}, "temperature"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"max_tokens": "5"}, "max_tokens"),  # strict: no silent string-to-int coercion
        ({"max_tokens": 0}, "max_tokens"),
        ({"stream": "yes"}, "stream"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"stop": ["s"] * 17}, None),
        ({"seed": 2**64}, "seed"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}, "messages.0.content"),
    ],
)
def test_bad_chat_fields_name_the_param(patch: dict, param: str | None) -> None:
    error = _error_for(ChatCompletionRequest, {**CHAT, **patch})
    assert error.status_code == 400 and error.type == "invalid_request_error"
    assert error.param == param
    assert set(error.body()["error"]) == {"message", "type", "param", "code"}


def test_nan_and_infinity_are_rejected() -> None:
    for literal in (b"NaN", b"Infinity", b"-Infinity"):
        body = b'{"model": "m", "prompt": "x", "temperature": ' + literal + b"}"
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate_json(body)


def test_invalid_json_has_its_own_code() -> None:
    error = _error_for(CompletionRequest, b'{"prompt": ')
    assert error.code == "invalid_json" and error.param is None


@pytest.mark.parametrize("prompt", [[], [-1], 5, [[1], []], [["a"]]])
def test_bad_prompts_are_rejected(prompt: object) -> None:
    assert _error_for(CompletionRequest, {"prompt": prompt}).param == "prompt"


def test_max_tokens_resolution_checks_the_context() -> None:
    assert resolve_max_tokens(None, 100, 512, None, "messages") == 412
    assert resolve_max_tokens(None, 100, 512, 16, "prompt") == 16
    assert resolve_max_tokens(10, 100, 512, 16, "prompt") == 10
    with pytest.raises(APIError) as too_long:
        resolve_max_tokens(None, 512, 512, 16, "prompt")
    assert too_long.value.param == "prompt" and too_long.value.code == "context_length_exceeded"
    with pytest.raises(APIError) as past:
        resolve_max_tokens(413, 100, 512, 16, "prompt")
    assert past.value.param == "max_tokens" and "at most 412" in past.value.message


def test_sse_events_are_compact_json_lines() -> None:
    event = sse_event({"a": "ü", "b": [1, 2]})
    assert event == 'data: {"a":"ü","b":[1,2]}\n\n'.encode()
    assert DONE_EVENT == b"data: [DONE]\n\n"


def test_admission_counts_sequences_and_refuses_with_retry_after() -> None:
    admission = AdmissionController(max_running_seqs=2, max_waiting_seqs=1)
    admission.acquire(2)
    with pytest.raises(APIError) as refused:
        admission.acquire(2)
    assert refused.value.status_code == 429 and refused.value.headers == {"Retry-After": "1"}
    admission.acquire(1)
    admission.release(3)
    admission.acquire(3)
    admission.draining = True
    with pytest.raises(APIError) as draining:
        admission.acquire(1)
    assert draining.value.status_code == 503


def test_load_tracker_moves_tokens_from_prefill_to_decode() -> None:
    load = LoadTracker()
    load.start("a", 100)
    load.start("b", 50)
    assert (load.prefill_tokens, load.decode_tokens) == (150, 0)
    load.progress("a", 101)
    load.progress("a", 102)
    assert (load.prefill_tokens, load.decode_tokens) == (50, 102)
    load.finish("a")
    load.finish("b")
    load.finish("b")
    assert (load.prefill_tokens, load.decode_tokens) == (0, 0)


def test_metrics_render_engine_stats_and_histograms() -> None:
    stats = EngineStats(
        num_running=3,
        num_waiting=1,
        kv_pages_used=10,
        kv_pages_total=40,
        prefix_cache_queries_tokens=200,
        prefix_cache_hit_tokens=50,
        prompt_tokens_total=200,
        cached_tokens_total=50,
        generation_tokens_total=77,
        num_preemptions_total=0,
    )
    metrics = ServerMetrics("m", lambda: stats)
    metrics.ttft_s.observe(0.03)
    metrics.request_finished("stop")
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    value = {name: family.samples[0].value for name, family in families.items() if family.samples}
    assert value["hearth_num_requests_running"] == 3 and value["hearth_kv_pages_total"] == 40
    assert value["hearth_prefix_cache_hit_ratio"] == pytest.approx(0.25)
    assert value["hearth_generation_tokens"] == 77
    ttft = families["hearth_time_to_first_token_seconds"]
    assert any(s.name.endswith("_count") and s.value == 1 for s in ttft.samples)
    assert ServerMetrics("m", lambda: None).render()  # still loading: no engine numbers, no crash
