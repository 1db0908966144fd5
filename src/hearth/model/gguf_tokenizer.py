"""The tokenizer a GGUF file describes (its `tokenizer.ggml.*` metadata), as a `tokenizers.Tokenizer`
that encodes as transformers' `AutoTokenizer.from_pretrained(dir, gguf_file=...)` does.

Byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`) whose pre-tokenizer is GPT-2's own
split are built here with the `tokenizers` library (no transformers import at serving time). Other
kinds (sentencepiece, model-specific split patterns) go through transformers' GGUF converter, which
knows each of them; without transformers installed they are refused with what to install.
"""

from __future__ import annotations

import functools
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from hearth.model.config import ModelLoadError

# `tokenizer.ggml.pre` values whose split is GPT-2's default regex (transformers has no pattern of its own
# for them either).
_GPT2_SPLIT_PRE = ("default", "gpt2", "smollm", "starcoder")
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types


@functools.cache
def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (the alphabet byte-level vocabularies are spelled in)."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    )
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def tokenizer_from_gguf(fields: dict[str, Any], source: str) -> Tokenizer:
    """`fields`: the file's `tokenizer.*` metadata, prefix dropped (`GGUFCheckpoint.tokenizer_fields`)."""
    model = fields.get("ggml.model")
    pre = fields.get("ggml.pre") or "default"
    if model == "gpt2" and pre in _GPT2_SPLIT_PRE:
        return _byte_level_bpe(fields)
    backend = _via_transformers(source)
    # transformers adds BOS/EOS in its tokenizer class, not in the backend: the file's flags say where.
    backend.post_processor = _post_processor(fields, list(fields["ggml.tokens"]))
    return backend


def _byte_level_bpe(fields: dict[str, Any]) -> Tokenizer:
    tokens: list[str] = list(fields["ggml.tokens"])
    token_types: list[int] = list(fields.get("ggml.token_type") or [])
    spelling = _byte_to_unicode()
    alphabet = set(spelling.values())
    vocab = {
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): index
        for index, token in enumerate(tokens)
    }
    merges = [tuple(merge.split(" ", 1)) for merge in fields.get("ggml.merges") or []]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    # Control tokens stay whole and are special; one spelled outside the byte alphabet is a llama.cpp
    # mislabel (transformers skips it too: adding it would grow the vocabulary past the model's).
    specials = [
        AddedToken(token, normalized=False, special=True)
        for token, kind in zip(tokens, token_types)
        if kind == _CONTROL and set(token) <= alphabet
    ]
    backend.add_special_tokens(specials)
    user_defined = [
        AddedToken(token, normalized=False, special=False)
        for token, kind in zip(tokens, token_types)
        if kind == _USER_DEFINED
    ]
    backend.add_tokens(user_defined)
    backend.post_processor = _post_processor(fields, tokens)
    return backend


def _post_processor(fields: dict[str, Any], tokens: list[str]) -> processors.TemplateProcessing:
    """BOS / EOS around the text as the file's `add_bos_token` / `add_eos_token` say."""
    single, special = ["$A"], []
    for flag, key, at_start in (
        ("ggml.add_bos_token", "ggml.bos_token_id", True),
        ("ggml.add_eos_token", "ggml.eos_token_id", False),
    ):
        token_id = fields.get(key)
        if fields.get(flag) and token_id is not None:
            token = tokens[int(token_id)]
            single = [token, *single] if at_start else [*single, token]
            special.append((token, int(token_id)))
    pair = single + [part if part != "$A" else "$B:1" for part in single]
    return processors.TemplateProcessing(single=" ".join(single), pair=" ".join(pair), special_tokens=special)


def _via_transformers(source: str) -> Tokenizer:
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            convert_gguf_tokenizer,
            get_gguf_tokenizer,
        )
    except ImportError:
        raise ModelLoadError(
            f"{source}: this GGUF's tokenizer is built by transformers' GGUF converter: pip install transformers"
        ) from None
    try:
        architecture, tokenizer_dict, _ = get_gguf_tokenizer(source)
        backend, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
    except (ValueError, KeyError) as exc:
        raise ModelLoadError(f"{source}: cannot build its tokenizer ({exc})") from None
    return backend
