"""A MoE model on one GPU: Hearth at TP=1 against the reference path (transformers), and Hearth's two
grouped-GEMM forms of the fused MoE op against each other.

The model is Qwen3-30B-A3B-shaped (hidden 2048, 128 experts, top-8, expert width 768) with fewer layers
so that a random checkpoint is quick to write, random bf16 weights, and the bundled demo tokenizer's
vocabulary (4,096: Hearth never samples ids its tokenizer cannot produce, so a larger model vocabulary
would make the two engines' greedy tokens differ by construction). Three parts:

1. the MoE op alone at the real expert shape: `fused_moe` with `torch._grouped_mm` (one launch per
   projection) and with the per-expert loop, against the token-by-token reference, for several token
   counts (decode batches and a prefill chunk): time and relative error against float32;
2. end to end, greedy, `--input-len` prompt and `--output-len` new tokens per request, at each batch
   size: transformers `generate` vs Hearth's `LLM.generate` with decode CUDA graphs (the default on
   CUDA) and with `enforce_eager=True`, output tokens/s and how many tokens Hearth's output shares with
   transformers' (bf16 on both: near-ties may differ);
3. a table of ratios last.

    python scripts/bench_gpu_moe.py                                   # on a GPU
    python scripts/bench_gpu_moe.py --tiny --device cpu --batch-sizes 1,2 --output-len 4   # smoke test
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

import hearth.ops.moe as moe_ops
from hearth.engine.llm import LLM
from hearth.engine.sampling_params import SamplingParams

QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "num_hidden_layers": 4,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 4096,  # the demo tokenizer's
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
TINY = QWEN3_30B_A3B | {
    "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 8,
    "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16,
}  # fmt: skip
DEMO_TOKENIZER = Path(__file__).resolve().parent.parent / "models" / "demo"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of `fn()` over `repeats` runs after two warm-ups."""
    for _ in range(2):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def write_checkpoint(config_dict: dict, path: Path, device: torch.device) -> None:
    import transformers

    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_TOKENIZER / name, path / name)
    fields = {k: v for k, v in config_dict.items() if k not in ("model_type", "torch_dtype")}
    config = transformers.AutoConfig.for_model(config_dict["model_type"], **fields)
    config.eos_token_id = None
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.02)
    model.save_pretrained(path, safe_serialization=True)


def bench_op(config: dict, device: torch.device, token_counts: list[int]) -> list[dict]:
    hidden_size, width = config["hidden_size"], config["moe_intermediate_size"]
    experts, top_k = config["num_experts"], config["num_experts_per_tok"]
    g = torch.Generator(device=device).manual_seed(0)
    gate_up = (
        torch.randn(experts, 2 * width, hidden_size, device=device, generator=g, dtype=torch.bfloat16) * 0.02
    )
    down = torch.randn(experts, hidden_size, width, device=device, generator=g, dtype=torch.bfloat16) * 0.02
    rows = []
    for tokens in token_counts:
        hidden = torch.randn(tokens, hidden_size, device=device, generator=g, dtype=torch.bfloat16)
        logits = torch.randn(tokens, experts, device=device, generator=g)
        weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
        row: dict = {"tokens": tokens}
        for name, grouped in (("grouped_mm", True), ("expert_loop", False)):
            row[f"{name}_ms"] = 1e3 * timed(
                lambda grouped=grouped, hidden=hidden, weights=weights, ids=ids: moe_ops.fused_moe(
                    hidden, gate_up, down, weights, ids, grouped=grouped
                ),
                device,
                repeats=20,
            )
        check = min(tokens, 16)  # the token-by-token float32 reference is slow; check a prefix of rows
        reference = moe_ops.moe_reference(
            hidden[:check].float(), gate_up.float(), down.float(), weights[:check], ids[:check]
        )
        for name, grouped in (("grouped_mm", True), ("expert_loop", False)):
            out = moe_ops.fused_moe(hidden, gate_up, down, weights, ids, grouped=grouped)[:check].float()
            row[f"{name}_rel_err"] = float((out - reference).norm() / reference.norm())
        rows.append(row)
    return rows


def hf_generate(model, device: torch.device, prompts: torch.Tensor, output_len: int) -> tuple[float, list]:
    ids = prompts.to(device)

    def run():
        return model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            do_sample=False,
            pad_token_id=0,
        )

    with torch.inference_mode():
        run()  # warm-up
        sync(device)
        start = time.perf_counter()
        out = run()
        sync(device)
        seconds = time.perf_counter() - start
    return seconds, out[:, prompts.shape[1] :].tolist()


def hearth_generate(llm: LLM, prompts: torch.Tensor, output_len: int) -> tuple[float, list]:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    token_lists = prompts.tolist()
    llm.generate(token_lists, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    results = llm.generate(token_lists, params)
    seconds = time.perf_counter() - start
    return seconds, [r.token_ids for r in results]


def profile_batch_one(llm: LLM, prompt: torch.Tensor, path: Path) -> None:
    """Where a batch-1 decode step's time goes: torch.profiler's op table, by CPU and by device time."""
    from torch.profiler import ProfilerActivity, profile

    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        llm.generate(prompt.tolist(), params)
    table = prof.key_averages()
    text = table.table(sort_by="self_cpu_time_total", row_limit=25)
    if torch.cuda.is_available():
        text += "\n" + table.table(sort_by="self_cuda_time_total", row_limit=15)
    path.write_text(text)


def shared_prefix_fraction(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of positions before the first difference (a divergence after a near-tie is not an error)."""
    same = total = 0
    for x, y in zip(a, b):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        same += n
        total += len(x)
    return same / max(total, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--op-tokens", default="1,16,64,512,2048")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny model of the same family (smoke test)")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/bench-moe"))
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument(
        "--profile", default=None, help="write a torch.profiler table of Hearth at batch 1 here"
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    config = dict(TINY if args.tiny else QWEN3_30B_A3B)
    config["num_hidden_layers"] = 2 if args.tiny else args.layers
    results: dict = {
        "config": config,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }

    op_rows = bench_op(config, device, [int(t) for t in args.op_tokens.split(",")])
    results["op"] = op_rows
    print("MoE op, ms (rel err vs float32 reference):")
    for row in op_rows:
        print(
            f"  tokens {row['tokens']:5d}: grouped_mm {row['grouped_mm_ms']:8.3f} ({row['grouped_mm_rel_err']:.1e})"
            f"  expert_loop {row['expert_loop_ms']:8.3f} ({row['expert_loop_rel_err']:.1e})"
            f"  loop/grouped {row['expert_loop_ms'] / row['grouped_mm_ms']:.2f}x"
        )

    write_checkpoint(config, args.dir, device)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    g = torch.Generator().manual_seed(1)
    vocab = 4096  # prompts drawn from the tokenizer's ids
    all_prompts = torch.randint(0, vocab, (max(batch_sizes), args.input_len), generator=g)
    end_to_end = []
    hf_outputs = {}
    import transformers

    hf_model = (
        transformers.AutoModelForCausalLM.from_pretrained(args.dir, dtype=torch.bfloat16).to(device).eval()
    )
    for batch in batch_sizes:
        seconds, tokens = hf_generate(hf_model, device, all_prompts[:batch], args.output_len)
        hf_outputs[batch] = tokens
        end_to_end.append(
            {"batch": batch, "engine": "transformers", "tok_s": batch * args.output_len / seconds}
        )
        print(f"transformers batch {batch}: {batch * args.output_len / seconds:.1f} tok/s", flush=True)
    del hf_model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    llm = None
    for label, eager in (("hearth eager", True), ("hearth", False)):
        del llm
        if device.type == "cuda":
            torch.cuda.empty_cache()
        start = time.perf_counter()
        llm = LLM(
            str(args.dir),
            device=args.device,
            dtype="bfloat16",
            kv_cache_memory_gib=8.0 if not args.tiny else 0.25,
            max_num_seqs=max(batch_sizes),
            enforce_eager=eager,
        )
        graphs = llm.engine.worker.decode_graphs
        results[f"{label}_start_s"] = time.perf_counter() - start
        if graphs is not None:
            results["graphs"] = {"sizes": graphs.sizes, "capture_s": graphs.capture_s,
                                 "capture_MiB": graphs.capture_bytes / 2**20}  # fmt: skip
            print(
                f"graphs: {graphs.sizes} captured in {graphs.capture_s:.2f} s, {graphs.capture_bytes / 2**20:.0f} MiB"
            )
        elif not eager:
            print("graphs: NOT captured (see the log); the 'hearth' rows below ran eagerly")
        for batch in batch_sizes:
            seconds, tokens = hearth_generate(llm, all_prompts[:batch], args.output_len)
            row = {
                "batch": batch,
                "engine": label,
                "tok_s": batch * args.output_len / seconds,
                "shared_with_transformers": shared_prefix_fraction(tokens, hf_outputs[batch]),
            }
            end_to_end.append(row)
            print(
                f"{label} batch {batch}: {row['tok_s']:.1f} tok/s, "
                f"{row['shared_with_transformers']:.1%} of tokens before the first difference",
                flush=True,
            )
    results["end_to_end"] = end_to_end
    if args.profile:
        profile_batch_one(llm, all_prompts[:1], Path(args.profile))
    print(
        "\nbatch | transformers tok/s | hearth graphs tok/s | graphs/transformers | hearth eager tok/s | eager/transformers | shared"
    )
    for batch in batch_sizes:
        by = {r["engine"]: r for r in end_to_end if r["batch"] == batch}
        hf = by["transformers"]["tok_s"]
        print(
            f"{batch:5d} | {hf:18.1f} | {by['hearth']['tok_s']:19.1f} | {by['hearth']['tok_s'] / hf:19.2f} | "
            f"{by['hearth eager']['tok_s']:18.1f} | {by['hearth eager']['tok_s'] / hf:18.2f} | "
            f"{by['hearth']['shared_with_transformers']:.1%}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
