"""The agentic workload through `hearth launch --prefill 1 --decode 1` vs `hearth launch --mixed 2`.

    python scripts/bench_pd_agentic.py [--rounds 2] [--num-sessions 8] [--turns 4] [--model DIR]

Both deployments run at once on this machine (two servers each, each behind its own router), and
`hearth bench serve --workload agentic` (multi-turn sessions, a shared system prompt and tools, tool
results appended each turn) runs against them in alternating order, A B B A ..., so a noisy machine hits
both alike (after one small uncounted warm-up run on each). The same seed gives both the same sessions. Prints one JSON line per run and a summary with
the PD/mixed ratio of each headline metric's median over rounds (throughput: higher is better; latency:
lower is better). `--model` defaults to the bundled demo model (its tokenizer makes real chat prompts).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pd_ttft import Deployment  # noqa: E402

METRICS = (
    "request_throughput",
    "output_throughput",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "median_itl_ms",
    "median_e2el_ms",
)


def run_bench(args: argparse.Namespace, url: str, model: str, label: str, out: Path) -> dict:
    command = [sys.executable, "-m", "hearth.cli", "bench", "serve", "--base-url", url, "--model", "demo"]
    command += ["--tokenizer", model, "--workload", "agentic", "--seed", str(args.seed)]
    command += ["--num-sessions", str(args.num_sessions), "--turns", str(args.turns)]
    command += ["--max-concurrency", str(args.max_concurrency), "--think-time-s", str(args.think_time_s)]
    command += [
        "--system-prompt-len",
        str(args.system_prompt_len),
        "--agentic-output-len",
        str(args.output_len),
    ]
    command += ["--result-dir", str(out), "--label", label, "--no-plots", "--no-progress", "--ignore-eos"]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / f"{label}.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=str(Path(__file__).resolve().parent.parent / "models" / "demo"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-concurrency", type=int, default=4)
    parser.add_argument("--think-time-s", type=float, default=0.2)
    parser.add_argument("--system-prompt-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=18620, help="mixed router; PD's is the next port")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_pd_agentic_"))
    os.environ.setdefault("HEARTH_KV_TRANSFER_SECRET", "bench-" + os.urandom(8).hex())
    server_args = "--max-model-len 4096 --kv-cache-memory 0.25 --page-size 16"
    deployments = {
        "mixed": Deployment("mixed2", args.model, ["--mixed", "2"], args.port, work, server_args),
        "pd": Deployment(
            "p1d1", args.model, ["--prefill", "1", "--decode", "1"], args.port + 1, work, server_args
        ),
    }
    results: dict[str, list[dict]] = {"mixed": [], "pd": []}
    try:
        urls = {name: deployment.wait()["router"] for name, deployment in deployments.items()}
        warmup = argparse.Namespace(**{**vars(args), "num_sessions": 2, "turns": 1})
        for name, url in urls.items():  # first requests pay one-off costs (allocations, kernels): not counted
            run_bench(warmup, url, args.model, f"{name}-warmup", work)
        for round_index in range(args.rounds):
            order = ("mixed", "pd") if round_index % 2 == 0 else ("pd", "mixed")
            for name in order:
                started = time.monotonic()
                run = run_bench(args, urls[name], args.model, f"{name}-{round_index}", work)
                picked = {key: round(float(run[key]), 2) for key in METRICS if key in run}
                picked.update(
                    deployment=name,
                    round=round_index,
                    completed=run.get("completed"),
                    failed=run.get("failed"),
                    wall_s=round(time.monotonic() - started, 1),
                    loadavg_1m=round(os.getloadavg()[0], 1),
                )
                results[name].append(picked)
                print(json.dumps(picked), flush=True)
    finally:
        for deployment in deployments.values():
            deployment.stop()
    summary: dict[str, object] = {"rounds": args.rounds, "logs": str(work)}
    for key in METRICS:
        values = {name: [run[key] for run in runs if key in run] for name, runs in results.items()}
        if all(values.values()):
            mixed, pd = statistics.median(values["mixed"]), statistics.median(values["pd"])
            summary[key] = {
                "mixed": mixed,
                "pd": pd,
                "pd_over_mixed": round(pd / mixed, 3) if mixed else None,
            }
    print(json.dumps({"summary": summary}), flush=True)


if __name__ == "__main__":
    main()
