"""Request fields vLLM and OpenAI clients send, each honoured or refused with a 400 naming it, through a live
server: prompt logprobs and echo + logprobs (checked against transformers), logit_bias, vLLM's
structured_outputs / guided_* aliases, reasoning_effort, unsupported fields."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from tiny_models import CHATML_TEMPLATE, make_tiny_model

from hearth.server.process import ServerProcess

PROMPT = [11, 42, 7, 300, 5, 99, 123, 64, 8, 250, 17, 3]
EFFORT_TEMPLATE = (
    "{%- if reasoning_effort is defined %}{{- '<|im_start|>system\\nEffort: ' + reasoning_effort + "
    "'<|im_end|>\\n' }}{%- endif %}" + CHATML_TEMPLATE
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("fields") / "tiny")


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("fields-serve")
    template = root / "template.jinja"
    template.write_text(EFFORT_TEMPLATE)
    args = [str(model_dir), "--dtype", "float32", "--kv-cache-memory", "0.02", "--max-model-len", "512"]
    with ServerProcess([*args, "--chat-template", str(template)], root / "server.log") as process:
        yield process


@pytest.fixture
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def _hf_logprobs(model_dir: Path, prompt: list[int]) -> torch.Tensor:
    from hf_oracle import _load

    with torch.no_grad():
        logits = _load(str(model_dir))(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def _error(response: httpx.Response, param: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"].split(".")[0] == param, error  # dotted: the field, then the key inside it
    return error["message"]


# ---- echo + logprobs, prompt_logprobs ---------------------------------------------------------------


def test_echo_with_logprobs_scores_every_prompt_token_but_the_first(
    http: httpx.Client, model_dir: Path
) -> None:
    body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "logprobs": 2, "echo": True}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    logprobs = choice["logprobs"]
    expected = _hf_logprobs(model_dir, PROMPT)
    assert len(logprobs["token_logprobs"]) == len(PROMPT) + 1  # the prompt, then the generated token
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for position in range(1, len(PROMPT)):
        assert logprobs["token_logprobs"][position] == pytest.approx(
            expected[position - 1, PROMPT[position]].item(), abs=1e-4
        )
        assert len(logprobs["top_logprobs"][position]) <= 2
        assert max(logprobs["top_logprobs"][position].values()) == pytest.approx(
            expected[position - 1].max().item(), abs=1e-4
        )
    generated = int(expected[-1].argmax())
    assert logprobs["token_logprobs"][-1] == pytest.approx(expected[-1, generated].item(), abs=1e-4)
    assert choice["text"].endswith(logprobs["tokens"][-1])


def test_streamed_echo_carries_the_prompt_logprobs_first(http: httpx.Client) -> None:
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "logprobs": 0, "echo": True, "stream": True}
    events = []
    with http.stream("POST", "/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    first = events[0]["choices"][0]["logprobs"]
    assert len(first["token_logprobs"]) == len(PROMPT)
    assert first["token_logprobs"][0] is None and all(v is not None for v in first["token_logprobs"][1:])


def test_prompt_logprobs_in_vllms_shape(http: httpx.Client, model_dir: Path) -> None:
    body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 1}
    entries = http.post("/v1/completions", json=body).json()["choices"][0]["prompt_logprobs"]
    expected = _hf_logprobs(model_dir, PROMPT)
    assert len(entries) == len(PROMPT) and entries[0] is None
    for position in range(1, len(PROMPT)):
        entry = entries[position]
        token = entry[str(PROMPT[position])]
        assert token["logprob"] == pytest.approx(expected[position - 1, PROMPT[position]].item(), abs=1e-4)
        assert (
            token["rank"]
            == int((expected[position - 1] > expected[position - 1, PROMPT[position]]).sum()) + 1
        )
        best = str(int(expected[position - 1].argmax()))
        assert entry[best]["rank"] == 1


def test_chat_prompt_logprobs_and_reasoning_effort_reach_the_template(http: httpx.Client) -> None:
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1,
        "prompt_logprobs": 0,
        "reasoning_effort": "high",
    }
    answer = http.post("/v1/chat/completions", json=body).json()
    text = "".join(next(iter(entry.values()))["decoded_token"] for entry in answer["prompt_logprobs"][1:])
    assert "Effort: high" in text
    without = {**body}
    del without["reasoning_effort"]
    plain = http.post("/v1/chat/completions", json=without).json()
    assert len(plain["prompt_logprobs"]) < len(answer["prompt_logprobs"])


# ---- logit_bias -------------------------------------------------------------------------------------


def test_logit_bias_forces_a_token(http: httpx.Client) -> None:
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "logit_bias": {"77": 100}}
    tokens = http.post("/v1/completions", json={**body, "logprobs": 0}).json()["choices"][0]["logprobs"]
    plain = http.post(
        "/tokenize", json={"prompt": "".join(tokens["tokens"]), "add_special_tokens": False}
    ).json()
    assert plain["tokens"] == [77, 77, 77]


@pytest.mark.parametrize(
    ("bias", "message"),
    [({"100000": 5}, "vocabulary size"), ({"abc": 5}, "token ids"), ({"3": 200}, "100")],
)
def test_bad_logit_bias_is_a_400_naming_it(http: httpx.Client, bias: dict, message: str) -> None:
    for path, body in (
        ("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
    ):
        assert message in _error(http.post(path, json={**body, "logit_bias": bias}), "logit_bias")


# ---- structured outputs (vLLM's names) --------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "check"),
    [
        ({"guided_choice": ["yes", "no"]}, lambda text: text in ("yes", "no")),
        ({"structured_outputs": {"choice": ["left", "right"]}}, lambda text: text in ("left", "right")),
        ({"guided_regex": "[0-9]{3}-[a-c]"}, lambda text: re.fullmatch(r"[0-9]{3}-[a-c]", text)),
        (
            {"guided_json": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}},
            lambda text: isinstance(json.loads(text)["n"], int),
        ),
        (
            {
                "structured_outputs": {
                    "json": {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"]}
                }
            },
            lambda text: isinstance(json.loads(text)["b"], bool),
        ),
    ],
)
def test_vllm_structured_output_fields_constrain_the_answer(http: httpx.Client, fields: dict, check) -> None:
    body = {"prompt": "Answer:", "max_tokens": 40, "temperature": 1.0, "seed": 3, **fields}
    text = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert check(text), text


def test_two_constraints_are_refused(http: httpx.Client) -> None:
    body = {
        "prompt": "x",
        "max_tokens": 2,
        "guided_choice": ["a"],
        "response_format": {"type": "json_object"},
    }
    _error(http.post("/v1/completions", json=body), "guided_choice")
    body = {"prompt": "x", "max_tokens": 2, "structured_outputs": {"choice": ["a"], "regex": "b"}}
    _error(http.post("/v1/completions", json=body), "structured_outputs")


# ---- unsupported fields -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field",
    [
        {"best_of": 3},
        {"use_beam_search": True},
        {"functions": [{"name": "f"}]},
        {"allowed_token_ids": [1, 2]},
        {"truncate_prompt_tokens": 5},
    ],
)
def test_fields_hearth_does_not_do_are_refused_by_name(http: httpx.Client, field: dict) -> None:
    (name,) = field
    body = {"prompt": "hi", "max_tokens": 1, **field}
    assert "not supported" in _error(http.post("/v1/completions", json=body), name)


def test_fields_that_change_nothing_are_accepted(http: httpx.Client) -> None:
    body = {
        "prompt": "hi",
        "max_tokens": 1,
        "best_of": 1,
        "store": False,
        "metadata": {"k": "v"},
        "user": "u",
    }
    assert http.post("/v1/completions", json=body).status_code == 200


# ---- what vLLM users' probes and proxies expect ------------------------------------------------------


def test_version_and_ping(http: httpx.Client) -> None:
    import hearth

    assert http.get("/version").json() == {"version": hearth.__version__}
    assert http.get("/ping").status_code == 200
    assert http.post("/ping").status_code == 200


def test_x_request_id_is_echoed(http: httpx.Client) -> None:
    response = http.post(
        "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers={"X-Request-Id": "abc-1"}
    )
    assert response.headers["x-request-id"] == "abc-1"
    refused = http.post(
        "/v1/completions", json={"prompt": "hi", "best_of": 2}, headers={"X-Request-Id": "abc-2"}
    )
    assert refused.status_code == 400 and refused.headers["x-request-id"] == "abc-2"
    assert "x-request-id" not in http.get("/health").headers
