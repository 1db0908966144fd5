"""Per-rank memory and communication of tensor vs pipeline parallelism (docs/benchmarks.md, "Parallelism").

    PYTHONPATH=src:tests python scripts/measure_parallel.py [--model DIR] [--layouts tp1 tp2 pp2]

Each layout runs in a process of its own (rank 0 there; the others are its rank processes, which log
a `rank report` line when they stop). Per rank: weight bytes held, peak RSS, and the bytes it sent per
decoded token at batch 1 and 64 (counters in hearth.parallel.state.COMM_BYTES; a decode token's
bytes = (bytes after prefill + 32 decode steps - bytes after prefill alone) / (32 x batch)).
Without --model a random Llama-shaped checkpoint (hidden 1024, 8 layers, vocab 32000) is written.

    PYTHONPATH=src:tests python scripts/measure_parallel.py --overlap [--rounds 2]

Issue 17's timing goals, A/B interleaved (each variant in a process of its own, variants in turn, `--rounds`
times), with the load average at each run:
- pipeline micro-batches: PP=2 at batch 64, decode tokens/s with `pipeline_micro_batches` 1 (stages in turn)
  vs 4, and each stage's idle time from the counters (`PIPELINE_TIME_S`: a stage blocked receiving its
  input; rank 0 waiting for the sampled tokens);
- the step channel: TP=2 at batch 1, decode step time with the StepInput over gloo vs ZeroMQ
  (`HEARTH_STEP_CHANNEL`), and rank 0's time publishing it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

LAYOUTS = {
    "tp1": {},
    "tp2": {"tensor_parallel_size": 2},
    "pp2": {"pipeline_parallel_size": 2},
    "tp2pp2": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2},
}
DECODE_STEPS = 32

CHILD = r"""
import json, logging, resource, sys
logging.basicConfig(level=logging.INFO)  # the rank processes inherit the level: their reports are INFO
import torch, hearth.engine.llm
baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
from hearth.parallel.state import COMM_BYTES
from hearth.engine.llm import LLM
from hearth.engine.sampling_params import SamplingParams
model, layout, steps = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
llm = LLM(model, kv_cache_memory_gib=0.25, max_num_seqs=64, **layout)
worker = llm.engine.worker
result = {"weight_bytes": sum(p.numel() * p.element_size() for p in llm.engine.model.parameters()),
          "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
          "baseline_rss_bytes": baseline}
for batch in (1, 64):
    prompts = [[(7 * i + j) % 500 + 1 for j in range(8)] for i in range(batch)]
    def sent(max_tokens):
        before = dict(COMM_BYTES)
        llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        return {k: v - before.get(k, 0) for k, v in COMM_BYTES.items()}
    prefill, full = sent(1), sent(1 + steps)
    result[f"rank0_bytes_per_token_b{batch}"] = {
        k: (full.get(k, 0) - prefill.get(k, 0)) / (steps * batch) for k in full}
print("RESULT " + json.dumps(result), flush=True)
if hasattr(worker, "shutdown"):
    worker.shutdown()
"""


OVERLAP_CHILD = r"""
import json, logging, os, sys, time
logging.basicConfig(level=logging.INFO)
from hearth.parallel.state import PIPELINE_TIME_S
from hearth.engine.llm import LLM
from hearth.engine.sampling_params import SamplingParams
model, layout, batch, steps = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
llm = LLM(model, kv_cache_memory_gib=0.25, max_num_seqs=64, **layout)
prompts = [[(7 * i + j) % 500 + 1 for j in range(8)] for i in range(batch)]
def run(max_tokens):
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return time.perf_counter() - start
run(4)  # warm-up
PIPELINE_TIME_S.clear()
prefill_s = run(1)
before = dict(PIPELINE_TIME_S)
full_s = run(1 + steps)
decode_s = full_s - prefill_s
# Decode only: (prefill + the full run) - 2 x prefill.
counters = {k: v - 2 * before.get(k, 0) for k, v in PIPELINE_TIME_S.items()}
print("RESULT " + json.dumps({"decode_tok_s": batch * steps / decode_s, "decode_step_ms": decode_s / steps * 1e3,
      "rank0_counters_s": counters, "load": os.getloadavg()[0]}), flush=True)
worker = llm.engine.worker
if hasattr(worker, "shutdown"):
    worker.shutdown()
"""

VARIANTS = {  # name: (layout, batch, environment)
    "pp2_mb1": ({"pipeline_parallel_size": 2, "pipeline_micro_batches": 1}, 64, {}),
    "pp2_mb4": ({"pipeline_parallel_size": 2, "pipeline_micro_batches": 4}, 64, {}),
    "tp2_gloo": ({"tensor_parallel_size": 2}, 1, {"HEARTH_STEP_CHANNEL": "gloo"}),
    "tp2_zmq": ({"tensor_parallel_size": 2}, 1, {"HEARTH_STEP_CHANNEL": "zmq"}),
}


def run_overlap(model: Path, name: str, steps: int) -> dict:
    layout, batch, extra_env = VARIANTS[name]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), **extra_env)
    done = subprocess.run(
        [sys.executable, "-c", OVERLAP_CHILD, str(model), json.dumps(layout), str(batch), str(steps)],
        capture_output=True,
        text=True,
        env=env,
    )
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    # Other ranks' counters cover the whole run (warm-up and prefill included): their shares, not seconds.
    result["other_ranks"] = [
        {"rank": r["rank"], "pipeline_time_s": r.get("pipeline_time_s", {})}
        for r in (json.loads(m) for m in re.findall(r"rank report (\{.*\})", done.stderr))
    ]
    return result


def make_model(path: Path) -> Path:
    from tiny_models import make_tiny_model

    return make_tiny_model(
        path,
        "llama",
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=8,
        vocab_size=32000,
    )


def run(model: Path, layout: dict) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(model), json.dumps(layout), str(DECODE_STEPS)],
        capture_output=True,
        text=True,
        env=env,
    )
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    result["other_ranks"] = [json.loads(m) for m in re.findall(r"rank report (\{.*\})", done.stderr)]
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--layouts", nargs="+", default=["tp1", "tp2", "pp2"], choices=list(LAYOUTS))
    parser.add_argument("--overlap", action="store_true", help="the timing A/B runs (see above)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or make_model(Path(tmp) / "model")
        if args.overlap:
            for round_index in range(args.rounds):
                for name in args.variants:
                    result = run_overlap(model, name, args.steps)
                    print(json.dumps({"round": round_index, "variant": name, **result}), flush=True)
            return
        for name in args.layouts:
            result = run(model, LAYOUTS[name])
            print(json.dumps({"layout": name, **result}), flush=True)


if __name__ == "__main__":
    main()
