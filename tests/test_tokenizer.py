"""Tokenizer: encode/decode equal transformers' AutoTokenizer on the same directory, and the configs are read."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from tiny_models import make_tiny_model
from tokenizers import AddedToken, SentencePieceBPETokenizer, processors
from tokenizers import Tokenizer as HFTokenizer

from hearth.model.tokenizer import Tokenizer, TokenizerError

transformers = pytest.importorskip("transformers")

TEXTS = [
    "",
    "hello world",
    "  leading spaces and trailing  ",
    "def f(x):\n    return x * 2\n",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "emoji 😀👍🏽 and CJK 你好，世界 and accents café naïve",
    "tabs\tand\r\nnewlines\n\n\n",
    "<|endoftext|><|endoftext|> special at start",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
]


def _hf(path: Path):
    return transformers.AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", arch="llama")


def _variant(
    base: Path,
    dest: Path,
    *,
    bos: str | None = None,
    add_bos_to_vocab: bool = True,
    bos_post_processor: bool = False,
    config_update: dict | None = None,
) -> Path:
    """A copy of `base` with a BOS token and/or a BOS-adding TemplateProcessing, Llama-3 style."""
    dest.mkdir(parents=True, exist_ok=True)
    backend = HFTokenizer.from_file(str(base / "tokenizer.json"))
    if bos is not None and add_bos_to_vocab:
        backend.add_special_tokens([AddedToken(bos, special=True, normalized=False)])
    if bos_post_processor:
        assert bos is not None
        bos_id = backend.token_to_id(bos)
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    backend.save(str(dest / "tokenizer.json"))
    config = json.loads((base / "tokenizer_config.json").read_text())
    if bos is not None:
        config["bos_token"] = bos
    config.update(config_update or {})
    (dest / "tokenizer_config.json").write_text(json.dumps(config))
    for name in ("config.json", "generation_config.json"):
        if (base / name).exists():
            shutil.copy(base / name, dest / name)
    return dest


def _assert_same_as_transformers(path: Path, extra_ids: int = 0) -> Tokenizer:
    ours = Tokenizer.from_dir(path)
    theirs = _hf(path)
    assert ours.vocab_size == len(theirs)
    for text in TEXTS:
        for add_special in (True, False):
            ids = ours.encode(text, add_special_tokens=add_special)
            assert ids == theirs(text, add_special_tokens=add_special)["input_ids"], (text, add_special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
                    ids, skip_special_tokens=skip
                )
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(ours.vocab_size) for _ in range(rng.randint(1, 30))]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    assert ours.bos_token_id == theirs.bos_token_id
    assert ours.eos_token_id == theirs.eos_token_id
    assert ours.pad_token_id == theirs.pad_token_id
    return ours


def test_tiny_model_matches_transformers(tiny_dir: Path) -> None:
    tok = _assert_same_as_transformers(tiny_dir)
    im_end = tok.token_to_id("<|im_end|>")
    assert tok.eos_token_ids == {im_end}
    assert tok.eos_token == "<|im_end|>"
    assert tok.bos_token is None and tok.bos_token_id is None
    assert tok.pad_token_id == tok.token_to_id("<|endoftext|>")
    assert {
        tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    } <= tok.special_token_ids
    assert tok.chat_template == json.loads((tiny_dir / "tokenizer_config.json").read_text())["chat_template"]
    assert tok.id_to_token(im_end) == "<|im_end|>"


@pytest.mark.parametrize("arch", ["mistral", "qwen3"])
def test_other_tiny_archs_match_transformers(arch: str, tmp_path: Path) -> None:
    _assert_same_as_transformers(make_tiny_model(tmp_path / arch, arch=arch))


def test_qwen2_checkpoint_with_qwen2_pipeline_matches_transformers(tmp_path: Path) -> None:
    # transformers swaps in Qwen2's own normalizer and split regex for model_type qwen2; real Qwen2
    # checkpoints ship exactly that pipeline in tokenizer.json, which is what Hearth reads.
    path = make_tiny_model(tmp_path / "qwen2", arch="qwen2")
    _hf(path).backend_tokenizer.save(str(path / "tokenizer.json"))
    _assert_same_as_transformers(path)


def test_llama3_style_post_processor_adds_bos(tiny_dir: Path, tmp_path: Path) -> None:
    path = _variant(tiny_dir, tmp_path / "llama3", bos="<|begin_of_text|>", bos_post_processor=True)
    tok = _assert_same_as_transformers(path)
    bos_id = tok.token_to_id("<|begin_of_text|>")
    assert tok.bos_token_id == bos_id
    assert tok.encode("hello")[0] == bos_id
    assert bos_id not in tok.encode("hello", add_special_tokens=False)
    assert tok.decode(tok.encode("hello world")) == "hello world"
    assert bos_id in tok.special_token_ids


def test_add_bos_token_false_does_not_override_tokenizer_json(tiny_dir: Path, tmp_path: Path) -> None:
    # transformers 5 ignores add_bos_token when tokenizer.json exists: the post-processor decides.
    path = _variant(
        tiny_dir, tmp_path / "v", bos="<s>", bos_post_processor=True, config_update={"add_bos_token": False}
    )
    tok = _assert_same_as_transformers(path)
    assert tok.encode("hi")[0] == tok.bos_token_id


def test_add_bos_token_true_without_post_processor(tiny_dir: Path, tmp_path: Path) -> None:
    path = _variant(
        tiny_dir,
        tmp_path / "v",
        bos="<s>",
        config_update={
            "add_bos_token": True,
            "bos_token": {"__type": "AddedToken", "content": "<s>", "special": True, "normalized": False},
        },
    )
    tok = _assert_same_as_transformers(path)
    assert tok.bos_token == "<s>"
    assert tok.bos_token_id == tok.token_to_id("<s>")


def test_special_token_missing_from_vocab_is_added_like_transformers(tiny_dir: Path, tmp_path: Path) -> None:
    path = _variant(tiny_dir, tmp_path / "v", bos="<s>", add_bos_to_vocab=False)
    tok = _assert_same_as_transformers(path)
    assert tok.bos_token_id is not None and tok.bos_token_id in tok.special_token_ids


def test_added_tokens_decoder_entries_are_added(tiny_dir: Path, tmp_path: Path) -> None:
    path = _variant(
        tiny_dir,
        tmp_path / "v",
        config_update={
            "added_tokens_decoder": {
                "512": {"content": "<tool_call>", "special": False, "normalized": False},
                "513": {"content": "<|fim|>", "special": True, "normalized": False},
            }
        },
    )
    tok = _assert_same_as_transformers(path)
    call_id = tok.token_to_id("<tool_call>")
    assert call_id is not None and call_id not in tok.special_token_ids
    assert tok.token_to_id("<|fim|>") in tok.special_token_ids
    assert call_id in tok.encode("a <tool_call> b")


def test_sentencepiece_style_tokenizer_matches_transformers(tmp_path: Path) -> None:
    sp = SentencePieceBPETokenizer()
    corpus = [" ".join(TEXTS[1:]) * 3, "The quick brown fox jumps over the lazy dog. " * 30]
    sp.train_from_iterator(
        corpus, vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    sp.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", sp.token_to_id("<s>"))]
    )
    path = tmp_path / "sp"
    path.mkdir()
    sp.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = _assert_same_as_transformers(path)
    assert tok.encode("the fox")[0] == tok.bos_token_id


def test_eos_ids_are_the_union_of_all_configs(tiny_dir: Path, tmp_path: Path) -> None:
    path = _variant(tiny_dir, tmp_path / "v")
    (path / "config.json").write_text(json.dumps({"eos_token_id": [3, 4]}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [4, 7]}))
    tok = Tokenizer.from_dir(path)
    assert tok.eos_token_ids == {3, 4, 7, tok.token_to_id("<|im_end|>")}
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    (path / "config.json").unlink()
    assert Tokenizer.from_dir(path).eos_token_ids == {9, tok.token_to_id("<|im_end|>")}


def test_eos_token_as_dict_and_nested_text_config(tiny_dir: Path, tmp_path: Path) -> None:
    path = _variant(tiny_dir, tmp_path / "v", config_update={"eos_token": {"content": "<|endoftext|>"}})
    (path / "config.json").write_text(json.dumps({"text_config": {"eos_token_id": 5}}))
    (path / "generation_config.json").unlink()
    tok = Tokenizer.from_dir(path)
    assert tok.eos_token == "<|endoftext|>"
    assert tok.eos_token_ids == {5, tok.token_to_id("<|endoftext|>")}


def test_chat_template_list_takes_default_and_jinja_file_wins(tiny_dir: Path, tmp_path: Path) -> None:
    templates = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    path = _variant(tiny_dir, tmp_path / "v", config_update={"chat_template": templates})
    assert Tokenizer.from_dir(path).chat_template == "D"
    (path / "chat_template.jinja").write_text("{{ messages }}")
    assert Tokenizer.from_dir(path).chat_template == "{{ messages }}"
    config = json.loads((path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "chat_template.jinja").unlink()
    assert Tokenizer.from_dir(path).chat_template is None


def test_only_tokenizer_json_is_enough(tiny_dir: Path, tmp_path: Path) -> None:
    shutil.copy(tiny_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.eos_token_ids == set() and tok.chat_template is None
    assert tok.decode(tok.encode("hello world")) == "hello world"


def test_missing_tokenizer_json_is_a_one_line_error_naming_the_file(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError) as err:
        Tokenizer.from_dir(tmp_path)
    assert "tokenizer.json" in str(err.value) and "\n" not in str(err.value)


def test_corrupt_tokenizer_json_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
