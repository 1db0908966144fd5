"""`hearth bench serve`: load-test any OpenAI-compatible endpoint (Hearth, vLLM, SGLang).

Stays free of torch/transformers so it starts fast and leaves the CPUs to the server under test.
Writes `<label>.json` per load point (vLLM bench field names), `<label>.md`, and PNG plots.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from hearth.bench.client import CHAT, COMPLETIONS, ENDPOINT_PATHS, ClientOptions
from hearth.bench.metrics import parse_slos, summarize
from hearth.bench.report import document_markdown, run_markdown, sweep_markdown
from hearth.bench.runner import LoadShape, run_jobs
from hearth.bench.textgen import TextSource, TokenizerTextSource, WordTextSource
from hearth.bench.workloads import (
    WORKLOADS,
    AgenticConfig,
    AgenticWorkload,
    RandomConfig,
    RandomWorkload,
    ReplayConfig,
    ReplayWorkload,
    SharedPrefixConfig,
    SharedPrefixWorkload,
    Workload,
)

_ENDPOINT_CHOICES = {"auto": None, "completions": COMPLETIONS, "chat": CHAT}
_ENDPOINT_CHOICES.update({path: kind for kind, path in ENDPOINT_PATHS.items()})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    target = parser.add_argument_group("target")
    target.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000 (no /v1)")
    target.add_argument("--model", required=True, help="model name sent in each request")
    target.add_argument("--endpoint", default="auto", choices=sorted(_ENDPOINT_CHOICES),
                        help="auto: chat for agentic/replay, completions otherwise")  # fmt: skip
    target.add_argument("--api-key", default=None)
    target.add_argument("--tokenizer", default=None, help="directory or tokenizer.json of the served model")
    target.add_argument("--prompt-format", default="auto", choices=["auto", "text", "token-ids"],
                        help="auto: text with --tokenizer, else token-id lists for /v1/completions")  # fmt: skip
    target.add_argument("--token-id-range", default="10-500", help="LOW-HIGH ids for token-id prompts")
    target.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM/Hearth extension)")
    target.add_argument("--temperature", type=float, default=0.0)
    target.add_argument("--tool-choice", default=None, help="tool_choice sent with agentic tools (e.g. none)")
    target.add_argument("--request-timeout-s", type=float, default=600.0)

    workload = parser.add_argument_group("workload")
    workload.add_argument("--workload", default="random", choices=sorted(WORKLOADS))
    workload.add_argument("--num-prompts", type=int, default=None,
                          help="requests (random, shared-prefix: default 100; replay: default all lines)")  # fmt: skip
    workload.add_argument("--seed", type=int, default=0)
    workload.add_argument("--random-input-len", type=int, default=1024)
    workload.add_argument("--random-output-len", type=int, default=128)
    workload.add_argument("--random-range-ratio", type=float, default=0.0)
    workload.add_argument("--num-prefixes", type=int, default=4)
    workload.add_argument("--prefix-len", type=int, default=1024)
    workload.add_argument("--suffix-len", type=int, default=128)
    workload.add_argument("--shared-output-len", type=int, default=64)
    workload.add_argument("--num-sessions", type=int, default=16)
    workload.add_argument("--turns", type=int, default=6, help="agentic turns per session")
    workload.add_argument("--system-prompt-len", type=int, default=1024)
    workload.add_argument("--num-tools", type=int, default=8)
    workload.add_argument("--tool-description-len", type=int, default=64)
    workload.add_argument("--user-turn-len", type=int, default=128)
    workload.add_argument("--tool-result-len", type=int, default=256)
    workload.add_argument("--agentic-output-len", type=int, default=48)
    workload.add_argument("--tool-call-ratio", type=float, default=0.5)
    workload.add_argument("--think-time-s", type=float, default=0.5, help="mean pause between turns")
    workload.add_argument("--affinity-share", type=float, default=1.0,
                          help="share of sessions sending x-session-affinity")  # fmt: skip
    workload.add_argument("--trace", default=None, help="JSONL trace for --workload replay")
    workload.add_argument("--replay-speed", type=float, default=1.0)

    load = parser.add_argument_group("load shape (a comma list sweeps)")
    load.add_argument("--max-concurrency", default=None, help="e.g. 8 or 1,4,16 (agentic: sessions)")
    load.add_argument("--request-rate", default="inf", help="Poisson arrivals/s, e.g. 2 or 1,2,4; inf")

    out = parser.add_argument_group("results")
    out.add_argument("--slo", default=None, help="goodput SLOs, e.g. ttft=500ms,tpot=50ms,e2el=5s")
    out.add_argument("--percentiles", default="50,90,99")
    out.add_argument("--result-dir", default="bench-results")
    out.add_argument("--label", default=None, help="file name stem (default: the workload name)")
    out.add_argument("--no-plots", action="store_true")
    out.add_argument("--no-progress", action="store_true")


def _parse_list(text: str | None, cast: type, name: str) -> list[Any]:
    if text is None:
        return [None]
    try:
        values = [cast(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from exc
    if not values:
        raise ValueError(f"{name}: empty list")
    return values


def load_shapes(args: argparse.Namespace) -> tuple[list[LoadShape], str | None]:
    concurrencies = _parse_list(args.max_concurrency, int, "--max-concurrency")
    rates = _parse_list(args.request_rate, float, "--request-rate")
    if len(concurrencies) > 1 and len(rates) > 1:
        raise ValueError("sweep one of --max-concurrency or --request-rate, not both")
    if any(c is not None and c < 1 for c in concurrencies) or any(r <= 0 for r in rates):
        raise ValueError("--max-concurrency and --request-rate must be positive")
    shapes = [LoadShape(c, r) for c in concurrencies for r in rates]
    variable = "max_concurrency" if len(concurrencies) > 1 else "request_rate" if len(rates) > 1 else None
    return shapes, variable


def _text_source(args: argparse.Namespace) -> TextSource:
    if args.tokenizer:
        return TokenizerTextSource(args.tokenizer)
    low, _, high = args.token_id_range.partition("-")
    return WordTextSource(int(low), int(high))


def build_workload(args: argparse.Namespace) -> Workload:
    text_source = _text_source(args)
    if args.workload == "random":
        config = RandomConfig(
            num_prompts=args.num_prompts or 100,
            input_len=args.random_input_len,
            output_len=args.random_output_len,
            range_ratio=args.random_range_ratio,
            prompt_format=args.prompt_format,
            seed=args.seed,
        )
        return RandomWorkload(config, text_source)
    if args.workload == "shared-prefix":
        shared = SharedPrefixConfig(
            num_prompts=args.num_prompts or 100,
            num_prefixes=args.num_prefixes,
            prefix_len=args.prefix_len,
            suffix_len=args.suffix_len,
            output_len=args.shared_output_len,
            prompt_format=args.prompt_format,
            seed=args.seed,
        )
        return SharedPrefixWorkload(shared, text_source)
    if args.workload == "agentic":
        agentic = AgenticConfig(
            num_sessions=args.num_sessions,
            turns_per_session=args.turns,
            system_prompt_len=args.system_prompt_len,
            num_tools=args.num_tools,
            tool_description_len=args.tool_description_len,
            user_turn_len=args.user_turn_len,
            tool_result_len=args.tool_result_len,
            output_len=args.agentic_output_len,
            tool_call_ratio=args.tool_call_ratio,
            think_time_s=args.think_time_s,
            affinity_share=args.affinity_share,
            seed=args.seed,
        )
        return AgenticWorkload(agentic, text_source)
    if not args.trace:
        raise ValueError("--workload replay needs --trace FILE.jsonl")
    replay = ReplayConfig(
        trace_path=args.trace,
        speed=args.replay_speed,
        num_prompts=args.num_prompts,
        prompt_format=args.prompt_format,
        seed=args.seed,
    )
    return ReplayWorkload(replay, text_source)


def _json_safe(value: Any) -> Any:
    # JSON has no Infinity; vLLM writes "inf" for an unbounded request rate.
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return value


async def _run_all(args: argparse.Namespace) -> int:
    percentiles = tuple(float(p) for p in args.percentiles.split(","))
    slos = parse_slos(args.slo) if args.slo else []
    shapes, variable = load_shapes(args)
    workload = build_workload(args)
    endpoint = _ENDPOINT_CHOICES[args.endpoint] or workload.default_endpoint
    options = ClientOptions(
        base_url=args.base_url,
        model=args.model,
        api_key=args.api_key,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        tool_choice=args.tool_choice,
        request_timeout_s=args.request_timeout_s,
    )
    label = args.label or args.workload
    result_dir = Path(args.result_dir)
    result_dir.mkdir(parents=True, exist_ok=True)
    argv = sys.argv[3:] if sys.argv[1:3] == ["bench", "serve"] else sys.argv[1:]
    command = "hearth bench serve " + shlex.join(argv)
    progress = not args.no_progress and sys.stderr.isatty()
    stop = asyncio.Event()
    runs: list[dict[str, Any]] = []
    for round_index, shape in enumerate(shapes):
        jobs = workload.jobs(endpoint, round_index)
        num_requests = sum(job.num_requests for job in jobs)
        outcome = await run_jobs(
            jobs,
            shape,
            options,
            seed=args.seed,
            progress=progress,
            description=shape.label(),
            stop_event=stop,
        )
        run = {
            "date": time.strftime("%Y%m%d-%H%M%S"),
            "label": label,
            "load": shape.label(),
            "endpoint_type": "openai-chat" if endpoint == CHAT else "openai",
            "endpoint": ENDPOINT_PATHS[endpoint],
            "base_url": args.base_url,
            "model_id": args.model,
            "tokenizer_id": args.tokenizer,
            "workload": args.workload,
            "num_prompts": num_requests,
            "request_rate": _json_safe(shape.request_rate),
            "burstiness": 1.0,
            "max_concurrency": shape.max_concurrency,
            "interrupted": outcome.interrupted,
            "max_concurrent_requests": outcome.max_concurrent_requests,
            "client_cpu_s": outcome.client_cpu_s,
            "client_cpu_util": outcome.client_cpu_s / max(outcome.duration_s, 1e-9),
            "command": command,
            **summarize(outcome.results, outcome.duration_s, slos=slos, percentiles=percentiles),
        }
        runs.append(run)
        stem = label if len(shapes) == 1 else f"{label}-{shape.label()}"
        (result_dir / f"{stem}.json").write_text(json.dumps(run, indent=1))
        print(run_markdown(run, percentiles), end="\n\n", flush=True)
        if run["client_cpu_util"] > 0.8:
            print("warning: the bench client used >80% of a core; it may be the bottleneck", file=sys.stderr)
        if outcome.interrupted:
            break
    if len(runs) > 1 and variable:
        sweep = {
            "label": label,
            "sweep_variable": variable,
            "command": command,
            "runs": [{k: v for k, v in run.items() if not isinstance(v, list)} for run in runs],
        }
        (result_dir / f"{label}-sweep.json").write_text(json.dumps(sweep, indent=1))
        print(sweep_markdown(variable, runs), end="\n\n")
    (result_dir / f"{label}.md").write_text(
        document_markdown(f"hearth bench serve: {label}", command, runs, variable, percentiles)
    )
    if not args.no_plots and runs:
        from hearth.bench.plots import plot_latency_cdfs, plot_sweep

        plot_latency_cdfs(runs, result_dir / f"{label}-cdf.png")
        if len(runs) > 1 and variable:
            plot_sweep(variable, runs, result_dir / f"{label}-sweep.png")
    print(f"results in {result_dir}/ ({label}*.json, {label}.md{'' if args.no_plots else ', PNGs'})")
    return 130 if any(run["interrupted"] for run in runs) else 0


def plots_available() -> bool:
    """Whether matplotlib (the `[bench]` extra) can be imported, found without importing it."""
    try:
        return importlib.util.find_spec("matplotlib") is not None
    except (ImportError, ValueError):  # ValueError: a stub in sys.modules with no spec
        return False


def run(args: argparse.Namespace) -> int:
    # Checked before the benchmark, not after it: a missing optional package used to cost the whole run
    # and end in a ModuleNotFoundError traceback while the plots were written.
    if not args.no_plots and not plots_available():
        print(
            "hearth bench serve: matplotlib is not installed, so no plots will be written "
            "(pip install 'hearth[bench]' for them, or pass --no-plots to silence this)",
            file=sys.stderr,
        )
        args.no_plots = True
    try:
        return asyncio.run(_run_all(args))
    except (ValueError, FileNotFoundError) as exc:
        print(f"hearth bench serve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # outside a run (e.g. while building prompts): nothing to report
        print("hearth bench serve: interrupted", file=sys.stderr)
        return 130
