"""`hearth bench offline`: engine throughput on random-token prompts, no HTTP in the way.

Mirrors vLLM's offline throughput benchmark: N prompts of I random token ids, O output tokens each,
greedy with EOS ignored, all submitted at once; the engine batches them as its limits allow.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import sys
import time
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from hearth.engine.config import EngineConfig

    EngineConfig.add_cli_arguments(parser, require_model=True)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--prompt-seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument(
        "--prompts-file",
        type=Path,
        default=None,
        help="JSON list of token-id lists (same prompts as a peer's run)",
    )
    parser.add_argument("--output-json", type=Path, default=None, help="write the result here")


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    from hearth import LLM, SamplingParams
    from hearth.engine.config import EngineConfig
    from hearth.model.config import ModelLoadError
    from hearth.model.tokenizer import TokenizerError
    from hearth.ops import cpu_kernels

    config = EngineConfig.from_cli_args(args)
    try:
        llm = LLM(config.model, **{k: v for k, v in vars(config).items() if k != "model"})
    except (ModelLoadError, TokenizerError) as exc:
        print(f"hearth bench offline: {exc}", file=sys.stderr)
        return 2
    ready_s = time.perf_counter() - started
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(args.prompt_seed)
    if args.prompts_file is not None:
        prompts = [list(p)[: args.input_len] for p in json.loads(args.prompts_file.read_text())][
            : args.num_prompts
        ]
    else:
        prompts = [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    # Time the steady state: the compiled kernels (cached after a machine's first build) are in use.
    kernels_ready = cpu_kernels.paged_decode_attention_kernel(wait=True) is not None
    llm.engine.kv.reset_prefix_cache()
    t0 = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed_s = time.perf_counter() - t0
    output_tokens = sum(len(r.token_ids) for r in results)
    input_tokens = sum(r.prompt_tokens for r in results)
    peak_rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    result = {
        "model": config.model,
        "dtype": str(llm.engine.dtype).removeprefix("torch."),
        "num_prompts": len(prompts),
        "input_len": args.input_len,
        "output_len": args.output_len,
        "max_num_seqs": config.max_num_seqs,
        "num_threads": config.resolved_num_threads,
        "elapsed_s": round(elapsed_s, 3),
        "output_throughput_tok_s": round(output_tokens / elapsed_s, 1),
        "total_throughput_tok_s": round((output_tokens + input_tokens) / elapsed_s, 1),
        "requests_per_s": round(len(results) / elapsed_s, 3),
        "ready_s": round(ready_s, 2),
        "cpu_kernels": kernels_ready,
        "peak_rss_gib": round(peak_rss_gib, 3),
        "kv_cache_memory_gib": config.kv_cache_memory_gib,
        "num_preemptions": llm.engine.stats().num_preemptions_total,
        "first_out_ids_prompt0": results[0].token_ids[:8],
    }
    speculator = llm.engine.speculator
    if speculator is not None:
        spec = speculator.stats
        result["speculative"] = {
            "method": spec.method,
            "num_speculative_tokens": config.num_speculative_tokens,
            "acceptance_rate": round(spec.acceptance_rate, 4),
            "mean_accepted_length": round(spec.mean_accepted_length, 3),
            "num_drafts": spec.num_drafts,
        }
    print(
        f"output {result['output_throughput_tok_s']:.1f} tok/s, total {result['total_throughput_tok_s']:.1f} tok/s, "
        f"{result['requests_per_s']:.2f} req/s, ready in {ready_s:.2f} s, peak RSS {peak_rss_gib:.2f} GiB "
        f"({args.num_prompts} prompts x {args.input_len} in / {args.output_len} out, max {config.max_num_seqs} seqs, "
        f"{result['dtype']})"
    )
    if speculator is not None:
        print(
            f"speculative {spec.method}: acceptance rate {spec.acceptance_rate:.3f}, "
            f"mean accepted length {spec.mean_accepted_length:.2f} (K={config.num_speculative_tokens})"
        )
    if args.output_json:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps(result, indent=2) + "\n")
    return 0
