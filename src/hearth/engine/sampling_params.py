"""What a request asks of the sampler and of the stop checks. Plain data, validated once."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hearth.engine.structured_output import StructuredOutput


class InvalidParamError(ValueError):
    """A sampling parameter out of range; `param` names it for the API's error object."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    """Per-request sampling and stopping. Defaults follow vLLM's (temperature 1.0, max_tokens 16).

    `max_tokens=None` means "until the context is full". `logprobs=None` returns none; `0` the
    sampled token's logprob only; `N` also the top N alternatives. `structured_output` constrains the
    answer to JSON (see hearth.engine.structured_output); share one spec across choices so it compiles once.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    min_tokens: int = 0
    structured_output: StructuredOutput | None = None
    # Issue 27: added to the raw logits before anything else ({token id: bias}, like OpenAI's logit_bias), and
    # prompt logprobs with this many top alternatives (None: none; hearth.engine.prompt_logprobs).
    logit_bias: dict[int, float] | None = None
    prompt_logprobs: int | None = None
    # The agent session this request is a turn of: its pages are retained between turns
    # (hearth.engine.retention) when the engine retains sessions.
    retain_session: str | None = None

    MAX_TOP_LOGPROBS = 20

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def validate(self) -> None:
        def finite(name: str, value: float) -> None:
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise InvalidParamError(name, f"{name} must be a finite number, got {value!r}")

        for name in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            finite(name, getattr(self, name))
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise InvalidParamError(
                "max_tokens", f"max_tokens must be a positive integer, got {self.max_tokens!r}"
            )
        if self.temperature < 0:
            raise InvalidParamError("temperature", f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidParamError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise InvalidParamError(
                "top_k", f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k!r}"
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidParamError("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidParamError(name, f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.repetition_penalty <= 0:
            raise InvalidParamError("repetition_penalty", "repetition_penalty must be > 0")
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= self.MAX_TOP_LOGPROBS
        ):
            raise InvalidParamError("logprobs", f"logprobs must be between 0 and {self.MAX_TOP_LOGPROBS}")
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int)
            or not 0 <= self.prompt_logprobs <= self.MAX_TOP_LOGPROBS
        ):
            raise InvalidParamError(
                "prompt_logprobs", f"prompt_logprobs must be between 0 and {self.MAX_TOP_LOGPROBS}"
            )
        if self.logit_bias is not None:
            for token_id, bias in self.logit_bias.items():
                if not isinstance(token_id, int) or token_id < 0:
                    raise InvalidParamError(
                        "logit_bias", f"logit_bias keys must be token ids, got {token_id!r}"
                    )
                finite("logit_bias", bias)
                if not -100.0 <= bias <= 100.0:
                    raise InvalidParamError(
                        "logit_bias", f"logit_bias values must be in [-100, 100], got {bias}"
                    )
        if self.seed is not None and not isinstance(self.seed, int):
            raise InvalidParamError("seed", "seed must be an integer")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise InvalidParamError("min_tokens", "min_tokens must be a non-negative integer")
        for token_id in self.stop_token_ids:
            if not isinstance(token_id, int) or token_id < 0:
                raise InvalidParamError("stop_token_ids", "stop_token_ids must be non-negative integers")
        if self.structured_output is not None:
            if not isinstance(self.structured_output, StructuredOutput):
                raise InvalidParamError("response_format", "structured_output must be a StructuredOutput")
            try:
                self.structured_output.validate()
            except ValueError as exc:
                raise InvalidParamError("response_format", str(exc)) from exc
