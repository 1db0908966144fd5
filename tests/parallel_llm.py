"""Run by tests/test_distributed.py in a process of its own (a rank failure ends the process that
holds rank 0, by design): generates greedily under each parallel layout given, one JSON line each.

    python tests/parallel_llm.py MODEL_DIR '[{"tensor_parallel_size": 2}, ...]' [--forever] [--prompts JSON]

With `--forever` it prints the other ranks' pids (`{"pids": {...}}`) and generates until killed.
"""

from __future__ import annotations

import json
import sys

from hearth.engine.llm import LLM
from hearth.engine.sampling_params import SamplingParams

PROMPTS = [[1, 5, 9, 33, 100, 7], [3, 4, 200, 11], list(range(40, 90))]


def main() -> None:
    model, layouts = sys.argv[1], json.loads(sys.argv[2])
    forever = "--forever" in sys.argv
    prompts = json.loads(sys.argv[sys.argv.index("--prompts") + 1]) if "--prompts" in sys.argv else PROMPTS
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for layout in layouts:
        # Every layout on CPU (gloo): the one-rank reference too, so all compare like with like.
        llm = LLM(model, kv_cache_memory_gib=0.02, device="cpu", **layout)
        worker = llm.engine.worker
        if forever:
            print(json.dumps({"pids": worker.child_pids}), flush=True)
            while True:
                llm.generate(prompts, params)
        results = llm.generate(prompts, params)
        tag = llm.engine._kv_layout_tag
        drafted = llm.engine.stats().spec_draft_tokens_total
        line = {"layout": layout, "tokens": [r.token_ids for r in results], "kv_tag": tag, "drafted": drafted}
        print(json.dumps(line), flush=True)
        shutdown = getattr(worker, "shutdown", None)
        if shutdown is not None:
            shutdown()


if __name__ == "__main__":
    main()
