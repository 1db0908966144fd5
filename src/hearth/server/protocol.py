"""The OpenAI request bodies Hearth accepts, validated strictly (wrong types and NaN are 400s, not coercions).

Responses are built as plain dicts in the serving modules: they are on the hot path and need no validation.
Unknown fields are ignored so harnesses that send newer OpenAI parameters keep working.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

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
