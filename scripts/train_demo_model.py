"""Train Hearth's demo model (models/demo) and its speculative-decoding draft (models/demo-draft).

Both are Qwen3-architecture causal LMs sharing one byte-level BPE tokenizer, trained from scratch on
the standard library's source and docstrings plus synthetic agent conversations (see demo_data.py).
Deterministic for a seed on one machine and Python version; the defaults fit in about half an hour
on 2 CPU cores.

    python scripts/train_demo_model.py --out-dir models            # the shipped models
    python scripts/train_demo_model.py --out-dir /tmp/m --target-steps 5 --draft-steps 5 --num-conversations 200

The target and draft stages are independent given the tokenizer, so on a busy machine they can run
side by side (`--stage tokenizer`, then `--stage target` and `--stage draft`); the result is the same.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import demo_data  # noqa: E402


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int


TARGET_SHAPE = ModelShape(256, 512, 3, 4, 2)
DRAFT_SHAPE = ModelShape(128, 384, 2, 4, 2)


def train_tokenizer(texts: list[str], vocab_size: int, out_dir: Path, split_spaces: bool = False) -> Any:
    """A byte-level BPE tokenizer with ChatML specials and whole-token tool tags; returns the HF tokenizer."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if split_spaces:
        # Words never carry their leading space, so "Paris" in a request and in `{"city": "Paris"}` is one
        # token id and a small model can copy it; digits stay single.
        words = Regex(r"\s+|[A-Za-z]+|[0-9]|[^\sA-Za-z0-9]+")
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(words, behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(demo_data.TOOL_TOKENS),
        special_tokens=demo_data.SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in demo_data.TOOL_TOKENS])
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": demo_data.EOS_TOKEN,
        "pad_token": demo_data.PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": False,
        "chat_template": demo_data.CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return PreTrainedTokenizerFast.from_pretrained(str(out_dir))


def build_model(shape: ModelShape, vocab_size: int, eos_id: int, seed: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.hidden_size // shape.num_attention_heads,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def make_batches(examples: list[Example], batch_size: int, seed: int) -> list[list[Example]]:
    """Shuffle, then sort within windows of 16 batches so a batch pads little."""
    rng = random.Random(seed)
    order = examples[:]
    rng.shuffle(order)
    window = 16 * batch_size
    batches = []
    for start in range(0, len(order), window):
        chunk = sorted(order[start : start + window], key=lambda x: len(x.ids))
        batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches


def assistant_mask(ids: list[int], im_start_id: int, im_end_id: int, header_ids: list[int]) -> list[bool]:
    """True on the tokens of assistant turns (their content and closing <|im_end|>)."""
    mask = [False] * len(ids)
    inside = False
    for i, token in enumerate(ids):
        if token == im_start_id and ids[i + 1 : i + 1 + len(header_ids)] == header_ids:
            inside, start = True, i + 1 + len(header_ids)
        if inside and i >= start:
            mask[i] = True
            if token == im_end_id:
                inside = False
    return mask


@dataclass(frozen=True)
class Example:
    ids: list[int]
    weights: list[float]  # loss weight of predicting each token


def collate(batch: list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    length = max(len(x.ids) for x in batch)
    input_ids = torch.full((len(batch), length), pad_id, dtype=torch.long)
    weights = torch.zeros((len(batch), length), dtype=torch.float32)
    attention_mask = torch.zeros((len(batch), length), dtype=torch.long)
    for row, example in enumerate(batch):
        input_ids[row, : len(example.ids)] = torch.tensor(example.ids)
        weights[row, : len(example.ids)] = torch.tensor(example.weights)
        attention_mask[row, : len(example.ids)] = 1
    return {"input_ids": input_ids, "weights": weights, "attention_mask": attention_mask}


def weighted_lm_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    targets = batch["input_ids"][:, 1:]
    weights = batch["weights"][:, 1:]
    losses = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), reduction="none"
    )
    return (losses * weights.reshape(-1)).sum() / weights.sum()


def train(
    model: torch.nn.Module,
    batches: list[list[Example]],
    num_steps: int,
    pad_id: int,
    peak_lr: float,
    log_prefix: str,
) -> dict[str, float]:
    """AdamW with linear warmup and cosine decay to 10%; cycles through `batches` if needed."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.01)
    warmup_steps = max(1, min(40, num_steps // 10))

    def lr_at(step: int) -> float:
        if step < warmup_steps:
            return peak_lr * (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, num_steps - warmup_steps)
        return peak_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    model.train()
    start_s = time.monotonic()
    num_tokens, recent_losses = 0, []
    for step in range(num_steps):
        batch = collate(batches[step % len(batches)], pad_id)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        loss = weighted_lm_loss(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        num_tokens += int(batch["attention_mask"].sum())
        recent_losses.append(loss.item())
        if (step + 1) % 10 == 0 or step + 1 == num_steps:
            elapsed_s = time.monotonic() - start_s
            print(
                f"[{log_prefix}] step {step + 1}/{num_steps} loss {sum(recent_losses) / len(recent_losses):.3f} "
                f"lr {lr_at(step):.2e} tokens {num_tokens} tok/s {num_tokens / elapsed_s:.0f} "
                f"elapsed {elapsed_s:.0f}s",
                flush=True,
            )
            recent_losses = []
    model.eval()
    return {"train_time_s": time.monotonic() - start_s, "train_tokens": num_tokens}


def save_model(model: torch.nn.Module, tokenizer_dir: Path, out_dir: Path, eos_id: int, pad_id: int) -> None:
    import shutil

    out_dir.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    model.to(torch.float32)
    if tokenizer_dir != out_dir:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer_dir / name, out_dir / name)
    generation = {"eos_token_id": eos_id, "pad_token_id": pad_id, "do_sample": False, "max_new_tokens": 256}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out-dir", type=Path, default=Path("models"), help="writes <out>/demo, <out>/demo-draft"
    )
    parser.add_argument(
        "--stage",
        choices=["all", "tokenizer", "target", "draft"],
        default="all",
        help="run one stage only; target and draft need the tokenizer stage and may run side by side",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (results depend on it)")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--split-spaces", action="store_true", help="pre-tokenize spaces apart from words")
    parser.add_argument("--num-conversations", type=int, default=12000)
    parser.add_argument("--stdlib-chars", type=int, default=1_500_000)
    parser.add_argument("--max-seq-tokens", type=int, default=768)
    parser.add_argument(
        "--stdlib-share", type=float, default=0.08, help="share of training examples from stdlib"
    )
    parser.add_argument("--assistant-weight", type=float, default=6.0, help="loss weight of assistant tokens")
    parser.add_argument("--target-steps", type=int, default=3000)
    parser.add_argument("--target-batch-size", type=int, default=4)
    parser.add_argument("--target-lr", type=float, default=3e-3)
    parser.add_argument("--draft-steps", type=int, default=1000)
    parser.add_argument("--draft-batch-size", type=int, default=4)
    parser.add_argument("--draft-lr", type=float, default=4e-3)
    return parser.parse_args(argv)


def load_texts(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    convs = demo_data.conversations(args.seed, args.num_conversations)
    conv_texts = [demo_data.render_conversation(c) for c in convs]
    stdlib_texts = list(demo_data.stdlib_documents("train", args.stdlib_chars, args.seed))
    print(f"data: {len(conv_texts)} conversations, {len(stdlib_texts)} stdlib documents", flush=True)
    return conv_texts, stdlib_texts


def train_stage(args: argparse.Namespace, role: str, conv_texts: list[str], stdlib_texts: list[str]) -> None:
    """Train and save one model ("target" or "draft") with the tokenizer in <out>/demo."""
    from transformers import PreTrainedTokenizerFast

    target_dir = args.out_dir / "demo"
    out_dir = target_dir if role == "target" else args.out_dir / "demo-draft"
    shape, steps, batch_size, lr = (
        (TARGET_SHAPE, args.target_steps, args.target_batch_size, args.target_lr)
        if role == "target"
        else (DRAFT_SHAPE, args.draft_steps, args.draft_batch_size, args.draft_lr)
    )
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(target_dir))
    eos_id = tokenizer.convert_tokens_to_ids(demo_data.EOS_TOKEN)
    pad_id = tokenizer.convert_tokens_to_ids(demo_data.PAD_TOKEN)

    im_start_id = tokenizer.convert_tokens_to_ids("<|im_start|>")
    header_ids = tokenizer("assistant\n", add_special_tokens=False)["input_ids"]

    def encode(texts: list[str]) -> list[Example]:
        examples = []
        for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
            ids = ids[: args.max_seq_tokens - 1] + [pad_id]
            # Assistant turns (tool calls, answers) weigh more than the prompt text around them.
            mask = assistant_mask(ids, im_start_id, eos_id, header_ids)
            examples.append(Example(ids, [args.assistant_weight if m else 1.0 for m in mask]))
        return examples

    conv_examples = encode(conv_texts)
    num_stdlib = int(len(conv_examples) * args.stdlib_share / (1 - args.stdlib_share))
    stdlib_examples = encode(stdlib_texts)[:num_stdlib]
    batches = make_batches(conv_examples + stdlib_examples, batch_size, args.seed)

    model = build_model(shape, len(tokenizer), eos_id, args.seed)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"[{role}] {num_params / 1e6:.2f}M parameters, {steps} steps of batch {batch_size}", flush=True)
    run = train(model, batches, steps, pad_id, lr, role)
    save_model(model, target_dir, out_dir, eos_id, pad_id)
    stats = {
        "seed": args.seed,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "threads": args.threads,
        "shape": asdict(shape),
        "num_params": num_params,
        "steps": steps,
        "batch_size": batch_size,
        "peak_lr": lr,
        "assistant_weight": args.assistant_weight,
        **run,
        "data": {
            "num_conversations": len(conv_examples),
            "conversation_tokens": sum(len(x.ids) for x in conv_examples),
            "num_stdlib_documents": len(stdlib_examples),
            "stdlib_tokens": sum(len(x.ids) for x in stdlib_examples),
            "vocab_size": len(tokenizer),
        },
    }
    (out_dir / "training_stats.json").write_text(json.dumps(stats, indent=2) + "\n")


def _without_option(argv: list[str], option: str) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == option:
            skip = True
        elif not arg.startswith(option + "="):
            out.append(arg)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    started_s = time.monotonic()
    conv_texts, stdlib_texts = load_texts(args)
    if args.stage in ("all", "tokenizer"):
        train_tokenizer(conv_texts + stdlib_texts, args.vocab_size, args.out_dir / "demo", args.split_spaces)
        print(f"tokenizer trained in {time.monotonic() - started_s:.0f}s", flush=True)
    if args.stage == "all":
        # Target and draft side by side, one process (and core) each: results do not depend on it.
        stage_argv = _without_option(argv if argv is not None else sys.argv[1:], "--stage")
        children = [
            subprocess.Popen([sys.executable, __file__, *stage_argv, "--stage", role])
            for role in ("target", "draft")
        ]
        if any(child.wait() != 0 for child in children):
            return 1
    elif args.stage in ("target", "draft"):
        train_stage(args, args.stage, conv_texts, stdlib_texts)
    print(f"done in {time.monotonic() - started_s:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
