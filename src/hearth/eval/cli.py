"""`hearth eval`: compare configurations of one model (weights and KV precision) with a reference one.

    hearth eval --model models/demo --eval-set docs/bench/demo-eval-set.json \\
        --config bf16:kv_cache_dtype=bfloat16 --config fp8kv:kv_cache_dtype=fp8_e4m3 \\
        --config int4:quantization=int4 --json out.json --markdown out.md

The first `--config` is the reference. Per configuration: perplexity on the eval set's held-out texts,
greedy agreement (share of positions whose most likely next token is the reference's), mean KL divergence
of the next-token distributions from the reference's, and tool-call validity of greedy answers to its tool
prompts (rendered with the model's chat template). The eval set is JSON: `{"texts": [str], "tool_prompts":
[{"messages": [...], "tools": [...]}]}` (`scripts/make_eval_set.py` writes the demo model's held-out one).

For lm-evaluation-harness tasks, serve the configuration (`hearth serve --model M --kv-cache-dtype fp8_e4m3`)
and point the harness at it as a `local-completions` model (docs/quantization.md has the command).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

DEFAULT_CONFIGS = ["bf16:kv_cache_dtype=bfloat16", "fp8kv:kv_cache_dtype=fp8_e4m3"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="checkpoint directory")
    parser.add_argument("--eval-set", required=True, help="JSON with texts and tool_prompts")
    parser.add_argument(
        "--config",
        action="append",
        default=None,
        help="NAME:option=value,... (LLM options, e.g. kv_cache_dtype=fp8_e4m3,quantization=int4; also "
        "model=PATH for another checkpoint of the model, int4_activations=float|int8, score_chunk=N); first is "
        f"the reference (default: {' '.join(DEFAULT_CONFIGS)})",
    )
    parser.add_argument("--max-text-tokens", type=int, default=512, help="tokens scored per text")
    parser.add_argument("--max-new-tokens", type=int, default=96, help="greedy tokens per tool prompt")
    parser.add_argument("--kv-cache-memory", type=float, default=0.25, help="GiB per configuration")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--markdown", default=None, help="write a Markdown table here")


def parse_config(spec: str) -> tuple[str, dict[str, Any]]:
    name, _, options = spec.partition(":")
    parsed: dict[str, Any] = {}
    for item in filter(None, options.split(",")):
        key, _, value = item.partition("=")
        parsed[key.strip()] = _value(value.strip())
    return name, parsed


def _value(text: str) -> Any:
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def tool_validity(llm: Any, prompts: list[dict[str, Any]], max_new_tokens: int) -> dict[str, Any]:
    from hearth.engine.sampling_params import SamplingParams
    from hearth.eval.tool_calls import tool_call_problem
    from hearth.server.chat_template import ChatTemplate

    template = ChatTemplate.from_dir(llm.engine.config.model)
    texts = [template.render(p["messages"], tools=p["tools"], add_generation_prompt=True) for p in prompts]
    ids = [llm.tokenizer.encode(t, add_special_tokens=False) for t in texts]
    results = llm.generate(
        ids, SamplingParams(max_tokens=max_new_tokens, temperature=0, skip_special_tokens=True)
    )
    problems = [tool_call_problem(r.text, p["tools"]) for r, p in zip(results, prompts)]
    valid = sum(problem is None for problem in problems)
    return {
        "num_prompts": len(prompts),
        "valid_tool_call_share": valid / max(1, len(prompts)),
        "answers": [r.token_ids for r in results],
    }


def build_llm(args: argparse.Namespace, options: dict[str, Any]) -> Any:
    """One configuration's engine. Three options are not engine settings: `model=PATH`, another checkpoint
    of the same model (an FP8 or GPTQ conversion; same tokenizer); `int4_activations=float|int8`, the INT4
    kernel's activation precision (`HEARTH_INT4_ACTIVATIONS`, read while the weights are built); and
    `score_chunk=N`, texts scored in prefill chunks of N tokens (<= 16: through the INT4 decode kernel)."""
    from hearth.engine.llm import LLM

    options = dict(options)
    options.pop("score_chunk", None)
    model = options.pop("model", args.model)
    activations = options.pop("int4_activations", None)
    previous = os.environ.get("HEARTH_INT4_ACTIVATIONS")
    if activations is not None:
        os.environ["HEARTH_INT4_ACTIVATIONS"] = str(activations)
    try:
        return LLM(model, enable_prefix_caching=False, kv_cache_memory_gib=args.kv_cache_memory, **options)
    finally:
        if previous is None:
            os.environ.pop("HEARTH_INT4_ACTIVATIONS", None)
        else:
            os.environ["HEARTH_INT4_ACTIVATIONS"] = previous


def run(args: argparse.Namespace) -> int:
    from hearth.eval.scoring import score_texts

    started = time.monotonic()
    eval_set = json.loads(Path(args.eval_set).read_text())
    configs = [parse_config(spec) for spec in (args.config or DEFAULT_CONFIGS)]
    llms = {name: build_llm(args, options) for name, options in configs}
    chunks = {name: options.get("score_chunk") for name, options in configs}
    reference = configs[0][0]
    tokenizer = llms[reference].tokenizer
    texts = [tokenizer.encode(t, add_special_tokens=False)[: args.max_text_tokens] for t in eval_set["texts"]]
    scores = score_texts(llms, reference, texts, chunks)
    results: dict[str, Any] = {"model": args.model, "reference": reference, "configs": {}}
    tool_prompts = eval_set.get("tool_prompts", [])
    ref_answers = None
    for name, options in configs:
        llm = llms[name]
        entry: dict[str, Any] = {
            "options": options,
            "kv_tokens": llm.engine.num_kv_tokens,
            **scores[name].as_dict(name == reference),
        }
        if tool_prompts:
            tools = tool_validity(llm, tool_prompts, args.max_new_tokens)
            answers = tools.pop("answers")
            if ref_answers is None:
                ref_answers = answers
            else:
                tools["same_answer_as_reference_share"] = sum(
                    a == b for a, b in zip(answers, ref_answers)
                ) / max(1, len(answers))
            entry["tool_calls"] = tools
        results["configs"][name] = entry
    ref = results["configs"][reference]
    for entry in results["configs"].values():
        entry["perplexity_change"] = entry["perplexity"] / ref["perplexity"] - 1
        entry["kv_tokens_ratio"] = entry["kv_tokens"] / ref["kv_tokens"]
    results["eval_time_s"] = time.monotonic() - started
    markdown = to_markdown(results)
    print(markdown)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(markdown + "\n")
    return 0


def to_markdown(results: dict[str, Any]) -> str:
    lines = [
        f"`hearth eval` on {results['model']} (reference: {results['reference']})",
        "",
        "| config | options | KV tokens (x ref) | perplexity (change) | greedy agreement | mean KL (nats) | tool-call validity |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, e in results["configs"].items():
        options = ", ".join(f"{k}={v}" for k, v in e["options"].items()) or "-"
        agreement = f"{e['greedy_agreement']:.2%}" if "greedy_agreement" in e else "-"
        kl = f"{e['mean_kl_nats']:.5f}" if "mean_kl_nats" in e else "-"
        tools = f"{e['tool_calls']['valid_tool_call_share']:.1%}" if "tool_calls" in e else "-"
        lines.append(
            f"| {name} | {options} | {e['kv_tokens']} ({e['kv_tokens_ratio']:.2f}x) | "
            f"{e['perplexity']:.4f} ({e['perplexity_change']:+.2%}) | {agreement} | {kl} | {tools} |"
        )
    return "\n".join(lines)
