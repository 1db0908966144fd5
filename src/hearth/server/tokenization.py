"""Tokenization the server does for clients, with the limits that keep one request from hurting the others.

- A prompt that can never fit the context is refused (400 `context_length_exceeded`) from its length in
  characters, before anything is rendered or tokenized: every token stands for at most `max_token_chars`
  characters of text, so a text of C characters has at least C / max_token_chars tokens (divided by a
  slack when a normalizer could shorten the text first).
- Large texts are tokenized on a worker thread through `encode_batch`, which releases the GIL while the
  Rust tokenizer runs (a single `encode` holds it: a 9 MB prompt froze every stream for 9-19 s).
- Text that spells a special token (`<|im_start|>`) inside a chat message is tokenized as text, not as the
  control token, unless the server was started with `--allow-special-tokens-in-content`: otherwise a user
  can open a `system` turn of their own (role injection).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from typing import Any, TypeVar

from tokenizers import Tokenizer as HFTokenizer

from hearth.model.tokenizer import Tokenizer
from hearth.server.errors import bad_request

T = TypeVar("T")

# Below this many characters a text is tokenized on the event loop: a thread hop costs more than it saves.
LARGE_TEXT_CHARS = 32_768
# Composing normalizers (NFC, NFKC) can shorten text, e.g. three Hangul jamo to one syllable; with a
# normalizer the bound allows for that.
_NORMALIZATION_SLACK = 4
# Placeholders for special-token text found in message content: a private-use character, the literal's
# index, another private-use character. The first one itself is escaped when a client sends it (with the
# index one past the special tokens').
_OPEN, _CLOSE = "\ue000", "\ue001"
_PLACEHOLDER = re.compile(f"{_OPEN}(\\d+){_CLOSE}")


def context_exceeded(num_tokens: int | None, max_model_len: int, param: str) -> Exception:
    counted = f"{num_tokens} tokens" if num_tokens is not None else "more tokens than that"
    return bad_request(
        f"This model's maximum context length is {max_model_len} tokens, and the prompt has {counted}, "
        "which leaves no room for an answer. Shorten the prompt.",
        param=param,
        code="context_length_exceeded",
    )


def _max_token_chars(backend: HFTokenizer) -> int:
    # A vocabulary entry's length bounds the characters of text its token stands for: byte-level BPE
    # writes one character per byte (a text character is at least one byte), SentencePiece writes "▁" for
    # a space and "<0xE6>" for a byte. (Pre-tokenizers that drop whitespace, as BERT's do, are not counted.)
    vocab = backend.get_vocab(with_added_tokens=True)
    return max((len(piece) for piece in vocab), default=1) or 1


class PromptTokenizer:
    """The server's tokenizer front: `check_fits` (cheap, before rendering), `encode` (off the loop when
    large), and `escape_specials` / `encode_chat` for chat prompts."""

    def __init__(
        self, tokenizer: Tokenizer, max_model_len: int, allow_special_tokens_in_content: bool
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.allow_special_tokens_in_content = allow_special_tokens_in_content
        backend = tokenizer.backend
        self.max_token_chars = _max_token_chars(backend)
        self._slack = 1 if backend.normalizer is None else _NORMALIZATION_SLACK
        # The same tokenizer with special-token matching off: for special-token text that came from a client.
        self._literal = HFTokenizer.from_str(backend.to_str())
        self._literal.encode_special_tokens = True
        added = backend.get_added_tokens_decoder()
        # Longest first, so a special that contains another is replaced whole.
        self._special_texts = sorted(
            {token.content for token in added.values() if token.content and _OPEN not in token.content},
            key=len,
            reverse=True,
        )
        self._open_placeholder = f"{_OPEN}{len(self._special_texts)}{_CLOSE}"  # stands for _OPEN itself

    # ---- limits --------------------------------------------------------------------------------------

    def min_tokens(self, num_chars: int) -> int:
        """A lower bound on the tokens of any text of `num_chars` characters."""
        return num_chars // (self.max_token_chars * self._slack)

    @property
    def max_fitting_body_bytes(self) -> int:
        """No request whose prompt can fit the context has a larger body: every prompt character takes at
        most 12 bytes of JSON (an escaped surrogate pair), plus 1 MiB for everything else (schemas, stops)."""
        return 12 * self.max_model_len * self.max_token_chars * self._slack + 1024 * 1024

    def check_body_fits(self, content_length: str | None) -> None:
        """400 `context_length_exceeded` from the Content-Length alone, before the body is read or parsed
        (parsing 10 MB of JSON holds the event loop for a good part of a second)."""
        if content_length is not None and content_length.isdigit():
            if int(content_length) > self.max_fitting_body_bytes:
                raise bad_request(
                    f"The request body has {content_length} bytes; no prompt that fits this model's maximum "
                    f"context length of {self.max_model_len} tokens is that long. Shorten the prompt.",
                    code="context_length_exceeded",
                )

    def check_fits(self, num_chars: int, param: str) -> None:
        """400 `context_length_exceeded` when a text this long can never fit, without tokenizing it."""
        if self.min_tokens(num_chars) >= self.max_model_len:
            raise context_exceeded(None, self.max_model_len, param)

    # ---- encoding ------------------------------------------------------------------------------------

    async def run(self, num_chars: int, work: Callable[[], T]) -> T:
        """`work` (rendering, tokenizing) inline for small inputs, on a thread for large ones."""
        if num_chars < LARGE_TEXT_CHARS:
            return work()
        return await asyncio.to_thread(work)

    def encode_now(self, text: str, add_special_tokens: bool) -> list[int]:
        if len(text) < LARGE_TEXT_CHARS:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        # encode_batch lets go of the GIL while it works; encode does not.
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]

    async def encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        """`text` as token ids (raw text: special-token text in it is the special token, as in vLLM)."""
        self.check_fits(len(text), param)
        return await self.run(len(text), lambda: self.encode_now(text, add_special_tokens))

    # ---- chat: special-token text from the client stays text ----------------------------------------

    def escape_specials(self, value: Any) -> Any:
        """`value` (messages or tools: dicts, lists, strings) with every special-token text in its strings
        replaced by a placeholder that `encode_chat` turns back into that text, tokenized as plain text."""
        if self.allow_special_tokens_in_content:
            return value
        if isinstance(value, str):
            return self._escape_text(value)
        if isinstance(value, dict):
            return {key: self.escape_specials(item) if key != "role" else item for key, item in value.items()}
        if isinstance(value, list):
            return [self.escape_specials(item) for item in value]
        return value

    def _escape_text(self, text: str) -> str:
        # str.replace and `in` are C loops over the text; a regex alternation of a few hundred added tokens
        # took about a second per MB with the GIL held. _OPEN is escaped first by splitting on it, so the
        # placeholders inserted afterwards are never themselves escaped.
        pieces = text.split(_OPEN)
        for k, piece in enumerate(pieces):
            for index, special in enumerate(self._special_texts):
                if special in piece:
                    piece = piece.replace(special, f"{_OPEN}{index}{_CLOSE}")
            pieces[k] = piece
        return self._open_placeholder.join(pieces)

    def _literal_text(self, index: int) -> str:
        return _OPEN if index == len(self._special_texts) else self._special_texts[index]

    def encode_chat(self, prompt: str) -> list[int]:
        """A rendered chat prompt as token ids: the template's own special tokens are control tokens; the
        placeholders `escape_specials` left are their text, tokenized as text."""
        if _OPEN not in prompt:
            return self.encode_now(prompt, add_special_tokens=False)
        parts = _PLACEHOLDER.split(prompt)  # text, index, text, index, ..., text
        ids: list[int] = []
        for i, part in enumerate(parts):
            if i % 2:
                literal = self._literal_text(int(part))
                ids.extend(self._literal.encode(literal, add_special_tokens=False).ids)
            elif part:
                ids.extend(self.encode_now(part, add_special_tokens=False))
        return ids
