"""The bundled demo model and its draft: they load and generate in plain transformers, their chat template
renders tools, tool calls and tool results (and is plain jinja2), and the quality script runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = REPO_ROOT / "scripts"
TARGET_DIR = REPO_ROOT / "models" / "demo"
DRAFT_DIR = REPO_ROOT / "models" / "demo-draft"
MODEL_DIRS = [TARGET_DIR, DRAFT_DIR]

sys.path.insert(0, str(SCRIPTS))
import demo_data  # noqa: E402
import eval_demo_model  # noqa: E402

transformers = pytest.importorskip("transformers")

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name"}},
            "required": ["city"],
        },
    },
}
TOOL_CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What's the weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        ],
    },
    {"role": "tool", "content": '{"temperature": 18, "condition": "sunny"}'},
    {"role": "assistant", "content": "It is 18 degrees and sunny in Paris."},
    {"role": "user", "content": "And in Rome?"},
]


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(str(TARGET_DIR))


@pytest.fixture(scope="module")
def target():
    return transformers.AutoModelForCausalLM.from_pretrained(str(TARGET_DIR), dtype=torch.float32).eval()


@pytest.mark.parametrize("model_dir", MODEL_DIRS, ids=["demo", "demo-draft"])
def test_model_dir_has_the_files_a_server_needs(model_dir: Path) -> None:
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "README.md",
    ):
        assert (model_dir / name).is_file(), f"{model_dir.name} lacks {name}"
    config = json.loads((model_dir / "config.json").read_text())
    generation = json.loads((model_dir / "generation_config.json").read_text())
    tokenizer_json = json.loads((model_dir / "tokenizer.json").read_text())
    im_end_id = next(t["id"] for t in tokenizer_json["added_tokens"] if t["content"] == "<|im_end|>")
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["max_position_embeddings"] >= 2048
    assert config["eos_token_id"] == im_end_id
    assert generation["eos_token_id"] == im_end_id


def test_weights_are_bf16_and_within_size_budget() -> None:
    from safetensors import safe_open

    for model_dir, max_params in ((TARGET_DIR, 10_500_000), (DRAFT_DIR, 2_500_000)):
        with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
            tensors = [f.get_tensor(k) for k in f.keys()]
        assert {t.dtype for t in tensors} == {torch.bfloat16}
        assert sum(t.numel() for t in tensors) <= max_params
    draft_bytes = (DRAFT_DIR / "model.safetensors").stat().st_size
    assert draft_bytes * 2 < (TARGET_DIR / "model.safetensors").stat().st_size


def test_draft_shares_the_target_tokenizer() -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (TARGET_DIR / name).read_bytes() == (DRAFT_DIR / name).read_bytes()
    target_vocab = json.loads((TARGET_DIR / "config.json").read_text())["vocab_size"]
    assert json.loads((DRAFT_DIR / "config.json").read_text())["vocab_size"] == target_vocab


@pytest.mark.parametrize("model_dir", MODEL_DIRS, ids=["demo", "demo-draft"])
def test_model_generates_in_plain_transformers(model_dir: Path, tokenizer) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir))
    text = tokenizer.apply_chat_template(
        TOOL_CONVERSATION[:2], tools=[WEATHER_TOOL], add_generation_prompt=True, tokenize=False
    )
    input_ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    output = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=6,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
    )
    assert output.shape[1] > input_ids.shape[1]
    assert tokenizer.decode(output[0, input_ids.shape[1] :]).strip()


def test_chat_template_renders_tools_calls_and_results(tokenizer) -> None:
    text = tokenizer.apply_chat_template(
        TOOL_CONVERSATION, tools=[WEATHER_TOOL], add_generation_prompt=True, tokenize=False
    )
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n")
    assert "<tools>\n" + json.dumps(WEATHER_TOOL) + "\n</tools>" in text
    assert (
        '<|im_start|>assistant\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
        "<|im_end|>" in text
    )
    assert (
        '<|im_start|>user\n<tool_response>\n{"temperature": 18, "condition": "sunny"}\n</tool_response>'
        in text
    )
    assert text.endswith("<|im_start|>user\nAnd in Rome?<|im_end|>\n<|im_start|>assistant\n")


def test_chat_template_accepts_openai_string_arguments(tokenizer) -> None:
    messages = [dict(m) for m in TOOL_CONVERSATION[:3]]
    messages[2]["tool_calls"] = [
        {
            "id": "c1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }
    ]
    text = tokenizer.apply_chat_template(messages, tools=[WEATHER_TOOL], tokenize=False)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text


def test_chat_template_is_plain_jinja2_and_matches_training_renderer(tokenizer) -> None:
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda value: json.dumps(value, ensure_ascii=False)
    template = env.from_string(
        json.loads((TARGET_DIR / "tokenizer_config.json").read_text())["chat_template"]
    )
    for conv in demo_data.conversations(seed=7, count=20):
        expected = tokenizer.apply_chat_template(conv.messages, tools=conv.tools, tokenize=False)
        assert (
            template.render(messages=conv.messages, tools=conv.tools, add_generation_prompt=False) == expected
        )
        assert demo_data.render_conversation(conv) == expected


def test_tool_tags_and_chatml_markers_are_single_tokens(tokenizer) -> None:
    for token in demo_data.SPECIAL_TOKENS + demo_data.TOOL_TOKENS:
        assert len(tokenizer(token, add_special_tokens=False)["input_ids"]) == 1, token
    # Tool tags are not "special": decoding with skip_special_tokens keeps them for the tool-call parser.
    ids = tokenizer("<tool_call>{}</tool_call><|im_end|>", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<tool_call>{}</tool_call>"


def test_target_answers_a_request_for_its_one_offered_tool_with_a_valid_call(tokenizer, target) -> None:
    tool = demo_data.TOOLS_BY_NAME["get_weather"].schema()
    messages = [{"role": "user", "content": "What's the weather in Paris?"}]
    text = tokenizer.apply_chat_template(messages, tools=[tool], add_generation_prompt=True, tokenize=False)
    input_ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    output = target.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=40,
        do_sample=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    assert output[0, -1].item() == tokenizer.eos_token_id  # the call ends the turn
    answer = tokenizer.decode(output[0, input_ids.shape[1] :], skip_special_tokens=True)
    check = eval_demo_model.check_tool_calls(answer, [tool])
    assert check.valid, (check.reason, answer)
    assert check.names == ["get_weather"]


def test_conversation_generator_is_deterministic_per_seed() -> None:
    first = [demo_data.render_conversation(c) for c in demo_data.conversations(seed=3, count=30)]
    again = [demo_data.render_conversation(c) for c in demo_data.conversations(seed=3, count=30)]
    other = [demo_data.render_conversation(c) for c in demo_data.conversations(seed=4, count=30)]
    assert first == again
    assert first != other


def test_every_request_template_fills_the_required_parameters() -> None:
    assert len(demo_data.TOOLS) >= 30
    for tool in demo_data.TOOLS:
        required = {p.name for p in tool.params if p.required}
        for template in tool.requests:
            assert required <= set(demo_data._slots(template)), (tool.name, template)


def test_generated_calls_fit_their_own_schemas() -> None:
    for conv in demo_data.conversations(seed=11, count=200):
        for index in conv.call_indices:
            calls = conv.messages[index]["tool_calls"]
            text = "".join(
                "<tool_call>"
                + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
                + "</tool_call>"
                for c in calls
            )
            check = eval_demo_model.check_tool_calls(text, conv.tools)
            assert check.valid, (check.reason, text)


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        ("It is sunny.", "no <tool_call>"),
        ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}</tool_call>', "not JSON"),
        ('<tool_call>{"name": "get_time", "arguments": {"city": "Paris"}}</tool_call>', "not offered"),
        ('<tool_call>{"name": "get_weather", "arguments": {"city": 3}}</tool_call>', "schema"),
        ('<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>', "schema"),
        ('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "x": 1}}</tool_call>', "schema"),
        ('<tool_call>{"name": "get_weather", "arguments": "Oslo"}</tool_call>', "not a JSON object"),
    ],
)
def test_check_tool_calls_rejects_malformed_answers(answer: str, reason: str) -> None:
    check = eval_demo_model.check_tool_calls(answer, [WEATHER_TOOL])
    assert not check.valid
    assert reason in check.reason


def test_check_tool_calls_accepts_a_valid_call() -> None:
    check = eval_demo_model.check_tool_calls(
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>', [WEATHER_TOOL]
    )
    assert check.valid and check.names == ["get_weather"] and check.arguments == [{"city": "Oslo"}]


def test_quality_script_runs_on_a_small_sample(tmp_path: Path) -> None:
    out = tmp_path / "quality.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPTS / "eval_demo_model.py"),
            "--num-prompts",
            "3",
            "--num-ppl-conversations",
            "2",
            "--stdlib-chars",
            "2000",
            "--threads",
            "1",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(out.read_text())
    assert results["tool_calls"]["num_prompts"] == 3
    assert 0.0 <= results["tool_calls"]["valid_tool_call_share"] <= 1.0
    for source in ("conversations", "stdlib"):
        assert results[source]["num_tokens"] > 0
        assert 1.0 < results[source]["target_ppl"] < 4096
        assert 1.0 < results[source]["draft_ppl"] < 4096
        assert 0.0 <= results[source]["draft_agreement"] <= 1.0
    # A trained target must beat its 4x smaller draft on the text it was trained for.
    assert results["conversations"]["target_loss"] < results["conversations"]["draft_loss"]
