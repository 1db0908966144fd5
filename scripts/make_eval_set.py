"""Write the demo model's held-out eval set for `hearth eval`: held-out synthetic conversations and
standard-library files (perplexity, agreement, KL) and held-out agent prompts with tools (tool-call validity),
the same held-out data `scripts/eval_demo_model.py` uses.

    python scripts/make_eval_set.py --out docs/bench/demo-eval-set.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import demo_data  # noqa: E402
from eval_demo_model import heldout_texts, tool_prompts  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--num-conversations", type=int, default=24)
    parser.add_argument("--stdlib-chars", type=int, default=12000)
    parser.add_argument("--num-prompts", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    seed = args.seed + demo_data.HELDOUT_SEED_OFFSET
    texts = heldout_texts(args.num_conversations, args.stdlib_chars, seed)
    prompts = [
        {"messages": p["messages"], "tools": p["tools"]} for p in tool_prompts(args.num_prompts, seed + 1)
    ]
    out = {"texts": texts["conversations"] + texts["stdlib"], "tool_prompts": prompts}
    Path(args.out).write_text(json.dumps(out) + "\n")
    print(f"{len(out['texts'])} texts, {len(prompts)} tool prompts -> {args.out}")


if __name__ == "__main__":
    main()
