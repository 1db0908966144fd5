"""The tokenizer of a Hugging Face checkpoint, over the `tokenizers` library (no `transformers` import).

Encoding and decoding match `transformers.AutoTokenizer` (v5) on the same directory: `tokenizer.json`
is used as is, so its post-processor decides whether BOS/EOS are added (transformers 5 ignores
`add_bos_token`/`add_eos_token` in `tokenizer_config.json` whenever `tokenizer.json` exists), and
special tokens named in `tokenizer_config.json` that the vocabulary lacks are added, in the same order.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

_NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_EXTRA_SPECIAL_TOKEN_KEYS = ("additional_special_tokens", "extra_special_tokens")
# transformers' `clean_up_tokenization`: undo the spaces WordPiece-style decoders put before punctuation.
_CLEANUP_REPLACEMENTS = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


class TokenizerError(ValueError):
    """A tokenizer directory that cannot be loaded; the message names the file and what is wrong."""


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"cannot read {path}: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _token_content(value: Any) -> str | None:
    """A special token given as a string or as an AddedToken dict (`{"content": ...}`)."""
    if isinstance(value, str):
        return value or None
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"] or None
    return None


def _as_added_token(value: Any, special: bool) -> AddedToken | None:
    content = _token_content(value)
    if content is None:
        return None
    if isinstance(value, Mapping):
        return AddedToken(
            content,
            single_word=bool(value.get("single_word", False)),
            lstrip=bool(value.get("lstrip", False)),
            rstrip=bool(value.get("rstrip", False)),
            normalized=bool(value.get("normalized", not special)),
            special=bool(value.get("special", special)),
        )
    return AddedToken(content, special=special, normalized=False)


def _id_list(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, Iterable) and not isinstance(value, (str, bytes, Mapping)):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _pick_chat_template(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        template = named.get("default")
        return template if isinstance(template, str) else None
    return None


class Tokenizer:
    """Text <-> token ids for one checkpoint. Build it with `Tokenizer.from_dir(model_dir)`."""

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
        clean_up_tokenization_spaces: bool = False,
    ) -> None:
        self._backend = backend
        self._bos_token = bos_token
        self._eos_token = eos_token
        self._pad_token = pad_token
        self._chat_template = chat_template
        # transformers skips the cleanup for BPE models: it would eat real spaces before punctuation.
        self._clean_up = clean_up_tokenization_spaces and type(backend.model).__name__ != "BPE"

        added = backend.get_added_tokens_decoder()
        self._special_token_ids = {token_id for token_id, token in added.items() if token.special}
        for token_id in (self.bos_token_id, self.eos_token_id, self.pad_token_id):
            if token_id is not None:
                self._special_token_ids.add(token_id)
        # Ids of the base vocabulary are contiguous; added tokens may leave holes, so take the max.
        self._vocab_size = max([backend.get_vocab_size(with_added_tokens=False), *(i + 1 for i in added)])

        eos_ids = set(extra_eos_token_ids)
        if self.eos_token_id is not None:
            eos_ids.add(self.eos_token_id)
        self._eos_token_ids = eos_ids

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load `tokenizer.json` plus the configs around it (tokenizer_config, config, generation_config);
        for a GGUF file, the tokenizer its metadata describes (`from_gguf`)."""
        from hearth.model.gguf_file import is_gguf_path

        if is_gguf_path(model_dir):
            return cls.from_gguf(model_dir)
        model_dir = Path(model_dir)
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerError(f"no tokenizer.json in {model_dir} (Hearth needs a fast-tokenizer file)")
        try:
            backend = HFTokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust parser raises a bare Exception
            raise TokenizerError(f"cannot parse {tokenizer_file}: {exc}") from exc

        tok_config = _read_json(model_dir / "tokenizer_config.json")
        special_map = _read_json(model_dir / "special_tokens_map.json")
        # tokenizer_config wins; special_tokens_map.json is the older place for the same keys.
        for key, value in special_map.items():
            tok_config.setdefault(key, value)

        cls._add_missing_tokens(backend, tok_config)

        chat_template = _pick_chat_template(tok_config.get("chat_template"))
        template_file = model_dir / "chat_template.jinja"
        if template_file.is_file():
            chat_template = template_file.read_text(encoding="utf-8")

        eos_ids: set[int] = set()
        model_config = _read_json(model_dir / "config.json")
        for config in (model_config, model_config.get("text_config") or {}):
            if isinstance(config, Mapping):
                eos_ids.update(_id_list(config.get("eos_token_id")))
        eos_ids.update(_id_list(_read_json(model_dir / "generation_config.json").get("eos_token_id")))

        return cls(
            backend,
            bos_token=_token_content(tok_config.get("bos_token")),
            eos_token=_token_content(tok_config.get("eos_token")),
            pad_token=_token_content(tok_config.get("pad_token")),
            extra_eos_token_ids=eos_ids,
            chat_template=chat_template,
            clean_up_tokenization_spaces=bool(tok_config.get("clean_up_tokenization_spaces", False)),
        )

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """The tokenizer, special tokens, EOS ids and chat template of a GGUF file's metadata."""
        from hearth.model.config import ModelLoadError
        from hearth.model.gguf_file import GGUFCheckpoint
        from hearth.model.gguf_tokenizer import tokenizer_from_gguf

        try:
            checkpoint = GGUFCheckpoint(path)
            fields = checkpoint.tokenizer_fields()
            backend = tokenizer_from_gguf(fields, str(path))
        except ModelLoadError as exc:
            raise TokenizerError(str(exc)) from None
        tokens = fields.get("ggml.tokens") or []

        def token(key: str) -> str | None:
            token_id = fields.get(key)
            return (
                tokens[int(token_id)] if token_id is not None and 0 <= int(token_id) < len(tokens) else None
            )

        return cls(
            backend,
            bos_token=token("ggml.bos_token_id"),
            eos_token=token("ggml.eos_token_id"),
            pad_token=token("ggml.padding_token_id"),
            extra_eos_token_ids=checkpoint.hf_config()["eos_token_id"],
            chat_template=fields.get("chat_template"),
        )

    @staticmethod
    def _add_missing_tokens(backend: HFTokenizer, tok_config: Mapping[str, Any]) -> None:
        """Add what tokenizer_config declares but tokenizer.json lacks, in transformers' order."""
        declared = tok_config.get("added_tokens_decoder")
        if isinstance(declared, Mapping):
            entries = sorted(
                ((int(k), v) for k, v in declared.items() if str(k).isdigit()), key=lambda e: e[0]
            )
            for _, value in entries:
                token = _as_added_token(
                    value, special=bool(isinstance(value, Mapping) and value.get("special"))
                )
                if token is not None and backend.token_to_id(token.content) is None:
                    if token.special:
                        backend.add_special_tokens([token])
                    else:
                        backend.add_tokens([token])
        specials: list[Any] = [tok_config.get(key) for key in _NAMED_SPECIAL_TOKENS]
        for key in _EXTRA_SPECIAL_TOKEN_KEYS:
            extra = tok_config.get(key)
            if isinstance(extra, list):
                specials.extend(extra)
        for value in specials:
            token = _as_added_token(value, special=True)
            if token is not None and backend.token_to_id(token.content) is None:
                backend.add_special_tokens([token])

    # ---- properties -------------------------------------------------------------------------

    @property
    def backend(self) -> HFTokenizer:
        """The underlying `tokenizers.Tokenizer` (for batch encoding or streaming decode)."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """One past the largest token id the tokenizer can produce (added tokens included)."""
        return self._vocab_size

    @property
    def eos_token_ids(self) -> set[int]:
        """Every id that ends generation: generation_config, config and tokenizer_config together."""
        return set(self._eos_token_ids)

    @property
    def bos_token(self) -> str | None:
        return self._bos_token

    @property
    def eos_token(self) -> str | None:
        return self._eos_token

    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self._bos_token) if self._bos_token else None

    @property
    def eos_token_id(self) -> int | None:
        return self.token_to_id(self._eos_token) if self._eos_token else None

    @property
    def pad_token_id(self) -> int | None:
        return self.token_to_id(self._pad_token) if self._pad_token else None

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @property
    def special_token_ids(self) -> set[int]:
        return set(self._special_token_ids)

    # ---- conversions ------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Encode many texts at once (parallel in the Rust library)."""
        return [enc.ids for enc in self._backend.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        text = self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if self._clean_up:
            for old, new in _CLEANUP_REPLACEMENTS:
                text = text.replace(old, new)
        return text

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def __len__(self) -> int:
        return self._vocab_size

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self._vocab_size}, bos={self._bos_token!r}, eos={self._eos_token!r})"
