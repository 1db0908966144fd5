"""Teacher-forced scoring through the engine's own worker: one prefill of a whole text, logits at every
position, through the configuration's real paths (quantized weights, FP8 KV written and read back).

The engine must be idle and built without prefix caching: the text's KV goes into pages 0.. of the pool,
which the scoring claims without the allocator.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hearth.engine.llm import LLM
from hearth.engine.step_input import StepInput


def text_logprobs(llm: LLM, token_ids: list[int]) -> torch.Tensor:
    """log-softmax `[len(token_ids) - 1, vocab]`: row t predicts token t + 1."""
    engine = llm.engine
    if engine.scheduler.running or engine.scheduler.waiting:
        raise RuntimeError("text_logprobs needs an idle engine")
    if engine.config.enable_prefix_caching:
        raise RuntimeError(
            "text_logprobs writes pages the prefix cache does not know of: build with enable_prefix_caching=False"
        )
    worker = engine.worker
    n = len(token_ids)
    page_size = worker.kv_pool.page_size
    num_pages = -(-n // page_size)
    if num_pages > worker.kv_pool.num_pages or n > engine.max_model_len:
        raise ValueError(f"a text of {n} tokens does not fit the KV cache / max model len")
    step = StepInput(
        token_ids=list(token_ids),
        positions=list(range(n)),
        query_start_loc=[0, n],
        seq_lens=[n],
        num_decode_rows=0,
        page_table=list(range(num_pages)),
        page_table_width=num_pages,
        slot_mapping=list(range(n)),
        logits_indices=list(range(n - 1)),
        sampling=[],
    )
    with torch.inference_mode():
        logits = worker.forward(step)
    vocab = engine.model_config.vocab_size
    return torch.log_softmax(logits[:, :vocab].double(), dim=-1)


@dataclass
class TextScores:
    """Sums over every scored position of every text (token-weighted means are derived)."""

    num_tokens: int = 0
    nll: float = 0.0
    agree: int = 0  # positions whose argmax matches the reference's
    kl: float = 0.0  # KL(reference || this), nats
    per_text_ppl: list[float] = field(default_factory=list)

    @property
    def perplexity(self) -> float:
        return float(torch.exp(torch.tensor(self.nll / max(1, self.num_tokens))))

    def as_dict(self, is_reference: bool) -> dict[str, float]:
        count = max(1, self.num_tokens)
        out = {"num_tokens": self.num_tokens, "perplexity": self.perplexity, "mean_nll": self.nll / count}
        if not is_reference:
            out["greedy_agreement"] = self.agree / count
            out["mean_kl_nats"] = self.kl / count
        return out


def score_texts(llms: dict[str, LLM], reference: str, texts: list[list[int]]) -> dict[str, TextScores]:
    """Perplexity of each configuration; greedy agreement and KL of each against `reference`."""
    scores = {name: TextScores() for name in llms}
    for token_ids in texts:
        if len(token_ids) < 2:
            continue
        labels = torch.tensor(token_ids[1:])
        ref = text_logprobs(llms[reference], token_ids)
        ref_argmax = ref.argmax(-1)
        for name, llm in llms.items():
            logprobs = ref if name == reference else text_logprobs(llm, token_ids)
            s = scores[name]
            nll = -logprobs.gather(1, labels[:, None]).sum().item()
            s.nll += nll
            s.num_tokens += labels.numel()
            s.per_text_ppl.append(float(torch.exp(torch.tensor(nll / labels.numel()))))
            s.agree += int((logprobs.argmax(-1) == ref_argmax).sum())
            s.kl += float((ref.exp() * (ref - logprobs)).sum())
    return scores
