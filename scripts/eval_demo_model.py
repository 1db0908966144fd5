"""Measure the demo models' quality with plain `transformers`.

- held-out perplexity of the target and the draft, on held-out synthetic conversations and on held-out
  standard-library files;
- tool-call validity: over held-out agent prompts with tools, the share where the target's greedy
  answer is a well-formed `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` naming an offered
  tool, with arguments that fit that tool's JSON schema (no extra keys);
- the draft's greedy next-token agreement with the target on the same held-out text (teacher forced).

    python scripts/eval_demo_model.py --json docs/bench/demo-model.json --write-cards
    python scripts/eval_demo_model.py --num-prompts 3 --num-ppl-conversations 4 --stdlib-chars 3000
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import demo_data  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def load(model_dir: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    return model, tokenizer


@dataclass
class CallCheck:
    """Why one generated answer does or does not count as a valid tool call."""

    valid: bool
    reason: str
    names: list[str] = field(default_factory=list)
    arguments: list[Any] = field(default_factory=list)


def check_tool_calls(text: str, tools: list[dict[str, Any]]) -> CallCheck:
    """Valid when the answer holds at least one call and every call is well formed and fits its schema."""
    import jsonschema

    bodies = TOOL_CALL_RE.findall(text)
    if not bodies:
        return CallCheck(False, "no <tool_call>...</tool_call>")
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    names, arguments = [], []
    for body in bodies:
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            return CallCheck(False, "call is not JSON", names, arguments)
        if not isinstance(call, dict) or set(call) != {"name", "arguments"}:
            return CallCheck(False, "call needs exactly name and arguments", names, arguments)
        names.append(call["name"])
        arguments.append(call["arguments"])
        if call["name"] not in schemas:
            return CallCheck(False, "names a tool that was not offered", names, arguments)
        if not isinstance(call["arguments"], dict):
            return CallCheck(False, "arguments are not a JSON object", names, arguments)
        strict = {**schemas[call["name"]], "additionalProperties": False}
        try:
            jsonschema.validate(call["arguments"], strict)
        except jsonschema.ValidationError as err:
            return CallCheck(False, f"arguments do not fit the schema: {err.message}", names, arguments)
    return CallCheck(True, "ok", names, arguments)


def tool_prompts(num_prompts: int, seed: int) -> list[dict[str, Any]]:
    """Held-out prompts that end right before an assistant turn that must be a tool call."""
    prompts: list[dict[str, Any]] = []
    for conv in demo_data.conversations(seed, 4 * num_prompts + 50):
        for index in conv.call_indices[:1]:  # one prompt per conversation: more variety
            expected = conv.messages[index]["tool_calls"]
            prompts.append({"messages": conv.messages[:index], "tools": conv.tools, "expected": expected})
        if len(prompts) == num_prompts:
            break
    return prompts


@torch.no_grad()
def eval_tool_calls(
    model: Any, tokenizer: Any, prompts: list[dict[str, Any]], max_new_tokens: int
) -> dict[str, Any]:
    eos_id = tokenizer.convert_tokens_to_ids(demo_data.EOS_TOKEN)
    num_valid = num_right_tool = num_exact = 0
    failures: list[dict[str, str]] = []
    for prompt in prompts:
        text = tokenizer.apply_chat_template(
            prompt["messages"], tools=prompt["tools"], add_generation_prompt=True, tokenize=False
        )
        input_ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        output = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        answer = tokenizer.decode(output[0, input_ids.shape[1] :], skip_special_tokens=True)
        check = check_tool_calls(answer, prompt["tools"])
        expected_names = [c["function"]["name"] for c in prompt["expected"]]
        expected_args = [c["function"]["arguments"] for c in prompt["expected"]]
        num_valid += check.valid
        num_right_tool += check.valid and check.names == expected_names
        num_exact += check.valid and check.names == expected_names and check.arguments == expected_args
        if not check.valid and len(failures) < 10:
            failures.append({"reason": check.reason, "answer": answer[:300]})
    count = max(1, len(prompts))
    return {
        "num_prompts": len(prompts),
        "valid_tool_call_share": num_valid / count,
        "expected_tools_share": num_right_tool / count,
        "exact_arguments_share": num_exact / count,
        "failures": failures,
    }


@torch.no_grad()
def eval_decode_speed(
    models: dict[str, Any], tokenizer: Any, prompts: list[dict[str, Any]], new_tokens: int
) -> dict:
    """Greedy decode speed of each model in plain transformers on the same prompts (CPU).

    One warm-up run per model, then the models alternate prompt by prompt, so load spikes on a shared
    machine hit both sides alike.
    """

    def generate(model: Any, input_ids: torch.Tensor) -> float:
        start_s = time.perf_counter()
        model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            min_new_tokens=new_tokens,
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
        return time.perf_counter() - start_s

    encoded = []
    for prompt in prompts:
        text = tokenizer.apply_chat_template(
            prompt["messages"], tools=prompt["tools"], add_generation_prompt=True, tokenize=False
        )
        encoded.append(torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]]))
    elapsed_s = dict.fromkeys(models, 0.0)
    for model in models.values():
        generate(model, encoded[0])
    for input_ids in encoded:
        for name, model in models.items():
            elapsed_s[name] += generate(model, input_ids)
    speeds = {f"{name}_tokens_per_s": new_tokens * len(encoded) / elapsed_s[name] for name in models}
    speeds["draft_over_target_speed"] = speeds["draft_tokens_per_s"] / speeds["target_tokens_per_s"]
    return speeds


def heldout_texts(num_conversations: int, stdlib_chars: int, seed: int) -> dict[str, list[str]]:
    convs = demo_data.conversations(seed, num_conversations)
    return {
        "conversations": [demo_data.render_conversation(c) + demo_data.PAD_TOKEN for c in convs],
        "stdlib": [
            t + demo_data.PAD_TOKEN for t in demo_data.stdlib_documents("heldout", stdlib_chars, seed)
        ],
    }


@torch.no_grad()
def eval_text(target: Any, draft: Any, tokenizer: Any, texts: list[str], max_tokens: int) -> dict[str, float]:
    """Token-weighted perplexity of both models and the draft's argmax agreement with the target."""
    nll = {"target": 0.0, "draft": 0.0}
    num_tokens = num_agree = 0
    for text in texts:
        ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens]])
        if ids.shape[1] < 2:
            continue
        labels = ids[0, 1:]
        logits_target = target(input_ids=ids).logits[0, :-1].float()
        logits_draft = draft(input_ids=ids).logits[0, :-1].float()
        nll["target"] += torch.nn.functional.cross_entropy(logits_target, labels, reduction="sum").item()
        nll["draft"] += torch.nn.functional.cross_entropy(logits_draft, labels, reduction="sum").item()
        num_agree += int((logits_target.argmax(-1) == logits_draft.argmax(-1)).sum())
        num_tokens += labels.numel()
    count = max(1, num_tokens)
    return {
        "num_tokens": num_tokens,
        "target_loss": nll["target"] / count,
        "target_ppl": float(torch.exp(torch.tensor(nll["target"] / count))),
        "draft_loss": nll["draft"] / count,
        "draft_ppl": float(torch.exp(torch.tensor(nll["draft"] / count))),
        "draft_agreement": num_agree / count,
    }


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    started_s = time.monotonic()
    target, tokenizer = load(args.target)
    draft, _ = load(args.draft)
    seed = args.seed + demo_data.HELDOUT_SEED_OFFSET
    results: dict[str, Any] = {"seed": seed}
    texts = heldout_texts(args.num_ppl_conversations, args.stdlib_chars, seed)
    for source, items in texts.items():
        results[source] = eval_text(target, draft, tokenizer, items, args.max_ppl_tokens)
    total = sum(results[s]["num_tokens"] for s in texts)
    results["all_text"] = {
        "num_tokens": total,
        "draft_agreement": sum(results[s]["draft_agreement"] * results[s]["num_tokens"] for s in texts)
        / max(1, total),
    }
    prompts = tool_prompts(args.num_prompts, seed + 1)
    results["tool_calls"] = eval_tool_calls(target, tokenizer, prompts, args.max_new_tokens)
    if args.speed_prompts:
        models = {"target": target, "draft": draft}
        results["decode_speed"] = eval_decode_speed(models, tokenizer, prompts[: args.speed_prompts], 32)
    results["eval_time_s"] = time.monotonic() - started_s
    return results


def _stats(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "training_stats.json"
    return json.loads(path.read_text()) if path.exists() else {}


def write_cards(results: dict[str, Any], target_dir: Path, draft_dir: Path, eval_command: str) -> None:
    """Write models/demo/README.md and models/demo-draft/README.md from training stats and `results`."""
    train_command = "python scripts/train_demo_model.py --out-dir models"
    conv, lib, calls = results["conversations"], results["stdlib"], results["tool_calls"]
    for model_dir, role in ((target_dir, "target"), (draft_dir, "draft")):
        stats = _stats(model_dir)
        size_mb = (model_dir / "model.safetensors").stat().st_size / 1e6
        shape = stats.get("shape", {})
        data = stats.get("data", {})
        lines = [
            f"# Hearth demo {'model' if role == 'target' else 'draft model'}",
            "",
            (
                "A small Qwen3-architecture model trained from scratch by Hearth, so that `hearth serve` works with "
                "no download and later work has a real (trained) model to measure."
                if role == "target"
                else "The speculative-decoding draft for `models/demo`: same tokenizer, much smaller."
            ),
            "It knows the chat format and tool calling; it knows little else. Do not use it for anything real.",
            "",
            "## Size",
            f"- {stats.get('num_params', 0) / 1e6:.2f}M parameters, {size_mb:.1f} MB of bf16 safetensors",
            f"- hidden {shape.get('hidden_size')}, {shape.get('num_hidden_layers')} layers, "
            f"{shape.get('num_attention_heads')} query / {shape.get('num_key_value_heads')} KV heads, "
            f"MLP {shape.get('intermediate_size')}, vocab {data.get('vocab_size')}, untied embeddings, "
            "max_position_embeddings 4096",
            "",
            "## Format",
            "- ChatML: eos `<|im_end|>`, pad `<|endoftext|>`, no BOS. The chat template (plain jinja2 plus "
            "`tojson`) follows the Hermes/Qwen convention: tools as JSON lines inside `<tools></tools>` in the "
            'system turn, calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, tool results as a '
            "user turn wrapped in `<tool_response></tool_response>`.",
            "- Trained on sequences of at most 768 tokens; longer prompts work mechanically but are unseen.",
            "",
            "## Data",
            f"- {data.get('num_conversations')} synthetic agent conversations ({data.get('conversation_tokens')} tokens) "
            "from `scripts/demo_data.py`: system prompt, 1-4 of 40 tools with typed JSON-schema parameters, 1-4 user "
            "requests, `<tool_call>` answers (single, parallel and multi-turn), tool results, final answers, "
            "small talk; rendered with the chat template shipped here.",
            f"- {data.get('num_stdlib_documents')} chunks of the Python {stats.get('python', '')} standard library's "
            f"source and docstrings ({data.get('stdlib_tokens')} tokens); 1 in 20 files held out by path hash.",
            "- The tokenizer (byte-level BPE, ChatML specials `<|endoftext|>` `<|im_start|>` `<|im_end|>`, plus "
            "whole-token `<tool_call>` `</tool_call>` `<tool_response>` `</tool_response>`) is trained on the same text.",
            "",
            "## Training",
            f"- {stats.get('steps')} steps of batch {stats.get('batch_size')} (≤768 tokens each), "
            f"{stats.get('train_tokens')} tokens seen, AdamW, peak lr {stats.get('peak_lr')}, cosine schedule, "
            f"assistant-turn tokens weigh {stats.get('assistant_weight')}x in the loss, seed {stats.get('seed', 0)}",
            f"- {stats.get('train_time_s', 0) / 60:.1f} min on a shared 2-core CPU (torch {stats.get('torch', '')}, "
            f"{stats.get('threads')} thread; target and draft trained side by side)",
            f"- Reproduce (both models, same tokenizer): `{train_command}`",
            "",
            "## Quality (held-out, plain transformers)",
            f"Measured by `{eval_command}`:",
            "",
            "| metric | value |",
            "|---|---|",
            f"| held-out loss / perplexity, conversations ({conv['num_tokens']} tokens) | "
            f"{conv[role + '_loss']:.3f} / {conv[role + '_ppl']:.2f} |",
            f"| held-out loss / perplexity, stdlib files ({lib['num_tokens']} tokens) | "
            f"{lib[role + '_loss']:.3f} / {lib[role + '_ppl']:.2f} |",
        ]
        if role == "target":
            lines += [
                f"| valid tool calls over {calls['num_prompts']} held-out agent prompts with tools (well formed, "
                f"offered tool, arguments fit the schema) | {100 * calls['valid_tool_call_share']:.0f}% |",
                f"| ... that also call the expected tool(s) | {100 * calls['expected_tools_share']:.0f}% |",
                f"| ... with exactly the expected arguments | {100 * calls['exact_arguments_share']:.0f}% |",
            ]
        else:
            lines += [
                f"| greedy next-token agreement with `models/demo`, conversations | "
                f"{100 * conv['draft_agreement']:.1f}% |",
                f"| greedy next-token agreement with `models/demo`, stdlib files | "
                f"{100 * lib['draft_agreement']:.1f}% |",
                f"| greedy next-token agreement with `models/demo`, all held-out text | "
                f"{100 * results['all_text']['draft_agreement']:.1f}% |",
            ]
        lines += [
            "",
            "Held-out conversations come from a different seed stream than the training ones (same tool catalogue "
            "and phrasing templates, new combinations, values, wrappers and system prompts).",
            "",
        ]
        (model_dir / "README.md").write_text("\n".join(lines))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", type=Path, default=REPO_ROOT / "models" / "demo")
    parser.add_argument("--draft", type=Path, default=REPO_ROOT / "models" / "demo-draft")
    parser.add_argument(
        "--seed", type=int, default=0, help="the training seed; held-out data uses other seeds"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--num-ppl-conversations", type=int, default=150)
    parser.add_argument("--stdlib-chars", type=int, default=120_000)
    parser.add_argument("--max-ppl-tokens", type=int, default=768)
    parser.add_argument("--speed-prompts", type=int, default=0, help="also time greedy decoding on N prompts")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--write-cards", action="store_true", help="rewrite the two models' README.md")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = evaluate(args)
    text = json.dumps(results, indent=2, ensure_ascii=False)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    if args.write_cards:
        command = "python scripts/eval_demo_model.py " + " ".join(argv if argv is not None else sys.argv[1:])
        write_cards(results, args.target, args.draft, command.strip())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
