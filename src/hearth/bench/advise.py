"""`hearth bench advise --trace FILE`: a prefill:decode ratio and per-role batch limits from a traffic mix.

Reads a trace in `hearth bench serve`'s replay format (JSONL: `timestamp`, optional `session_id`,
`input_tokens` or `prompt`/`messages`, `output_tokens` or `max_tokens`) and the rates one server of
each role sustains (`--prefill-rate` prompt tokens/s, `--decode-rate` output tokens/s at its batch
limit; measure them with a short `hearth bench serve` run, or read `hearth_prompt_tokens_total` and
`hearth_generation_tokens_total` from `/metrics` over a busy minute). It prints every step of the
arithmetic, so the advice can be checked and redone by hand:

- prefix reuse: within a session, the previous prompt is a cached prefix of the next one (agent
  histories grow); `--cache-hit-ratio` overrides that estimate;
- prefill load = uncached prompt tokens per second; decode load = output tokens per second;
- servers of a role = ceil(load / (rate x `--target-utilization`));
- decode batch: concurrent decodes by Little's law (arrival rate x output tokens x time per token at
  `--itl-ms`), split over the decode servers with `--headroom`;
- prefill batch: the token budget per step that finishes an average uncached prompt within
  `--ttft-ms` at the measured prefill rate.
Text prompts without token counts are estimated at 4 characters per token (said in the output).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CHARS_PER_TOKEN = 4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trace", required=True, help="JSONL trace (the replay format of `hearth bench serve`)"
    )
    parser.add_argument(
        "--prefill-rate", type=float, required=True, help="prompt tokens/s one prefill server computes"
    )
    parser.add_argument(
        "--decode-rate", type=float, required=True, help="output tokens/s one decode server sustains"
    )
    parser.add_argument(
        "--cache-hit-ratio", type=float, default=None, help="override the estimated prefix reuse (0..1)"
    )
    parser.add_argument("--target-utilization", type=float, default=0.7, help="plan servers to run this busy")
    parser.add_argument("--itl-ms", type=float, default=50.0, help="target time per output token")
    parser.add_argument("--ttft-ms", type=float, default=1000.0, help="target time to first token")
    parser.add_argument("--headroom", type=float, default=1.5, help="batch limits above the mean concurrency")
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON too")


@dataclass
class TrafficMix:
    num_requests: int
    duration_s: float
    input_tokens: int
    cached_tokens: int
    output_tokens: int
    estimated_from_text: int  # requests whose prompt length was estimated from characters

    @property
    def hit_ratio(self) -> float:
        return self.cached_tokens / self.input_tokens if self.input_tokens else 0.0


def _prompt_tokens(record: dict[str, Any]) -> tuple[int, bool]:
    if "input_tokens" in record:
        return int(record["input_tokens"]), False
    if "prompt" in record:
        return max(1, len(str(record["prompt"])) // CHARS_PER_TOKEN), True
    text = json.dumps(record.get("messages", [])) + json.dumps(record.get("tools", []))
    return max(1, len(text) // CHARS_PER_TOKEN), True


def read_trace(path: Path, default_output: int = 64) -> TrafficMix:
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not records:
        raise ValueError(f"{path} has no requests")
    records.sort(key=lambda r: float(r["timestamp"]))
    last_prompt: dict[str, int] = {}
    input_tokens = cached = output = estimated = 0
    for index, record in enumerate(records):
        tokens, guessed = _prompt_tokens(record)
        estimated += guessed
        session = str(record.get("session_id", f"request-{index}"))
        cached += min(last_prompt.get(session, 0), tokens)  # the session's previous prompt is a prefix
        last_prompt[session] = tokens
        input_tokens += tokens
        output += int(record.get("output_tokens") or record.get("max_tokens") or default_output)
    duration = float(records[-1]["timestamp"]) - float(records[0]["timestamp"])
    return TrafficMix(len(records), max(duration, 1e-9), input_tokens, cached, output, estimated)


def advise(mix: TrafficMix, args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    hit = mix.hit_ratio if args.cache_hit_ratio is None else args.cache_hit_ratio
    rate = mix.num_requests / mix.duration_s
    uncached = mix.input_tokens * (1 - hit)
    prefill_load = uncached / mix.duration_s
    decode_load = mix.output_tokens / mix.duration_s
    util = args.target_utilization
    num_prefill = max(1, math.ceil(prefill_load / (args.prefill_rate * util)))
    num_decode = max(1, math.ceil(decode_load / (args.decode_rate * util)))
    mean_output = mix.output_tokens / mix.num_requests
    concurrent = rate * mean_output * args.itl_ms / 1000
    decode_seqs = max(1, math.ceil(concurrent / num_decode * args.headroom))
    mean_uncached = uncached / mix.num_requests
    prefill_budget = max(256, math.ceil(args.prefill_rate * args.ttft_ms / 1000 / 256) * 256)
    lines = [
        f"trace: {mix.num_requests} requests over {mix.duration_s:.1f} s = {rate:.2f} req/s",
        f"prompt tokens {mix.input_tokens}, cached {mix.cached_tokens} (session prefixes) -> hit ratio "
        f"{mix.hit_ratio:.3f}" + ("" if args.cache_hit_ratio is None else f", overridden to {hit:.3f}"),
        f"prefill load = {mix.input_tokens} x (1 - {hit:.3f}) / {mix.duration_s:.1f} s = {prefill_load:.1f} tokens/s",
        f"decode load = {mix.output_tokens} / {mix.duration_s:.1f} s = {decode_load:.1f} tokens/s",
        f"prefill servers = ceil({prefill_load:.1f} / ({args.prefill_rate:g} x {util:g})) = {num_prefill}",
        f"decode servers = ceil({decode_load:.1f} / ({args.decode_rate:g} x {util:g})) = {num_decode}",
        f"concurrent decodes = {rate:.2f} req/s x {mean_output:.1f} tokens x {args.itl_ms:g} ms = {concurrent:.1f}",
        f"decode --max-num-seqs = ceil({concurrent:.1f} / {num_decode} x {args.headroom:g}) = {decode_seqs}",
        f"prefill --max-num-batched-tokens = {args.prefill_rate:g} tokens/s x {args.ttft_ms:g} ms, in 256s = "
        f"{prefill_budget} (mean uncached prompt {mean_uncached:.0f} tokens)",
        f"advice: {num_prefill} prefill : {num_decode} decode  ->  hearth launch --prefill {num_prefill} "
        f"--decode {num_decode} --prefill-args '--max-num-batched-tokens {prefill_budget}' "
        f"--decode-args '--max-num-seqs {decode_seqs}'",
    ]
    if mix.estimated_from_text:
        lines.insert(
            1,
            f"({mix.estimated_from_text} prompts without input_tokens: estimated at {CHARS_PER_TOKEN} chars/token)",
        )
    numbers = {
        "requests_per_s": rate,
        "hit_ratio": hit,
        "prefill_load_tokens_per_s": prefill_load,
        "decode_load_tokens_per_s": decode_load,
        "prefill_servers": num_prefill,
        "decode_servers": num_decode,
        "decode_max_num_seqs": decode_seqs,
        "prefill_max_num_batched_tokens": prefill_budget,
    }
    return numbers, lines


def run(args: argparse.Namespace) -> int:
    try:
        mix = read_trace(Path(args.trace))
    except (OSError, ValueError, KeyError) as exc:
        print(f"hearth bench advise: {exc}")
        return 2
    numbers, lines = advise(mix, args)
    print("\n".join(lines))
    if args.json:
        print(json.dumps(numbers))
    return 0
