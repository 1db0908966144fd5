"""Random prompt material of a given length in tokens, for servers we may not be able to tokenize for.

With a tokenizer (`tokenizer.json`, read by `tokenizers`, not transformers) the text decodes from
random token ids and re-encodes to the asked length. Without one, text is built from common
English words (about one token each in BPE vocabularies), and completions can send raw token ids.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from pathlib import Path

_WORDS = (
    "the of and to in is for on that with as by at from this be are or an it was not but which "
    "have has one can all will more when there other their were about if into out time new some "
    "would what these two may first any like only over such after also used data value file list "
    "result request model server agent tool call query table user system state error check update "
    "search memory store index page cache token batch queue event graph node path field record"
).split()


class TextSource(ABC):
    """Makes random text and token ids. Contract: `text(n)` is about n tokens for the target server;
    `token_ids(n)` is exactly n ids valid for it."""

    @abstractmethod
    def text(self, num_tokens: int, rng: random.Random) -> str: ...

    @abstractmethod
    def token_ids(self, num_tokens: int, rng: random.Random) -> list[int]: ...

    def count_tokens(self, text: str) -> int:
        return len(text.split())


class WordTextSource(TextSource):
    """No tokenizer: words for text, ids from a range that any vocabulary of that size accepts."""

    def __init__(self, token_id_low: int = 10, token_id_high: int = 500) -> None:
        if not 0 <= token_id_low < token_id_high:
            raise ValueError(f"bad token id range [{token_id_low}, {token_id_high})")
        self.token_id_low = token_id_low
        self.token_id_high = token_id_high

    def text(self, num_tokens: int, rng: random.Random) -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(num_tokens))

    def token_ids(self, num_tokens: int, rng: random.Random) -> list[int]:
        return [rng.randrange(self.token_id_low, self.token_id_high) for _ in range(num_tokens)]


class TokenizerTextSource(TextSource):
    """Exact lengths from the served model's own `tokenizer.json`."""

    def __init__(self, tokenizer_path: str | Path) -> None:
        from tokenizers import Tokenizer

        path = Path(tokenizer_path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {path}; pass the model directory or the file")
        self.tokenizer = Tokenizer.from_file(str(file))
        special_ids = {int(i) for i, t in self.tokenizer.get_added_tokens_decoder().items() if t.special}
        candidates = [i for i in range(self.tokenizer.get_vocab_size()) if i not in special_ids]
        # Lone byte tokens decode to U+FFFD, which re-encodes to other tokens: leave them out.
        pieces = self.tokenizer.decode_batch([[i] for i in candidates])
        self._ids = [
            i for i, piece in zip(candidates, pieces, strict=True) if piece and "\ufffd" not in piece
        ]
        if not self._ids:
            raise ValueError(f"tokenizer at {path} has no plain-text tokens to build prompts from")

    def token_ids(self, num_tokens: int, rng: random.Random) -> list[int]:
        return [rng.choice(self._ids) for _ in range(num_tokens)]

    def text(self, num_tokens: int, rng: random.Random) -> str:
        if num_tokens <= 0:
            return ""
        # Decoding random ids and re-encoding does not round-trip exactly; trimming or topping up
        # the re-encoded ids and decoding once more lands close to the target, as vllm bench does.
        ids = self.token_ids(num_tokens, rng)
        for _ in range(5):
            text = self.tokenizer.decode(ids)
            encoded = self.tokenizer.encode(text, add_special_tokens=False).ids
            if len(encoded) == num_tokens:
                return text
            ids = encoded[:num_tokens] + self.token_ids(max(0, num_tokens - len(encoded)), rng)
        return self.tokenizer.decode(ids)

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)
