"""What a worker needs of a request's sampling parameters (sent once, when the request first runs)."""

from __future__ import annotations

import msgspec


class SamplerParams(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """The sampler's view of `hearth.engine.sampling_params.SamplingParams`: no stop strings, no grammar
    (the engine core keeps those), so it is small and every field is plain data."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None  # {token id: bias}, added to the raw logits first
    prompt_logprobs: int | None = None  # top alternatives per scored prompt position (None: not scored)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
