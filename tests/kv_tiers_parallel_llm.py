"""Run by tests/test_kv_tiers_parallel.py in a process of its own (rank 0 of a parallel engine lives in
the process that builds it): KV tiers under a parallel layout, one JSON line per scenario.

    python tests/kv_tiers_parallel_llm.py MODEL_DIR SCENARIO LAYOUT_JSON [REDIS_URL|-] [DISK_DIR [DROP_DIR]]

Scenarios (each prints the tokens and cached tokens of every generation):
- host: a device pool of 12 pages; prompt A, prompt B (pushes A's pages out into host RAM), A again.
- restart: two engines in turn on the same tiers (disk or Redis); the second one starts with an empty
  device cache, so A's pages can only come from the tier. DROP_DIR (one rank's disk directory) is
  deleted between the two: that rank's shard is gone, so nothing may load on any rank.
"""

from __future__ import annotations

import json
import random
import shutil
import sys

import torch

from hearth.engine.config import EngineConfig
from hearth.engine.llm import LLM
from hearth.engine.sampling_params import SamplingParams
from hearth.engine.worker import kv_layout_for
from hearth.model.config import ModelConfig

GREEDY = SamplingParams(max_tokens=6, temperature=0)
PAGE = 16


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 250) for _ in range(length)]


def build(model: str, num_pages: int, layout: dict, **options) -> LLM:
    common = {"device": "cpu", "num_threads": 1, "page_size": PAGE, "dtype": "float32", **layout, **options}
    kv_layout = kv_layout_for(EngineConfig(model=model, **common), ModelConfig.from_dir(model), torch.float32)
    return LLM(model, kv_cache_memory_gib=num_pages * kv_layout.bytes_per_page / (1 << 30), **common)


def close(llm: LLM) -> None:
    llm.engine.close()  # hands the last write-backs to the ranks
    shutdown = getattr(llm.engine.worker, "shutdown", None)
    if shutdown is not None:
        shutdown()  # every rank closes its tiers (queued writes finish) and exits


def run(llm: LLM, tokens: list[int]) -> dict:
    result = llm.generate([tokens], GREEDY)[0]
    return {"tokens": result.token_ids, "cached": result.cached_tokens}


def main() -> None:
    model, scenario, layout = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    a, b = prompt(1, 100), prompt(2, 180)
    runs: list[dict] = []
    if scenario == "host":
        llm = build(model, 12, layout, kv_offload_memory_gib=0.01)
        runs = [run(llm, a), run(llm, b), run(llm, a)]
        close(llm)
    elif scenario == "restart":
        tiers = {}
        if sys.argv[4] != "-":
            tiers["kv_store"] = sys.argv[4]
        if len(sys.argv) > 5:
            tiers.update(kv_disk_dir=sys.argv[5], kv_disk_size_gib=0.01)
        for index in range(2):
            llm = build(model, 32, layout, **tiers)
            runs.append(run(llm, a))
            close(llm)
            if index == 0 and len(sys.argv) > 6:
                shutil.rmtree(sys.argv[6])
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    print(json.dumps({"scenario": scenario, "layout": layout, "runs": runs}), flush=True)


if __name__ == "__main__":
    main()
