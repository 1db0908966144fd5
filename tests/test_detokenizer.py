"""IncrementalDetokenizer: deltas concatenate to the full decode, incomplete characters are held back."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tiny_models import make_tiny_model
from tokenizers import SentencePieceBPETokenizer

from hearth.engine.detokenizer import IncrementalDetokenizer
from hearth.model.tokenizer import Tokenizer

TEXTS = [
    "emoji 😀👍🏽🇫🇷 done",
    "你好，世界！这是一个测试。",
    "mixed: café — naïve ✓ → ∑ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "plain ascii text with code: def f(x): return x",
    "<|im_start|>assistant\nこんにちは<|im_end|>",
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", arch="llama"))


@pytest.fixture(scope="module")
def sp_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """A SentencePiece-style tokenizer (Metaspace pre-tokenizer and decoder), as Llama 2 / Mistral use."""
    sp = SentencePieceBPETokenizer()
    corpus = ["The quick brown fox jumps over the lazy dog. Hello world, hello there! " * 20, " ".join(TEXTS)]
    sp.train_from_iterator(
        corpus, vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    path = tmp_path_factory.mktemp("sp")
    sp.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return Tokenizer.from_dir(path)


def _stream(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random | None = None) -> list[str]:
    deltas = []
    i = 0
    while i < len(ids):
        step = 1 if rng is None else rng.randint(1, 4)
        deltas.append(detok.add(ids[i : i + step]))
        i += step
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_equals_full_decode_and_never_emits_broken_characters(
    tokenizer: Tokenizer, text: str
) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=tokenizer.encode("Say:"))
    deltas = _stream(detok, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == tokenizer.decode(ids)


def test_multibyte_character_is_held_until_complete(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("😀", add_special_tokens=False)
    assert len(ids) > 1, "the tiny tokenizer should split the emoji into byte tokens"
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=[])
    deltas = _stream(detok, ids)
    assert deltas[:-1] == [""] * (len(ids) - 1)
    assert deltas[-1] == "😀"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_ids_in_random_chunks_concatenate_to_decode(
    tokenizer: Tokenizer, skip_special_tokens: bool
) -> None:
    rng = random.Random(7)
    byte_heavy = [i for i in range(tokenizer.vocab_size) if tokenizer.decode([i], False) == "\ufffd"]
    specials = sorted(tokenizer.special_token_ids)
    for _ in range(200):
        pool = list(range(tokenizer.vocab_size)) + byte_heavy * 3 + specials
        output = [rng.choice(pool) for _ in range(rng.randint(1, 40))]
        prompt = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(0, 8))]
        detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip_special_tokens)
        text = "".join(_stream(detok, output, rng)) + detok.flush()
        assert text == tokenizer.decode(output, skip_special_tokens=skip_special_tokens), (prompt, output)
        assert detok.output_token_ids == output


def test_encoded_texts_token_by_token_with_random_prompts(tokenizer: Tokenizer) -> None:
    rng = random.Random(3)
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        for _ in range(10):
            start = rng.randrange(len(ids))
            output = ids[start:]
            detok = IncrementalDetokenizer(tokenizer, ids[:start])
            assert "".join(_stream(detok, output, rng)) + detok.flush() == tokenizer.decode(output)


def test_prompt_ending_mid_character_does_not_corrupt_output(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("ok 😀", add_special_tokens=False)
    prompt, output = ids[:-1], ids[-1:]
    detok = IncrementalDetokenizer(tokenizer, prompt)
    assert detok.add(output) + detok.flush() == tokenizer.decode(output)


def test_special_tokens_are_skipped_or_kept(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("hi<|im_end|>", add_special_tokens=False)
    skipping = IncrementalDetokenizer(tokenizer, [])
    keeping = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    assert "".join(_stream(skipping, ids)) == "hi"
    assert "".join(_stream(keeping, ids)) == "hi<|im_end|>"


def test_sentencepiece_first_token_keeps_its_space_after_the_prompt(sp_tokenizer: Tokenizer) -> None:
    prompt = sp_tokenizer.encode("The quick brown", add_special_tokens=False)
    output = sp_tokenizer.encode("fox jumps over the lazy dog", add_special_tokens=False)
    detok = IncrementalDetokenizer(sp_tokenizer, prompt)
    text = "".join(_stream(detok, output)) + detok.flush()
    full = sp_tokenizer.decode(prompt + output)
    assert text == full[len(sp_tokenizer.decode(prompt)) :] == " fox jumps over the lazy dog"
    # Without a prompt it is the output's own decode.
    detok = IncrementalDetokenizer(sp_tokenizer, [])
    assert "".join(_stream(detok, output)) == sp_tokenizer.decode(output)


class _SpyTokenizer:
    """Records the length of every window the detokenizer decodes."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner
        self.max_window_tokens = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.max_window_tokens = max(self.max_window_tokens, len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_cost_per_token_does_not_grow_with_output_length(tokenizer: Tokenizer, tmp_path: Path) -> None:
    spy = _SpyTokenizer(tokenizer)
    ids = tokenizer.encode(" ".join(TEXTS) * 20, add_special_tokens=False)
    assert len(ids) > 1000
    detok = IncrementalDetokenizer(spy, prompt_token_ids=ids[:100])  # type: ignore[arg-type]
    text = "".join(_stream(detok, ids))
    assert text == tokenizer.decode(ids)
    # A window spans the previous emit plus one held-back character at most.
    assert spy.max_window_tokens <= 16
