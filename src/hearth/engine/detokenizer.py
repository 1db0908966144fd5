"""Token ids -> text deltas while a request streams, at constant cost per token.

Decoding a token on its own is wrong in two ways: byte-level BPE may split one UTF-8 character
across tokens, and some decoders change a token's text by what precedes it (SentencePiece's
leading-space handling). So each step decodes a short window twice: the tokens already emitted
since `prefix_offset` (as context) and the same window plus the new tokens. The delta is the
difference. Offsets advance only when the new text ends in a complete character.
"""

from __future__ import annotations

from hearth.model.tokenizer import Tokenizer

_REPLACEMENT_CHAR = "\ufffd"
# How many prompt tokens to decode as context before the first output token.
_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns each step's new token ids into the text they add.

    The concatenation of all deltas (plus `flush()`) equals `tokenizer.decode(output_ids)` for
    byte-level BPE tokenizers. The last few prompt tokens serve as context, so a SentencePiece
    model's first output token keeps the leading space it has in the running text.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        # A prompt that ends mid-character would let the first output bytes complete that
        # character, which the output's own decode cannot see; start without context then.
        if context and self._decode(context).endswith(_REPLACEMENT_CHAR):
            context = []
        self._token_ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text = self._decode(context)
        self._output_token_ids: list[int] = []

    @property
    def output_token_ids(self) -> list[int]:
        return self._output_token_ids

    def add(self, new_token_ids: list[int]) -> str:
        """Append the step's new tokens; return the text they complete (may be "")."""
        if not new_token_ids:
            return ""
        self._output_token_ids.extend(new_token_ids)
        self._token_ids.extend(new_token_ids)
        new_text = self._decode(self._token_ids[self._prefix_offset :])
        # Hold back an incomplete UTF-8 character until the token that completes it arrives.
        if len(new_text) <= len(self._prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(self._prefix_text) :]
        self._advance(new_text)
        return delta

    def flush(self) -> str:
        """Text still held back when the request ends (an incomplete character decodes to U+FFFD)."""
        new_text = self._decode(self._token_ids[self._prefix_offset :])
        if len(new_text) <= len(self._prefix_text):
            return ""
        delta = new_text[len(self._prefix_text) :]
        self._advance(new_text)
        return delta

    def _advance(self, new_text: str) -> None:
        # The window restarts at the tokens just read, so its length stays bounded; the ids
        # before it are dropped (only the output ids are kept, for the caller).
        self._prefix_text = self._decode(self._token_ids[self._read_offset :])
        del self._token_ids[: self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)
