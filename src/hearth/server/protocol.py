"""The OpenAI request bodies Hearth accepts, validated strictly (wrong types and NaN are 400s, not coercions).

Responses are built as plain dicts in the serving modules: they are on the hot path and need no validation.
No field is silently ignored: each one here is honoured; OpenAI's and vLLM's fields Hearth does not do are
refused by name (`UNSUPPORTED_FIELDS`); fields that change nothing by their nature (`user`, `metadata`,
`store`, `service_tier`) are accepted. Other unknown fields are ignored, as OpenAI-compatible servers do, so
harnesses that send newer parameters keep working; the server logs them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from hearth.server.errors import bad_request

_CONFIG = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")

# Ranges: every integer a client sends is bounded, so nothing it sends overflows an int64 tensor downstream.
MAX_INT = 2**31 - 1
NonNegInt = Annotated[int, Field(ge=0, le=MAX_INT)]
# OpenAI's rule for function names; anything else (`a</tool_call>b`) could end a forced call's text early.
FUNCTION_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
FunctionName = Annotated[str, Field(pattern=FUNCTION_NAME_PATTERN)]


class _Model(BaseModel):
    model_config = _CONFIG


class StreamOptions(_Model):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class FunctionDefinition(_Model):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Model):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Model):
    name: FunctionName


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Model):
    # OpenAI requires `name`; harnesses that leave it out still get their schema enforced.
    name: Annotated[str, Field(max_length=64)] | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError(
                'type "json_schema" needs json_schema.schema, the JSON schema the answer must fit'
            )
        return self


class FunctionCall(_Model):
    name: str
    # OpenAI sends arguments as a JSON string; some clients send the object itself.
    arguments: str | dict[str, Any]


class ToolCall(_Model):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    # Extra keys (reasoning_content, ...) pass through to the chat template, as transformers does.
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class StructuredOutputsField(_Model):
    """vLLM's `structured_outputs` (and its older `guided_*` fields): exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    @model_validator(mode="after")
    def _one(self) -> StructuredOutputsField:
        given = [
            name
            for name, value in (
                ("json", self.json_),
                ("regex", self.regex),
                ("choice", self.choice),
                ("grammar", self.grammar),
                ("json_object", self.json_object or None),
            )
            if value is not None
        ]
        if len(given) != 1:
            raise ValueError(
                f"give exactly one of json, regex, choice, grammar, json_object (got {given or 'none'})"
            )
        return self


# OpenAI's and vLLM's request fields Hearth does not implement: refused by name (400), never dropped. The value
# is what the field may be and still mean "nothing asked" (accepted), or None: any value is refused.
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...] | None] = {
    "best_of": (None, 1),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "truncate_prompt_tokens": (None,),
    "logits_processors": (None,),
    "functions": (None,),
    "function_call": (None,),
    "prediction": (None,),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "web_search_options": (None,),
    "guided_decoding_backend": (None,),
    "guided_whitespace_pattern": (None,),
    "structural_tag": (None,),
    "return_tokens_as_token_ids": (None, False),
    "prompt_embeds": (None,),
    "priority": (None, 0),
    "spaces_between_special_tokens": (None, True),
    "mm_processor_kwargs": (None,),
    "documents": (None,),
    "vllm_xargs": (None,),
}


def refuse_unsupported(data: Any) -> Any:
    """Raises the 400 naming the first unsupported field a body sets (an APIError passes through pydantic)."""
    if isinstance(data, dict):
        for name, accepted in UNSUPPORTED_FIELDS.items():
            if name in data and (accepted is None or data[name] not in accepted):
                raise bad_request(
                    f"{name} is not supported by this server (docs/server.md lists the fields it honours)",
                    param=name,
                    code="unsupported_parameter",
                )
    return data


class KVTransferField(_Model):
    """The router's PD instructions (docs/pd-protocol.md)."""

    role: Literal["prefill", "decode"]
    transfer_id: Annotated[str, Field(min_length=1, max_length=128)]
    decode_url: str | None = None
    prefill_url: str | None = None
    # The router's signature over role, transfer id, the peer URL and `expires` (hearth.kv_transfer.auth):
    # an instruction without a valid one is refused, so a client cannot direct KV anywhere.
    expires: int | None = None
    signature: Annotated[str, Field(max_length=128)] | None = None


class SamplingRequest(_Model):
    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1, le=MAX_INT)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=MAX_INT)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    n: Annotated[int, Field(ge=1, le=64)] = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[NonNegInt] | None = None
    seed: Annotated[int, Field(ge=-(2**63), lt=2**63)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    # Below 0.01 a seen token's logit is multiplied past float32's range; HF and vLLM users stay near 1.
    repetition_penalty: Annotated[float, Field(ge=0.01, le=10.0)] | None = None
    min_tokens: NonNegInt = 0
    user: str | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    kv_transfer: KVTransferField | None = None
    # OpenAI's token id (as a string) -> bias in [-100, 100], added to the logits; ids checked against the vocab.
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    # vLLM: logprobs of the prompt's tokens (all but the first) with this many top alternatives.
    prompt_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None
    # Accepted: they change nothing about the answer by their nature (OpenAI bookkeeping).
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        return refuse_unsupported(data)

    @property
    def logit_bias_ids(self) -> dict[int, float] | None:
        """`logit_bias` with int keys; ValueError names a key that is not a token id."""
        if not self.logit_bias:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            if not key.isdigit() or len(key) > 10:
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            bias[int(key)] = value
        return bias

    @property
    def usage_in_stream(self) -> tuple[bool, bool]:
        """(a final usage chunk, usage on every chunk): what `stream_options` asks of a stream."""
        options = self.stream_options
        include = options is not None and options.include_usage
        return include, include and options is not None and options.continuous_usage_stats

    @model_validator(mode="after")
    def _check_stop(self) -> SamplingRequest:
        if isinstance(self.stop, list) and len(self.stop) > 16:
            raise ValueError("stop: at most 16 stop sequences")
        return self


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_INT)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # Passed to the chat template (as vLLM does); refused where the template does not read it.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None


# A completions prompt: a string, strings, token ids, or lists of token ids.
PromptInput = (
    str | Annotated[list[str], Field(min_length=1)] | Annotated[list[NonNegInt], Field(min_length=1)]
)


class CompletionRequest(SamplingRequest):
    prompt: (
        PromptInput | Annotated[list[Annotated[list[NonNegInt], Field(min_length=1)]], Field(min_length=1)]
    )
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False
    suffix: str | None = None


class TokenizeRequest(_Model):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    tools: list[ToolDefinition] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(_Model):
    model: str | None = None
    tokens: list[NonNegInt]
