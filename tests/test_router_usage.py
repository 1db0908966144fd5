"""Usage rewriting: JSON bodies, SSE events cut anywhere, and prompt text extraction."""

from __future__ import annotations

import json

from hearth.router.tokens import (
    CharEstimator,
    TokenizerEstimator,
    max_output_tokens,
    prompt_text,
    prompt_token_ids,
)
from hearth.router.usage import (
    SSESplitter,
    cached_tokens_of,
    rewrite_event,
    rewrite_json_body,
    usage_from_body,
)

USAGE = {
    "prompt_tokens": 100,
    "completion_tokens": 5,
    "total_tokens": 105,
    "prompt_tokens_details": {"cached_tokens": 0},
}


def sse(payload: object) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def test_json_body_gets_the_given_cached_tokens_and_keeps_everything_else() -> None:
    body = json.dumps({"id": "x", "choices": [{"text": "hi"}], "usage": USAGE}).encode()
    out = json.loads(rewrite_json_body(body, 64))
    assert out["usage"]["prompt_tokens_details"] == {"cached_tokens": 64}
    assert out["usage"]["prompt_tokens"] == 100 and out["choices"] == [{"text": "hi"}]
    no_details = json.dumps({"usage": {"prompt_tokens": 3}}).encode()
    assert cached_tokens_of(json.loads(rewrite_json_body(no_details, 2))["usage"]) == 2
    assert rewrite_json_body(b"not json", 5) == b"not json"


def test_sse_split_at_any_byte_rewrites_only_the_usage_event() -> None:
    stream = (
        sse({"choices": [{"delta": {"content": "a"}}], "usage": None})
        + sse({"choices": [{"delta": {"content": "b"}}]})
        + sse({"choices": [], "usage": USAGE})
        + b"data: [DONE]\n\n"
    )
    for cut in range(1, len(stream)):
        splitter = SSESplitter()
        events = splitter.feed(stream[:cut]) + splitter.feed(stream[cut:])
        assert splitter.flush() == b""
        out = b"".join(rewrite_event(e, 7) if b'"usage": {' in e else e for e in events)
        parts = [p for p in out.split(b"\n\n") if p]
        assert len(parts) == 4
        assert json.loads(parts[2][6:])["usage"]["prompt_tokens_details"]["cached_tokens"] == 7
        assert parts[0] == stream.split(b"\n\n")[0]


def test_chunks_without_usage_pass_as_one_piece() -> None:
    splitter = SSESplitter()
    chunk = sse({"a": 1}) + sse({"b": 2})
    assert splitter.feed(chunk) == [chunk]


def test_usage_is_found_in_json_and_in_sse_answers() -> None:
    assert usage_from_body(json.dumps({"usage": USAGE}).encode()) == USAGE
    assert usage_from_body(sse({"usage": None}) + sse({"usage": USAGE}) + b"data: [DONE]\n\n") == USAGE
    assert usage_from_body(b"garbage") is None


def test_prompt_text_covers_tools_roles_and_content_parts() -> None:
    body = {
        "tools": [{"type": "function", "function": {"name": "search"}}],
        "messages": [
            {"role": "system", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "find "}, {"type": "text", "text": "cats"}],
            },
        ],
    }
    text = prompt_text(body)
    assert text.index("search") < text.index("be brief") < text.index("find cats")
    assert prompt_text({"prompt": "plain"}) == "plain"
    assert prompt_token_ids({"prompt": [1, 2, 3]}) == [1, 2, 3]
    assert prompt_token_ids({"prompt": "plain"}) is None
    assert max_output_tokens({"max_completion_tokens": 9, "max_tokens": 5}) == 9
    assert max_output_tokens({}) == 256


def test_estimators_count_tokens(tmp_path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    assert CharEstimator().count("x" * 41) == 11
    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    estimator = TokenizerEstimator(tmp_path)
    assert estimator.encode("hello world hello") == [1, 2, 1]
    assert estimator.count("hello zebra") == 2


def test_responses_usage_gets_the_prefill_sides_cached_tokens_in_json_and_events() -> None:
    from hearth.router.usage import cached_tokens_of, rewrite_event, rewrite_json_body

    usage = {"input_tokens": 100, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 5}
    body = json.dumps({"object": "response", "usage": usage}).encode()
    assert json.loads(rewrite_json_body(body, 64))["usage"]["input_tokens_details"]["cached_tokens"] == 64
    event = (
        b"event: response.completed\ndata: " + json.dumps({"response": {"usage": usage}}).encode() + b"\n\n"
    )
    rewritten = rewrite_event(event, 64)
    assert rewritten.startswith(b"event: response.completed\n")
    payload = json.loads(rewritten.split(b"data: ", 1)[1])
    assert cached_tokens_of(payload["response"]["usage"]) == 64


def test_messages_usage_moves_cached_tokens_out_of_input_tokens() -> None:
    from hearth.router.usage import cached_tokens_of, rewrite_event, rewrite_json_body

    usage = {
        "input_tokens": 100,
        "cache_read_input_tokens": 0,
        "cache_creation_input_tokens": 0,
        "output_tokens": 5,
    }
    rewritten = json.loads(rewrite_json_body(json.dumps({"type": "message", "usage": usage}).encode(), 64))
    assert rewritten["usage"]["cache_read_input_tokens"] == 64 and rewritten["usage"]["input_tokens"] == 36
    assert cached_tokens_of(rewritten["usage"]) == 64
    start = b"event: message_start\ndata: " + json.dumps({"message": {"usage": usage}}).encode() + b"\n\n"
    out = json.loads(rewrite_event(start, 64).split(b"data: ", 1)[1])
    assert out["message"]["usage"]["input_tokens"] == 36
    only_output = (
        b"event: message_delta\ndata: " + json.dumps({"usage": {"output_tokens": 5}}).encode() + b"\n\n"
    )
    assert rewrite_event(only_output, 64) == only_output


def test_cached_tokens_by_source_takes_the_prefill_split_and_keeps_the_decode_sides_peer_count() -> None:
    from hearth.router.usage import by_source_of, rewrite_event, rewrite_json_body

    decode = {"device": 0, "tier": 0, "store": 0, "peer": 96}
    prefill = {"device": 48, "tier": 32, "store": 0, "peer": 0}
    chat = {
        "prompt_tokens": 100,
        "prompt_tokens_details": {"cached_tokens": 0, "cached_tokens_by_source": decode},
    }
    out = json.loads(rewrite_json_body(json.dumps({"usage": chat}).encode(), 80, prefill))
    assert out["usage"]["prompt_tokens_details"] == {
        "cached_tokens": 80,
        "cached_tokens_by_source": {"device": 48, "tier": 32, "store": 0, "peer": 96},
    }
    messages = {"input_tokens": 100, "cache_read_input_tokens": 0, "cached_tokens_by_source": dict(decode)}
    event = b"event: message_start\ndata: " + json.dumps({"message": {"usage": messages}}).encode() + b"\n\n"
    payload = json.loads(rewrite_event(event, 80, prefill).split(b"data: ", 1)[1])
    usage = payload["message"]["usage"]
    assert (usage["input_tokens"], usage["cache_read_input_tokens"]) == (20, 80)
    assert by_source_of(usage) == {"device": 48, "tier": 32, "store": 0, "peer": 96}
    responses = {"input_tokens": 100, "input_tokens_details": {"cached_tokens": 0}}
    out = json.loads(rewrite_json_body(json.dumps({"usage": responses}).encode(), 80, prefill))
    assert by_source_of(out["usage"]) is None  # a worker without the extension: nothing invented
