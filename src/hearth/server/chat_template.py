"""Chat templates from the checkpoint, rendered the way transformers' `apply_chat_template` renders them.

Templates come from the Hub and are untrusted code, so they run in jinja's immutable sandbox with only the
helpers transformers provides (`tojson`, `raise_exception`, `strftime_now`, `namespace`, `dict`).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


# Names the template's context already gives a meaning: helpers (a client's `raise_exception: ""` would
# silence the template's own checks), special tokens, and the request's own fields.
RESERVED_TEMPLATE_NAMES = frozenset(
    {
        "raise_exception",
        "strftime_now",
        "namespace",
        "dict",
        "range",
        "lipsum",
        "cycler",
        "joiner",
        "messages",
        "tools",
        "add_generation_prompt",
        *_SPECIAL_TOKEN_KEYS,
    }
)


def reserved_template_kwargs(template_kwargs: dict[str, Any] | None) -> list[str]:
    """The keys of `chat_template_kwargs` a client may not set (sorted), or []."""
    return sorted(set(template_kwargs or {}) & RESERVED_TEMPLATE_NAMES)


class ChatTemplateError(ValueError):
    """The template refused the conversation (e.g. `raise_exception` on bad role order) or is missing."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes HTML characters, which would change the prompt the model was trained on.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    # Underscore attributes would let a template reach Python internals through the namespace.
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore attributes ({name!r})"
            )


class _Generation(jinja2.ext.Extension):
    # `{% generation %}` marks assistant spans for training masks; serving only needs it to parse.
    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    env.globals["dict"] = dict
    return env


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json stores special tokens as strings or as AddedToken dicts.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _template_from_config(value: Any, name: str = "default") -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        by_name = {item.get("name"): item.get("template") for item in value if isinstance(item, dict)}
        return by_name.get(name) or by_name.get("default")
    return None


class ChatTemplate:
    """A compiled chat template plus the special-token strings it may reference."""

    def __init__(self, source: str, special_tokens: dict[str, str | None] | None = None) -> None:
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"chat template does not compile: {exc}") from exc
        self.source = source
        self.special_tokens = {key: None for key in _SPECIAL_TOKEN_KEYS} | dict(special_tokens or {})

    @classmethod
    def from_dir(cls, model_dir: str | Path, override_path: str | Path | None = None) -> ChatTemplate:
        """Load from `chat_template.jinja` or `tokenizer_config.json` (or `override_path`, a jinja file); a
        GGUF file's from its metadata (`tokenizer.chat_template`)."""
        from hearth.model.gguf_file import is_gguf_path

        if is_gguf_path(model_dir):
            return cls._from_gguf(Path(model_dir), override_path)
        model_dir = Path(model_dir)
        config: dict[str, Any] = {}
        config_path = model_dir / "tokenizer_config.json"
        if config_path.exists():
            config = json.loads(config_path.read_text())
        special_tokens = {key: _token_text(config.get(key)) for key in _SPECIAL_TOKEN_KEYS}
        source: str | None = None
        if override_path is not None:
            source = Path(override_path).read_text()
        elif (model_dir / "chat_template.jinja").exists():
            source = (model_dir / "chat_template.jinja").read_text()
        elif (model_dir / "chat_template.json").exists():
            source = _template_from_config(
                json.loads((model_dir / "chat_template.json").read_text()).get("chat_template")
            )
        else:
            source = _template_from_config(config.get("chat_template"))
        if source is None:
            raise ChatTemplateError(
                f"{model_dir} has no chat template (tokenizer_config.json or chat_template.jinja); "
                "pass --chat-template FILE or use /v1/completions"
            )
        return cls(source, special_tokens)

    @classmethod
    def _from_gguf(cls, path: Path, override_path: str | Path | None) -> ChatTemplate:
        from hearth.model.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_gguf(path)
        special_tokens = {"bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token}
        source = Path(override_path).read_text() if override_path is not None else tokenizer.chat_template
        if source is None:
            raise ChatTemplateError(
                f"{path} has no chat template (tokenizer.chat_template); pass --chat-template FILE or use /v1/completions"
            )
        return cls(source, special_tokens)

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """Render a conversation to the prompt text. Raises ChatTemplateError when the template refuses it."""
        messages = [
            {key: value for key, value in message.items() if value is not None} for message in messages
        ]
        marker = "\x00HEARTH_CONTINUE\x00"
        if continue_final_message:
            last = messages[-1]
            if not isinstance(last.get("content"), str):
                raise ChatTemplateError("continue_final_message needs a final message with string content")
            messages[-1] = {**last, "content": last["content"] + marker}
        reserved = reserved_template_kwargs(template_kwargs)
        if reserved:
            raise ChatTemplateError(f"chat_template_kwargs may not set {', '.join(reserved)}")
        context = {
            **self.special_tokens,
            **(template_kwargs or {}),
            "messages": messages,
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            text = self._template.render(context)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template error: {exc}") from exc
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            # Templates assume shapes (string content, a first message) that a request may not have.
            raise ChatTemplateError(f"the chat template cannot render this conversation: {exc!r}") from exc
        if continue_final_message:
            # Cut right after the final message's text so the model continues it instead of starting a new turn.
            if marker not in text:
                raise ChatTemplateError("the chat template dropped the final message; cannot continue it")
            text = text[: text.rindex(marker)]
        return text


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages -> what chat templates expect.

    Text parts are joined into one string (most templates only handle strings), and tool-call arguments
    are parsed from their JSON string to a dict, since templates write them with `tojson`.
    """
    normalized = []
    for message in messages:
        message = dict(message)
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text":
                    raise ChatTemplateError(
                        f"only text content parts are supported, got {part.get('type')!r}"
                    )
                if not isinstance(part.get("text"), str):
                    raise ChatTemplateError("a text content part needs a `text` string")
                texts.append(part["text"])
            message["content"] = "\n".join(texts)
        if message.get("tool_calls"):
            calls = []
            for call in message["tool_calls"]:
                call = dict(call)
                function = dict(call["function"])
                if isinstance(function.get("arguments"), str):
                    try:
                        function["arguments"] = json.loads(function["arguments"] or "{}")
                    except json.JSONDecodeError:
                        pass  # keep the model's own (invalid) text; the template writes it as a string
                call["function"] = function
                calls.append(call)
            message["tool_calls"] = calls
        normalized.append(message)
    return normalized


def content_chars(messages: list[Any]) -> int:
    """Characters of the messages' text content (request models): a lower bound on the rendered prompt's
    length, known before rendering."""
    total = 0
    for message in messages:
        content = message.content
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(part.text or "") for part in content)
    return total
