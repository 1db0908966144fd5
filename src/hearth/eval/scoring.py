"""Teacher-forced scoring through the engine's own worker: one prefill of a whole text, logits at every
position, through the configuration's real paths (quantized weights, FP8 KV written and read back).

`chunk_tokens` scores a text in prefill chunks of that many tokens instead (each chunk attends to the KV the
ones before it wrote): with 16 or fewer, every linear layer sees decode-sized row counts, so the INT4
kernel (W4A8: rounded activations) is what gets scored, not the dequantized prefill path.

The engine must be idle and built without prefix caching: the text's KV goes into pages 0.. of the pool,
which the scoring claims without the allocator.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hearth.engine.forward_batch import ForwardBatch
from hearth.engine.llm import LLM


def text_logprobs(llm: LLM, token_ids: list[int], chunk_tokens: int | None = None) -> torch.Tensor:
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
    chunk = n if chunk_tokens is None else chunk_tokens
    parts = []
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        wanted = [i - start for i in range(start, min(end, n - 1))]  # row t predicts token t + 1
        if not wanted:
            wanted = [end - 1 - start]  # the last chunk may hold only the last token: nothing to score
        step = ForwardBatch(
            token_ids=list(token_ids[start:end]),
            positions=list(range(start, end)),
            query_start_loc=[0, end - start],
            seq_lens=[end],
            num_decode_rows=0,
            page_table=list(range(num_pages)),
            page_table_width=num_pages,
            slot_mapping=list(range(start, end)),
            logits_indices=wanted,
            sampling=[],
        )
        with torch.inference_mode():
            logits = worker.forward(step)
        parts.append(logits[: min(end, n - 1) - start])
    logits = torch.cat(parts)
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


def score_texts(
    llms: dict[str, LLM],
    reference: str,
    texts: list[list[int]],
    chunk_tokens: dict[str, int | None] | None = None,
) -> dict[str, TextScores]:
    """Perplexity of each configuration; greedy agreement and KL of each against `reference`
    (`chunk_tokens`: per configuration, see `text_logprobs`)."""
    chunks = chunk_tokens or {}
    scores = {name: TextScores() for name in llms}
    for token_ids in texts:
        if len(token_ids) < 2:
            continue
        labels = torch.tensor(token_ids[1:])
        ref = text_logprobs(llms[reference], token_ids, chunks.get(reference))
        ref_argmax = ref.argmax(-1)
        for name, llm in llms.items():
            logprobs = ref if name == reference else text_logprobs(llm, token_ids, chunks.get(name))
            s = scores[name]
            nll = -logprobs.gather(1, labels[:, None]).sum().item()
            s.nll += nll
            s.num_tokens += labels.numel()
            s.per_text_ppl.append(float(torch.exp(torch.tensor(nll / labels.numel()))))
            s.agree += int((logprobs.argmax(-1) == ref_argmax).sum())
            s.kl += float((ref.exp() * (ref - logprobs)).sum())
    return scores
