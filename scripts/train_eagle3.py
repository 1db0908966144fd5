"""Train an EAGLE-3 head for a target model on CPU, by self-distillation, and write it in the published layout.

Data: prompts in the target's training style (the demo model's synthetic agent conversations,
`demo_data.py`, cut before each assistant turn, from seeds the target was not trained on), a share of them
with the last user request re-phrased (lower/upper case, terse, as a question, chatty prefixes: issue 16
item 5); the target answers each greedily through Hearth (what it will say when served is what the head
must guess); transformers computes the target's residual streams at the head's aux layers for every
position. `--random-prompts N` instead draws prompt tokens at random (a random-weight bench model has no
training style; its greedy continuations are still what a head has to learn to guess).

Training: `hearth.model.eagle3_reference.ReferenceEagle3Head` with the training-time test over
`--ttt-steps` chained steps (step s weighs 0.8^s), cross-entropy against the target's own tokens mapped
into the draft vocabulary (the `--draft-vocab-size` most frequent tokens of the generations); the
target's embedding is shared, frozen, and not saved.

    python scripts/train_eagle3.py --model models/demo --out models/demo-eagle3
    python scripts/train_eagle3.py --model /tmp/bench-models/M --out /tmp/M-eagle3 --random-prompts 300
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "scripts"))
sys.path.insert(0, str(REPO_ROOT / "src"))

from hearth.model.eagle3_reference import ReferenceEagle3Head  # noqa: E402

_POLITE = re.compile(
    r"^(could you( please)?|can you( please)?|please|i'd like you to|i need you to|would you)\s+",
    re.IGNORECASE,
)


def paraphrase(text: str, rng: random.Random) -> str:
    """One rewording of a request: the surface forms a new user types that the templates never show."""
    kind = rng.choice(["lower", "upper", "terse", "question", "prefix", "no_punct"])
    if kind == "lower":
        return text.lower()
    if kind == "upper":
        return text.upper()
    if kind == "terse":
        terse = _POLITE.sub("", text).rstrip(".!?")
        return terse[:1].lower() + terse[1:]
    if kind == "question":
        core = _POLITE.sub("", text).rstrip(".!?")
        return rng.choice(["Can you ", "Could you ", "Would you mind: "]) + core[:1].lower() + core[1:] + "?"
    if kind == "prefix":
        return rng.choice(["hey, ", "quick one: ", "ok so ", "pls ", "Hi! "]) + text
    return text.rstrip(".!?")


def agent_prompts(seed: int, num_conversations: int, paraphrase_share: float) -> list[tuple[list, Any]]:
    """(messages, tools) cut before every assistant turn of the conversations."""
    import demo_data

    rng = random.Random(seed + 1)
    prompts = []
    for conv in demo_data.conversations(seed, num_conversations):
        for index, message in enumerate(conv.messages):
            if message["role"] != "assistant":
                continue
            messages = [dict(m) for m in conv.messages[:index]]
            if messages and messages[-1]["role"] == "user" and rng.random() < paraphrase_share:
                messages[-1]["content"] = paraphrase(messages[-1]["content"], rng)
            prompts.append((messages, conv.tools))
    return prompts


def encode_prompts(model_dir: Path, prompts: list[tuple[list, Any]], max_len: int) -> list[list[int]]:
    from hearth.model.tokenizer import Tokenizer
    from hearth.server.chat_template import ChatTemplate

    tokenizer = Tokenizer.from_dir(model_dir)
    template = ChatTemplate.from_dir(model_dir)
    encoded = [
        tokenizer.encode(template.render(messages, tools=tools), add_special_tokens=False)
        for messages, tools in prompts
    ]
    return [ids for ids in encoded if len(ids) <= max_len]


def generate(model_dir: Path, prompts: list[list[int]], max_tokens: int, ignore_eos: bool) -> list[list[int]]:
    """The target's greedy answers, through Hearth (what serving will produce)."""
    from hearth import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory_gib=1.0)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    return [list(r.token_ids) for r in llm.generate(prompts, params)]


class TargetStreams:
    """The target's residual streams at aux layer ids (j: entering layer j; num_layers: after the last)."""

    def __init__(self, model_dir: Path, aux_layers: list[int]) -> None:
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        self.model.eval()
        self.aux_layers = aux_layers
        self._last: list[torch.Tensor] = []
        self.model.model.layers[-1].register_forward_hook(
            lambda _m, _i, out: self._last.append(out[0] if isinstance(out, tuple) else out)
        )

    @torch.no_grad()
    def __call__(self, token_ids: list[int]) -> torch.Tensor:
        self._last.clear()
        out = self.model.model(torch.tensor([token_ids]), output_hidden_states=True)
        streams = list(out.hidden_states[: len(self.model.model.layers)]) + [self._last[0]]
        return torch.cat([streams[j][0] for j in self.aux_layers], dim=-1)

    @property
    def embedding(self) -> torch.Tensor:
        return self.model.model.embed_tokens.weight.detach()


def head_config(target: dict[str, Any], args: argparse.Namespace, draft_vocab_size: int) -> dict[str, Any]:
    hidden = target["hidden_size"]
    heads = target["num_attention_heads"]
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": hidden,
        "target_hidden_size": hidden,
        "intermediate_size": args.intermediate_size or target["intermediate_size"],
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": target.get("num_key_value_heads") or heads,
        "head_dim": target.get("head_dim") or hidden // heads,
        "rms_norm_eps": target.get("rms_norm_eps", 1e-6),
        "rope_theta": (target.get("rope_parameters") or {}).get(
            "rope_theta", target.get("rope_theta", 10000.0)
        ),
        "max_position_embeddings": target.get("max_position_embeddings", 4096),
        "vocab_size": target["vocab_size"],
        "draft_vocab_size": draft_vocab_size,
        "tie_word_embeddings": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": args.aux_layers, "use_aux_hidden_state": True},
        "torch_dtype": "float32",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=REPO_ROOT / "models" / "demo")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "models" / "demo-eagle3")
    parser.add_argument(
        "--seed", type=int, default=7, help="conversation seed (not the target's 0, not eval's 4242)"
    )
    parser.add_argument("--conversations", type=int, default=160)
    parser.add_argument("--paraphrase-share", type=float, default=0.4)
    parser.add_argument("--random-prompts", type=int, default=0, help="N random-token prompts instead")
    parser.add_argument("--random-prompt-len", type=int, default=64)
    parser.add_argument("--max-prompt-len", type=int, default=700)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--aux-layers", type=int, nargs=3, default=None, help="default: 1, L//2+1, L")
    parser.add_argument("--draft-vocab-size", type=int, default=2048)
    parser.add_argument("--intermediate-size", type=int, default=0, help="0: the target's")
    parser.add_argument("--ttt-steps", type=int, default=4)
    parser.add_argument("--epochs", type=float, default=3.0)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--max-train-len", type=int, default=256, help="train on the last N tokens of each")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--data-cache", type=Path, default=None, help="keep/reuse the generations in this JSON"
    )
    parser.add_argument("--time-budget-min", type=float, default=20.0)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.time()
    target = json.loads((args.model / "config.json").read_text())
    num_layers = target["num_hidden_layers"]
    if args.aux_layers is None:  # low, middle, and the last layer's output (the strongest single feature)
        args.aux_layers = [1, num_layers // 2 + 1, num_layers]

    if args.random_prompts:
        rng = random.Random(args.seed)
        prompts = [
            [rng.randrange(3, target["vocab_size"]) for _ in range(args.random_prompt_len)]
            for _ in range(args.random_prompts)
        ]
        ignore_eos = True
    else:
        prompts = encode_prompts(
            args.model,
            agent_prompts(args.seed, args.conversations, args.paraphrase_share),
            args.max_prompt_len,
        )
        ignore_eos = False
    if args.data_cache is not None and args.data_cache.exists():
        cached = json.loads(args.data_cache.read_text())
        prompts, outputs = cached["prompts"], cached["outputs"]
        print(f"{len(prompts)} prompts and the target's answers from {args.data_cache}", flush=True)
    else:
        print(f"{len(prompts)} prompts; generating the target's answers", flush=True)
        outputs = generate(args.model, prompts, args.max_tokens, ignore_eos)
        if args.data_cache is not None:
            args.data_cache.write_text(json.dumps({"prompts": prompts, "outputs": outputs}))
    gen_s = time.time() - started
    counts = Counter(t for out in outputs for t in out)
    counts.update(t for p in prompts for t in p[-args.max_train_len :])
    vocab = sorted(t for t, _ in counts.most_common(args.draft_vocab_size))
    draft_to_target = torch.tensor(vocab, dtype=torch.long)
    target_to_draft = torch.full((target["vocab_size"],), -100, dtype=torch.long)
    target_to_draft[draft_to_target] = torch.arange(len(vocab))
    covered = sum(counts[t] for t in vocab) / max(1, sum(counts.values()))
    print(f"generated in {gen_s:.0f} s; draft vocab {len(vocab)} covers {covered:.4f} of tokens", flush=True)

    streams = TargetStreams(args.model, args.aux_layers)
    config = head_config(target, args, len(vocab))
    torch.manual_seed(args.seed)
    head = ReferenceEagle3Head(config, streams.embedding)
    with torch.no_grad():
        for param in head.parameters():
            if param.dim() >= 2:
                torch.nn.init.normal_(param, 0.0, 0.02)
        head.set_vocab(draft_to_target)
    optimizer = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.0)
    sequences = [(p, o) for p, o in zip(prompts, outputs, strict=True) if o]
    total_steps = int(args.epochs * len(sequences))
    order = list(range(len(sequences)))
    rng = random.Random(args.seed)
    step = 0
    losses: list[float] = []
    accuracy: list[list[float]] = [[] for _ in range(args.ttt_steps)]
    aux_cache: dict[int, torch.Tensor] = {}
    train_started = time.time()
    while step < total_steps:
        rng.shuffle(order)
        for index in order:
            if step >= total_steps or time.time() - train_started > args.time_budget_min * 60:
                total_steps = step
                break
            prompt, output = sequences[index]
            tokens = prompt + output
            keep = min(len(tokens), args.max_train_len)  # the tail: the answer and the prompt's end
            first = len(tokens) - keep
            token_ids = torch.tensor(tokens[first:])
            aux = aux_cache.get(index)
            if aux is None:  # the target's streams see the whole sequence; the head trains on its tail
                aux = aux_cache[index] = streams(tokens)[first:]
            # Cosine over whichever runs out first, the steps or the time budget; a short warm-up.
            progress = max(
                step / max(1, total_steps), (time.time() - train_started) / (args.time_budget_min * 60)
            )
            lr = args.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
            for group in optimizer.param_groups:
                group["lr"] = lr * min(1.0, (step + 1) / 10)
            answer_start = len(prompt) - first  # index in token_ids of the first answer token
            # Rows whose first guess (token p + 2) is an answer token; the chained steps run on these only.
            rows = torch.arange(max(0, answer_start - 2), len(token_ids) - 2)
            outs = head(token_ids, aux[:-1], args.ttt_steps, rows)
            loss = torch.zeros(())
            for s, out in enumerate(outs):
                if s == 0:
                    out = out[rows]
                labels_at = rows + 2 + s  # row p of step s predicts token p + 2 + s
                valid = labels_at < len(token_ids)
                labels = torch.full_like(rows, -100)
                labels[valid] = target_to_draft[token_ids[labels_at[valid]]]
                known = labels >= 0
                if known.any():
                    logits = head.logits(out[known])
                    labels = labels[known]
                    loss = loss + (0.8**s) * torch.nn.functional.cross_entropy(logits, labels)
                    accuracy[s].append(float((logits.argmax(-1) == labels).float().mean()))
            if not loss.requires_grad:  # no answer token inside the draft vocabulary
                continue
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            optimizer.step()
            losses.append(float(loss.detach()))
            step += 1
            if step % 50 == 0:
                recent = [sum(a[-50:]) / max(1, len(a[-50:])) for a in accuracy]
                print(
                    f"step {step}/{total_steps} loss {sum(losses[-50:]) / 50:.3f} answer-token accuracy per "
                    f"chained step {[round(a, 3) for a in recent]} ({time.time() - started:.0f} s)",
                    flush=True,
                )
    train_s = time.time() - train_started
    args.out.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    state = {k: v.detach().contiguous() for k, v in head.state_dict().items()}
    save_file(state, str(args.out / "model.safetensors"))
    (args.out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    recent = [round(sum(a[-200:]) / max(1, len(a[-200:])), 4) for a in accuracy]
    stats = {
        "target": str(args.model),
        "num_sequences": len(sequences),
        "num_prompts_paraphrased_share": args.paraphrase_share if not args.random_prompts else 0.0,
        "random_prompts": args.random_prompts,
        "draft_vocab_size": len(vocab),
        "draft_vocab_coverage": round(covered, 4),
        "aux_layers": args.aux_layers,
        "ttt_steps": args.ttt_steps,
        "train_steps": step,
        "final_loss_mean_last_50": round(sum(losses[-50:]) / max(1, len(losses[-50:])), 4),
        "answer_token_accuracy_per_chained_step_last_200": recent,
        "generate_s": round(gen_s, 1),
        "train_s": round(train_s, 1),
        "threads": args.threads,
        "command": "python " + " ".join(sys.argv),
    }
    (args.out / "training_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    print(json.dumps(stats, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
