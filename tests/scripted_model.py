"""A tiny checkpoint scripted to write a fixed answer, so the server's parsers are tested on text a real engine
generates. Its attention and MLP outputs are zero, so each next token depends only on the current one, and its
LM head maps the last token of the chat prompt to the answer's first piece, each piece to the next, and the
last to EOS. Every piece is one added token; pieces must be distinct so the chain never revisits a token. Any
prompt that ends like the scripted one (every ChatML generation prompt does) gets the same answer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tiny_models import make_tiny_model

from hearth.server.chat_template import ChatTemplate


def scripted_model(
    root: Path, answer: list[str], messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> Path:
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    from tokenizers import AddedToken, Tokenizer

    assert len(set(answer)) == len(answer), "pieces must be distinct"
    # make_tiny_model shares one tokenizer per size between the models it makes (copied from the first
    # one's directory): the copy is changed here, never a directory another model's tokenizer comes from.
    base = make_tiny_model(root / "scripted-base", vocab_size=640)
    path = root / "scripted"
    shutil.copytree(base, path)
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer.add_tokens([AddedToken(piece, normalized=False, special=False) for piece in answer])
    tokenizer.save(str(path / "tokenizer.json"))
    answer_ids = [tokenizer.token_to_id(piece) for piece in answer]
    assert max(answer_ids) < 640, "the embedding has 640 rows"
    eos_id = tokenizer.token_to_id("<|im_end|>")
    prompt = ChatTemplate.from_dir(path).render(messages, tools=tools, add_generation_prompt=True)
    last_prompt_id = tokenizer.encode(prompt, add_special_tokens=False).ids[-1]
    chain = [last_prompt_id, *answer_ids, eos_id]

    weights = load_file(str(path / "model.safetensors"))
    hidden = weights["model.embed_tokens.weight"].shape[1]
    for name, tensor in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.zero_()  # the residual stream stays the current token's embedding
    weights["model.norm.weight"].fill_(1.0)
    sources = chain[:-1]
    basis, _ = torch.linalg.qr(torch.randn(hidden, len(sources), generator=torch.Generator().manual_seed(0)))
    head = torch.zeros_like(weights["lm_head.weight"])
    for k, (source, target) in enumerate(zip(sources, chain[1:], strict=True)):
        weights["model.embed_tokens.weight"][source] = basis[:, k]
        head[target] = 50.0 * basis[:, k]
    weights["lm_head.weight"] = head
    save_file(weights, str(path / "model.safetensors"))
    return path
