"""Chat templates render exactly what transformers' `apply_chat_template` renders on the same checkpoint."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest
from tiny_models import write_tokenizer

from hearth.server.chat_template import ChatTemplate, ChatTemplateError, normalize_messages

# A template in the style of Qwen 2.5: block tags on their own lines (trim_blocks/lstrip_blocks matter),
# namespace, loop controls, tojson with arguments, raise_exception and strftime_now.
QWEN_STYLE_TEMPLATE = """{% set ns = namespace(system_seen=false) %}
{% for message in messages %}
    {% if message.role == 'system' %}
        {% set ns.system_seen = true %}
    {% endif %}
{% endfor %}
{% if tools %}
<|im_start|>system
{% if ns.system_seen %}{{ messages[0].content }}{% else %}Today is {{ strftime_now('%Y') | length }} digits.{% endif %}

# Tools
<tools>
{% for tool in tools %}
{{ tool | tojson }}
{% endfor %}
</tools><|im_end|>
{% elif not ns.system_seen %}
<|im_start|>system
You are helpful.<|im_end|>
{% endif %}
{% for message in messages %}
    {% if message.role == 'system' %}
        {% if not tools %}<|im_start|>system
{{ message.content }}<|im_end|>
{% endif %}
        {% continue %}
    {% elif message.role not in ['user', 'assistant', 'tool'] %}
        {{ raise_exception('unknown role ' + message.role) }}
    {% endif %}
<|im_start|>{{ 'user' if message.role == 'tool' else message.role }}
{% if message.role == 'tool' %}<tool_response>
{{ message.content }}
</tool_response>{% else %}{{ message.content or '' }}{% endif %}
{% for call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson(sort_keys=true) }}}
</tool_call>
{% endfor %}
<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather <now> & forecast",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Ünïcode ✓ <b>"}],
    [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'},
        {"role": "assistant", "content": "It is 21 degrees."},
        {"role": "user", "content": "And tomorrow?"},
    ],
]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    checkpoint = tmp_path_factory.mktemp("checkpoint")
    write_tokenizer(checkpoint, vocab_size=300)
    qwen_style = tmp_path_factory.mktemp("qwen_style")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(checkpoint / name, qwen_style / name)
    config = json.loads((qwen_style / "tokenizer_config.json").read_text())
    config["chat_template"] = QWEN_STYLE_TEMPLATE
    (qwen_style / "tokenizer_config.json").write_text(json.dumps(config))
    return {"checkpoint": checkpoint, "qwen_style": qwen_style}


@functools.cache
def _transformers_tokenizer(model_dir: Path) -> object:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.mark.parametrize("template_name", ["checkpoint", "qwen_style"])
@pytest.mark.parametrize("with_tools", [False, True])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_render_matches_transformers(
    model_dirs: dict[str, Path], template_name: str, with_tools: bool, conversation: int
) -> None:
    model_dir = model_dirs[template_name]
    messages = CONVERSATIONS[conversation]
    tools = [WEATHER_TOOL] if with_tools else None
    template = ChatTemplate.from_dir(model_dir)
    reference = _transformers_tokenizer(model_dir)
    for add_generation_prompt in (True, False):
        ours = template.render(messages, tools=tools, add_generation_prompt=add_generation_prompt)
        theirs = reference.apply_chat_template(  # type: ignore[attr-defined]
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        assert ours == theirs


def test_raise_exception_becomes_a_template_error() -> None:
    template = ChatTemplate(QWEN_STYLE_TEMPLATE)
    with pytest.raises(ChatTemplateError, match="unknown role narrator"):
        template.render([{"role": "narrator", "content": "x"}])


def test_sandbox_blocks_python_internals() -> None:
    template = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        template.render([{"role": "user", "content": "x"}])


def test_continue_final_message_ends_inside_the_last_message() -> None:
    template = ChatTemplate(QWEN_STYLE_TEMPLATE)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well, "}]
    text = template.render(messages, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nWell, ")


def test_missing_template_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ChatTemplate.from_dir(tmp_path)


def test_normalize_joins_text_parts_and_parses_tool_arguments() -> None:
    messages = normalize_messages(
        [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {
                "role": "assistant",
                "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}],
            },
        ]
    )
    assert messages[0]["content"] == "a\nb"
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    with pytest.raises(ChatTemplateError, match="image_url"):
        normalize_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}])


def test_template_kwargs_cannot_replace_the_conversation() -> None:
    template = ChatTemplate("{{ messages | length }}{{ enable_thinking }}")
    text = template.render([{"role": "user", "content": "x"}], template_kwargs={"enable_thinking": True})
    assert text == "1True"
    with pytest.raises(ChatTemplateError, match="messages"):
        template.render([{"role": "user", "content": "x"}], template_kwargs={"messages": [1, 2, 3]})


@pytest.mark.parametrize(
    "name", ["raise_exception", "namespace", "bos_token", "tools", "add_generation_prompt"]
)
def test_template_kwargs_cannot_override_template_globals(name: str) -> None:
    # `raise_exception: ""` would turn the template's own role checks into a silent no-op.
    template = ChatTemplate(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}ok"
    )
    with pytest.raises(ChatTemplateError, match=name):
        template.render([{"role": "user", "content": "x"}], template_kwargs={name: "x"})


def test_a_template_that_trips_over_the_conversation_is_a_template_error() -> None:
    template = ChatTemplate("{{ messages[0]['content'] + 1 }}")
    with pytest.raises(ChatTemplateError):
        template.render([{"role": "user", "content": "x"}])
