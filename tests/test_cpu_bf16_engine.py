"""A bf16 model on CPU (what a CPU with bf16 math runs, issue 11) through the whole engine: every greedy
token Hearth picks is transformers' bf16 choice or a near-tie in transformers' own bf16 logits, teacher-forced
on Hearth's tokens. Decode rows take the compiled kernel over the bf16 pool where it built; on CPUs with
bf16 math the linears take the prepacked oneDNN weights, elsewhere `F.linear`."""

from __future__ import annotations

import random

import torch

from hearth import LLM, SamplingParams
from hearth.ops import cpu_kernels

# bf16 keeps 8 bits of mantissa: two engines summing in different orders differ by a few bf16 ulps of
# the logits (|logit| ~ 1-4 here), so "near-tie" is a gap below 0.1 in transformers' bf16 logits.
NEAR_TIE = 0.1


def test_bf16_engine_matches_transformers_bf16_to_near_ties(tiny_model_factory):
    import transformers

    cpu_kernels.paged_decode_attention_kernel(wait=True)
    model_dir = tiny_model_factory("llama")
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (5, 17, 40)]
    llm = LLM(str(model_dir), dtype="bfloat16", page_size=16)
    assert llm.engine.dtype == torch.bfloat16
    results = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    for prompt, result in zip(prompts, results):
        tokens = result.token_ids
        assert len(tokens) == 16
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + tokens])).logits[0].float()
        for i, token in enumerate(tokens):
            step_logits = logits[len(prompt) - 1 + i]
            gap = (step_logits.max() - step_logits[token]).item()
            assert gap <= NEAR_TIE, (
                f"prompt of {len(prompt)}: token {i} is {gap:.3f} below transformers' choice"
            )
