"""Structured output: answers that are JSON (any object, or fitting a JSON schema), by constrained decoding.

Built on llguidance (a lexer + Earley parser over the tokenizer's token trie). A request's spec is compiled
to a grammar once (`StructuredOutput.grammar`, which also validates it); the engine's
`StructuredOutputManager` gives each constrained request its own `GrammarMatcher`, masks the logits of
constrained rows before sampling (everything the grammar cannot continue with becomes -inf, padded
vocabulary columns included), and advances each matcher with the sampled token. Rows without a spec are
never touched, so unconstrained requests pay nothing.

Preemption recomputes the KV cache but keeps the request's output tokens, so a matcher, which has consumed
exactly those tokens, stays valid across it; a finished or aborted request just drops its matcher.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

import llguidance
import torch

from hearth.model.tokenizer import Tokenizer

StructuredKind = Literal["json_object", "json_schema", "lark"]
KINDS: tuple[str, ...] = ("json_object", "json_schema", "lark")

# Whitespace between JSON tokens: none, one space, or a newline and indentation (compact, spaced and
# pretty-printed JSON). Bounded, because a weak model that likes whitespace would otherwise loop on it
# until max_tokens.
WHITESPACE_PATTERN = r"[ ]?|\n[ \t]{0,24}"
# Compiled grammars kept per manager (agents re-send the same schema on every turn).
GRAMMAR_CACHE_SIZE = 64


@dataclass(frozen=True)
class StructuredOutput:
    """What the answer must be: `json_object` (any JSON object), `json_schema` (JSON that fits `schema`),
    or `lark` (text in llguidance's Lark dialect, `lark`; embed JSON with `json_schema_lark`).

    `strict=False` ignores schema keywords the compiler does not implement instead of rejecting the
    schema; the keywords it implements are enforced either way. `grammar` compiles and validates once.
    """

    kind: StructuredKind
    schema: dict[str, Any] | None = None
    strict: bool = True
    name: str | None = field(default=None, compare=False)
    lark: str | None = None

    @classmethod
    def json_object(cls) -> StructuredOutput:
        return cls("json_object")

    @classmethod
    def json_schema(
        cls, schema: dict[str, Any], strict: bool = True, name: str | None = None
    ) -> StructuredOutput:
        return cls("json_schema", schema, strict, name)

    @classmethod
    def lark_grammar(cls, lark: str) -> StructuredOutput:
        return cls("lark", lark=lark)

    @cached_property
    def grammar(self) -> str:
        """The llguidance grammar; raises ValueError naming what is wrong with the spec."""
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind == "lark":
            if not isinstance(self.lark, str) or not self.lark.strip():
                raise ValueError("a lark structured output needs the grammar text")
            grammar = llguidance.LLMatcher.grammar_from_lark(self.lark)
        else:
            grammar = _json_grammar(self._schema_to_enforce(), self.strict)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
        if is_error:
            what = "grammar" if self.kind == "lark" else "JSON schema"
            label = f" {self.name!r}" if self.name else ""
            raise ValueError(f"unsupported or invalid {what}{label}: {'; '.join(messages)}")
        return grammar

    def _schema_to_enforce(self) -> dict[str, Any]:
        if self.kind == "json_object":
            return {"type": "object"}
        if not isinstance(self.schema, dict):
            raise ValueError(
                f"a json_schema needs the schema as a JSON object, got {type(self.schema).__name__}"
            )
        return self.schema

    def validate(self) -> None:
        self.grammar  # noqa: B018 (compiles, raises on a bad spec, and caches)


def _json_options(strict: bool) -> dict[str, Any]:
    return {"whitespace_pattern": WHITESPACE_PATTERN, "lenient": not strict}


def _json_grammar(schema: dict[str, Any], strict: bool) -> str:
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults=_json_options(strict)
        )
    except (ValueError, TypeError) as exc:
        raise ValueError(f"invalid JSON schema: {exc}") from exc


def json_schema_lark(schema: dict[str, Any], strict: bool = False) -> str:
    """A Lark fragment (`%json {...}`) for JSON fitting `schema`, with the same whitespace rules as json_schema."""
    guidance = {**_json_options(strict), **(schema.get("x-guidance") or {})}
    return "%json " + json.dumps({**schema, "x-guidance": guidance})


class GrammarMatcher:
    """One request's position in its grammar: the tokens it may take next, and whether it is complete."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def accept(self, token_id: int) -> bool:
        """Advance by the sampled token; False if the grammar does not allow it (the matcher is then dead)."""
        return bool(self._matcher.consume_token(token_id))

    @property
    def is_terminated(self) -> bool:
        """The answer is complete: nothing but EOS may follow, so the request can stop here."""
        return bool(self._matcher.is_stopped())

    @property
    def error(self) -> str:
        return str(self._matcher.get_error())

    @property
    def raw(self) -> llguidance.LLMatcher:
        return self._matcher


class StructuredOutputManager:
    """The engine's grammar side, one per tokenizer.

    `new_matcher(spec)` compiles (or reuses) the spec's grammar for this tokenizer and returns a fresh
    matcher. `compute_bitmask(matchers)` gives the packed masks of the rows whose matcher is not None
    (the engine's side, before a step); `apply_bitmask` (a function: the worker's side) sets every column
    a mask forbids to -inf; `mask_logits` does both, in place. The llguidance tokenizer (a token trie, about a second for a 150k
    vocabulary) is built on first use, so servers that never see a constrained request never pay for it.
    """

    def __init__(self, tokenizer: Tokenizer, eos_token_ids: Iterable[int]) -> None:
        self._tokenizer = tokenizer
        self._eos_token_ids = sorted(t for t in eos_token_ids if 0 <= t < tokenizer.vocab_size)
        self._templates: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()

    @cached_property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        return llguidance.LLTokenizer(
            self._tokenizer.backend.to_str(),
            n_vocab=self._tokenizer.vocab_size,
            eos_token=self._eos_token_ids or None,
        )

    @cached_property
    def _executor(self) -> llguidance.LLExecutor:
        return llguidance.LLExecutor()

    def new_matcher(self, spec: StructuredOutput) -> GrammarMatcher:
        """A matcher at the start of `spec`'s grammar; ValueError if the grammar cannot work with this tokenizer."""
        grammar = spec.grammar
        template = self._templates.get(grammar)
        if template is None:
            template = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
            if template.is_error():
                raise ValueError(f"the JSON schema cannot be used with this model: {template.get_error()}")
            self._templates[grammar] = template
            if len(self._templates) > GRAMMAR_CACHE_SIZE:
                self._templates.popitem(last=False)
        else:
            self._templates.move_to_end(grammar)
        return GrammarMatcher(template.deep_copy())

    def compute_bitmask(self, matchers: Sequence[GrammarMatcher | None]) -> tuple[list[int], torch.Tensor]:
        """What each constrained row may take next: (indices of the rows whose matcher is not None, their
        masks as int32 words `[len(rows), ceil(vocab / 32)]` on the CPU, bit t of the row set when token t is
        allowed). The engine computes this before the step; the worker applies it (`apply_bitmask`)."""
        rows = [i for i, matcher in enumerate(matchers) if matcher is not None]
        # One bit per token id, 32 to an int32 word, as llguidance writes them (its torch helpers would
        # import torch.compile machinery, so the call they wrap is made here).
        num_words = (self.ll_tokenizer.vocab_size + 31) // 32
        bitmask = torch.empty(len(rows), num_words, dtype=torch.int32)
        if rows:
            self._executor.unsafe_compute_mask_ptr(
                [(matchers[i].raw, k) for k, i in enumerate(rows)],  # type: ignore[union-attr]
                bitmask.data_ptr(),
                num_words * 4,
                len(rows),
            )
        return rows, bitmask

    def compute_draft_bitmask(self, matcher: GrammarMatcher, draft_token_ids: Sequence[int]) -> torch.Tensor:
        """Masks for a row that verifies drafts: int32 words `[m + 1, ceil(vocab / 32)]`, row i for the grammar
        state after `draft_token_ids[:i]`, where m is how many leading drafts the grammar allows. Positions
        past m need no mask: draft m is not allowed at position m, so the row's kept run ends there. The
        matcher is left where it was."""
        raw = matcher.raw
        num_valid = raw.try_consume_tokens(list(draft_token_ids))
        num_words = (self.ll_tokenizer.vocab_size + 31) // 32
        bitmask = torch.empty(num_valid + 1, num_words, dtype=torch.int32)
        for i in range(num_valid, -1, -1):  # from the last state back to the first, rolling back a draft each
            self._executor.unsafe_compute_mask_ptr([(raw, 0)], bitmask[i].data_ptr(), num_words * 4, 1)
            if i:
                raw.rollback(1)
        return bitmask

    def mask_logits(self, logits: torch.Tensor, matchers: Sequence[GrammarMatcher | None]) -> None:
        """Forbid, in place, every token that a row's grammar does not allow next (rows with None: untouched)."""
        rows, words = self.compute_bitmask(matchers)
        apply_bitmask(logits, rows, words)


_BIAS_TABLES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _bias_table(logits: torch.Tensor) -> torch.Tensor:
    """[256, 8]: for each byte value, 0 where its bit is set (allowed) and -inf where not, bits low first."""
    key = (logits.device, logits.dtype)
    table = _BIAS_TABLES.get(key)
    if table is None:
        bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
        table = torch.zeros(256, 8).masked_fill_(bits == 0, float("-inf")).to(logits.device, logits.dtype)
        _BIAS_TABLES[key] = table
    return table


@torch.inference_mode()  # the model's logits are inference tensors; in place is allowed only in here
def apply_bitmask(logits: torch.Tensor, rows: Sequence[int], words: torch.Tensor) -> None:
    """Set, in place, `logits[rows[k], t]` to -inf wherever bit t of `words[k]` is clear; columns past the
    mask's width (a padded embedding) are never allowed. `words`: int32 `[len(rows), num_words]`, any device."""
    if not rows:
        return
    # Unpacked where the logits are (the packed words are 32x smaller than a mask), a byte at a time through
    # a 256-entry table of 0 / -inf biases: one gather and one add, several times cheaper than shifting
    # out 32 bits per word and a masked_fill on CPU.
    packed = words.to(logits.device, non_blocking=True).view(torch.uint8).flatten().int()  # little-endian
    bias = _bias_table(logits).index_select(0, packed).view(len(rows), -1)
    width = logits.shape[1]
    if bias.shape[1] >= width:
        bias = bias[:, :width]
    else:
        bias = torch.nn.functional.pad(bias, (0, width - bias.shape[1]), value=float("-inf"))
    if len(rows) == logits.shape[0]:
        logits.add_(bias)
        return
    index = torch.tensor(list(rows), device=logits.device)
    logits.index_copy_(0, index, logits.index_select(0, index).add_(bias))
