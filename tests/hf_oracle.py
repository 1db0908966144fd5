"""Greedy generation with Hugging Face `transformers`: the oracle Hearth's engine is checked against."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch


@lru_cache(maxsize=8)
def _load(model_dir: str):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    return model


def hf_greedy(model_dir: Path | str, prompt_token_ids: list[int], max_new_tokens: int) -> list[int]:
    """`generate(do_sample=False)` with EOS ignored, so the full length is always compared."""
    model = _load(str(model_dir))
    input_ids = torch.tensor([prompt_token_ids])
    with torch.no_grad():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt_token_ids) :].tolist()
