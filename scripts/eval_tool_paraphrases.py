"""Tool-call validity of a model on hand-written requests that neither the demo data generator
(`demo_data.py` templates) nor `train_eagle3.py`'s paraphrase transforms produce (issue 16 item 5).

Validity (a well-formed `<tool_call>` naming an offered tool, arguments that fit its schema) is a property
of the target model: a draft head only changes how fast the same tokens come out.

    python scripts/eval_tool_paraphrases.py --model models/demo
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "scripts"))

# (request, offered tools, the tool that fits); written by hand, in forms the generator has no template for.
REQUESTS: list[tuple[str, list[str], str]] = [
    ("umbrella or not in Oslo??", ["get_weather", "search_web"], "get_weather"),
    ("Need the 5 day outlook for Lisbon", ["get_forecast", "get_time"], "get_forecast"),
    ("what time is it over in Asia/Tokyo", ["get_time", "get_weather"], "get_time"),
    (
        "ping bob@example.com that the deploy is done, subject 'deploy'",
        ["send_email", "add_todo"],
        "send_email",
    ),
    ("15 min timer for the pasta", ["set_timer", "set_reminder"], "set_timer"),
    ("how many yen is 250 USD right now", ["convert_currency", "get_stock_price"], "convert_currency"),
    ("AAPL quote pls", ["get_stock_price", "get_news"], "get_stock_price"),
    ("show me whats in /var/log", ["list_directory", "read_file"], "list_directory"),
    ("I wonder what 17 times 23 is", ["calculate", "define_word"], "calculate"),
    ("put 'buy milk' on my list, high priority", ["add_todo", "list_todos"], "add_todo"),
    (
        "Could I get the Wikipedia blurb on Alan Turing",
        ["get_wikipedia_summary", "search_web"],
        "get_wikipedia_summary",
    ),
    ("dim the kitchen lights to 30%", ["set_lights", "set_thermostat"], "set_lights"),
    ("where's my order #A1234", ["check_order_status", "order_product"], "check_order_status"),
    ("TRANSLATE 'good morning' INTO GERMAN", ["translate_text", "define_word"], "translate_text"),
    ("any news about electric cars today?", ["get_news", "search_web"], "get_news"),
    ("run `ls -la` in the shell for me", ["run_shell_command", "read_file"], "run_shell_command"),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=REPO_ROOT / "models" / "demo")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--output-json", type=Path, default=None)
    args = parser.parse_args(argv)

    import demo_data
    from eval_demo_model import check_tool_calls

    from hearth import LLM, SamplingParams
    from hearth.server.chat_template import ChatTemplate

    schemas = {t.name: t.schema() for t in demo_data.TOOLS}
    template = ChatTemplate.from_dir(args.model)
    llm = LLM(str(args.model), dtype="float32")
    tokenizer = llm.tokenizer
    prompts = [
        tokenizer.encode(
            template.render([{"role": "user", "content": text}], tools=[schemas[n] for n in offered]),
            add_special_tokens=False,
        )
        for text, offered, _ in REQUESTS
    ]
    results = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens))
    rows = []
    for (text, offered, expected), result in zip(REQUESTS, results, strict=True):
        check = check_tool_calls(result.text, [schemas[n] for n in offered])
        rows.append(
            {"request": text, "valid": check.valid, "right_tool": check.valid and expected in check.names,
             "reason": check.reason, "output": result.text[:200]}
        )  # fmt: skip
    summary = {
        "model": str(args.model),
        "num_requests": len(rows),
        "valid": sum(r["valid"] for r in rows),
        "valid_and_right_tool": sum(r["right_tool"] for r in rows),
        "requests": rows,
    }
    for row in rows:
        print(f"{'ok ' if row['valid'] else 'BAD'} {row['request']!r}: {row['reason']}")
    print(f"valid {summary['valid']}/{len(rows)}, right tool {summary['valid_and_right_tool']}/{len(rows)}")
    if args.output_json:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
