"""Decode speed of a Llama-3-8B-shaped model with random weights, and the HBM bandwidth it achieves.

Per batch size: a decode step of `batch` rows at `--context` tokens each (model forward + KV write,
no sampling), timed over `--steps` steps after warm-up. Achieved bandwidth = (bytes of weights read +
bytes of KV read) per step / step time, printed beside the device's measured copy bandwidth (a
device-to-device copy of `--copy-gib`, counting bytes read + written).

Three timings per batch size: `eager` (launched back to back, no sync between steps: the first
session's figure), `eager_sync` and `graph` (a sync after every step, as the engine's sampling does),
where `graph` is `DecodeGraphs.run` (`hearth.engine.cuda_graphs`: padding, the input copies, one
replay); `replay` is the bare graph replay, so graph overhead = (graph - replay) / graph. The graphs'
logits are checked against eager's (greedy tokens equal, max relative difference). `--no-graphs` skips
them (on a CPU the "graphs" are run eagerly over the static buffers: a smoke test of the path).

    python scripts/bench_gpu_decode.py --batch-sizes 1,8,64 --context 1024       # on a GPU
    python scripts/bench_gpu_decode.py --tiny --device cpu --batch-sizes 1,2      # smoke test anywhere
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from hearth.engine.cuda_graphs import DecodeGraphs, bucket_for
from hearth.engine.step_input import StepInput
from hearth.kv.pool import KVLayout, KVPool
from hearth.model.config import ModelConfig
from hearth.model.loader import build_model
from hearth.ops.attention import AttentionContext, select_backend

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
TINY = LLAMA3_8B | {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 512,
}  # fmt: skip


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, gib: float) -> float:
    """Bytes per second of a large device copy (read + written)."""
    src = torch.empty(int(gib * (1 << 30)), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() / best


def per_step_synced(fn, device: torch.device, steps: int) -> float:
    """Median seconds of `fn()` followed by a device sync, after three warm-ups."""
    for _ in range(3):
        fn()
    sync(device)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def profile_replays(
    graphs: DecodeGraphs, batch_sizes: list[int], context: int, page_size: int, path: str
) -> None:
    """torch.profiler's kernel table over 5 graph steps per batch size: where a replayed step's device time goes."""
    from torch.profiler import ProfilerActivity, profile

    text = []
    for batch in batch_sizes:
        step = decode_step_input(batch, context, page_size)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with profile(activities=activities) as prof:
            for _ in range(5):
                graphs.run(step)
            sync(graphs.device)
        sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        text.append(
            f"== batch {batch}, 5 graph steps\n" + prof.key_averages().table(sort_by=sort, row_limit=20)
        )
    with open(path, "w") as out:
        out.write("\n".join(text))


def decode_step_input(batch: int, context: int, page_size: int) -> StepInput:
    pages_per_row = -(-context // page_size)
    table = [row * pages_per_row + p for row in range(batch) for p in range(pages_per_row)]
    position = context - 1
    return StepInput(
        token_ids=[(17 * row) % 500 + 1 for row in range(batch)],
        positions=[position] * batch,
        query_start_loc=list(range(batch + 1)),
        seq_lens=[context] * batch,
        num_decode_rows=batch,
        page_table=table,
        page_table_width=pages_per_row,
        slot_mapping=[(row * pages_per_row + position // page_size) * page_size + position % page_size
                      for row in range(batch)],
        logits_indices=list(range(batch)),
        sampling=[],
    )  # fmt: skip


def page_tag_check_seconds(step: StepInput, pool: KVPool, device: torch.device, repeats: int) -> float:
    """Seconds of the KV integrity check (`check_page_tags`, Triton on CUDA) over this step's page table."""
    from hearth.ops.triton.page_tags import check_page_tags, check_page_tags_reference

    check = check_page_tags if device.type == "cuda" else check_page_tags_reference
    rows = step.num_decode_rows
    table = torch.tensor(step.page_table, device=device, dtype=torch.int32).view(rows, step.page_table_width)
    pool_tags = torch.arange(pool.num_pages, device=device, dtype=torch.int64)
    expected = pool_tags[table.long()]
    num_pages = torch.full((rows,), step.page_table_width, device=device, dtype=torch.int32)
    assert not bool(check(table, expected, num_pages, pool_tags).any())
    for _ in range(3):
        check(table, expected, num_pages, pool_tags)
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        check(table, expected, num_pages, pool_tags)
    sync(device)
    return (time.perf_counter() - start) / repeats


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,8,64")
    parser.add_argument("--context", type=int, default=1024, help="tokens of context per row")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--copy-gib", type=float, default=2.0)
    parser.add_argument("--tiny", action="store_true", help="a tiny model of the same family (smoke test)")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--no-graphs", action="store_true", help="eager steps only")
    parser.add_argument(
        "--profile",
        default=None,
        help="write the device time per kernel of graph replays at each batch size here",
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = ModelConfig.from_dict(TINY if args.tiny else LLAMA3_8B)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    model = build_model(config, dtype, args.context + 1, device=device)
    for param in model.parameters():
        param.normal_(0.0, 0.02)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    weight_bytes -= model.model.embed_tokens.weight.numel() * model.model.embed_tokens.weight.element_size()
    layout = KVLayout(config.num_layers, config.num_kv_heads, config.head_dim, args.page_size, dtype)
    pages_per_row = -(-args.context // args.page_size)
    scratch_page = max(batch_sizes) * pages_per_row  # the graphs' padding rows' page, past every row's
    pool = KVPool(layout, scratch_page + 1, device)
    pool.storage.normal_()
    backend = select_backend(device)(
        device=device, page_size=args.page_size, max_num_seqs=max(batch_sizes),
        max_pages_per_seq=pages_per_row + 1, dtype=dtype, kv_dtype=dtype,
    )  # fmt: skip
    copy_bps = copy_bandwidth(device, args.copy_gib if device.type == "cuda" else 0.25)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {name}; backend {backend.name}; copy bandwidth {copy_bps / 1e9:.0f} GB/s")
    print(
        f"model: {'tiny' if args.tiny else 'Llama-3-8B-shaped'}, {weight_bytes / 1e9:.2f} GB of weights read per step"
    )
    graphs = None
    capture = {}
    if not args.no_graphs and not backend.supports_decode_graphs:
        print(f"graphs: skipped, the {backend.name} backend has no graph-safe decode path")
    elif not args.no_graphs:

        def graph_forward(ids, positions, metadata, logits_indices):
            return model(ids, positions, AttentionContext(backend, metadata, pool), logits_indices)

        graphs = DecodeGraphs(
            graph_forward, backend, scratch_page, max(batch_sizes), capture=device.type == "cuda"
        )
        graphs.capture()
        capture = {
            "sizes": graphs.sizes,
            "capture_s": graphs.capture_s,
            "capture_MiB": graphs.capture_bytes / 2**20,
        }
        print(
            f"graphs: {len(graphs.sizes)} sizes {graphs.sizes} captured in {graphs.capture_s:.2f} s, "
            f"{graphs.capture_bytes / 2**20:.0f} MiB"
        )
    rows = []
    for batch in batch_sizes:
        step = decode_step_input(batch, args.context, args.page_size)
        ids = torch.tensor(step.token_ids, device=device)
        positions = torch.tensor(step.positions, device=device)
        logits_indices = torch.tensor(step.logits_indices, device=device)

        def eager_step(ids=ids, positions=positions, step=step, logits_indices=logits_indices):
            return model(
                ids, positions, AttentionContext(backend, backend.prepare(step), pool), logits_indices
            )

        for _ in range(3):
            eager_step()
        sync(device)
        start = time.perf_counter()
        for _ in range(args.steps):
            eager_step()
        sync(device)
        step_s = (time.perf_counter() - start) / args.steps
        extra = {"eager_sync_ms": 1e3 * per_step_synced(eager_step, device, args.steps)}
        if graphs is not None:
            eager_logits = eager_step().float()
            graph_logits = graphs.run(step)
            assert graph_logits is not None, "the step did not qualify for a graph"
            graph_logits = graph_logits.float().clone()
            rel = float((graph_logits - eager_logits).abs().max() / eager_logits.abs().max())
            same = bool(torch.equal(graph_logits.argmax(-1), eager_logits.argmax(-1)))
            graph_s = per_step_synced(lambda step=step: graphs.run(step), device, args.steps)
            replay = graphs._replays[bucket_for(batch, graphs.sizes)]
            replay_s = per_step_synced(replay, device, args.steps)
            extra |= {
                "graph_ms": graph_s * 1e3, "replay_ms": replay_s * 1e3,
                "graph_overhead_fraction": (graph_s - replay_s) / graph_s,
                "graph_tokens_per_s": batch / graph_s, "graph_vs_eager_max_rel_diff": rel,
                "graph_argmax_equal": same,
            }  # fmt: skip
        check_s = page_tag_check_seconds(step, pool, device, args.steps)
        kv_bytes = batch * args.context * layout.bytes_per_page // args.page_size
        achieved = (weight_bytes + kv_bytes) / step_s
        moved = weight_bytes + kv_bytes
        if "graph_ms" in extra:
            extra["graph_fraction_of_copy"] = moved / (extra["graph_ms"] / 1e3) / copy_bps
        rows.append({
            "batch": batch, "step_ms": step_s * 1e3, "tokens_per_s": batch / step_s,
            "achieved_GBps": achieved / 1e9, "fraction_of_copy": achieved / copy_bps,
            "page_tag_check_us": check_s * 1e6, "page_tag_check_fraction": check_s / step_s,
        } | extra)  # fmt: skip
        print(
            f"batch {batch:>3}: eager step {step_s * 1e3:7.2f} ms, {batch / step_s:9.1f} tok/s, "
            f"{achieved / 1e9:7.0f} GB/s = {100 * achieved / copy_bps:5.1f}% of copy; "
            f"KV page-tag check {check_s * 1e6:.1f} us = {100 * check_s / step_s:.3f}% of the step"
        )
        if "graph_ms" in extra:
            print(
                f"           graph step {extra['graph_ms']:7.2f} ms, {extra['graph_tokens_per_s']:9.1f} tok/s, "
                f"{moved / extra['graph_ms'] / 1e6:7.0f} GB/s = {100 * extra['graph_fraction_of_copy']:5.1f}% of copy; "
                f"eager with a sync per step {extra['eager_sync_ms']:.2f} ms; replay alone {extra['replay_ms']:.2f} ms "
                f"(graph overhead {100 * extra['graph_overhead_fraction']:.1f}%); vs eager: argmax "
                f"{'equal' if extra['graph_argmax_equal'] else 'DIFFERS'}, max rel diff {extra['graph_vs_eager_max_rel_diff']:.1e}"
            )
    if args.profile and graphs is not None:
        profile_replays(graphs, batch_sizes, args.context, args.page_size, args.profile)
    print("\nbatch | eager tok/s | eager % copy | graph tok/s | graph % copy | graph overhead")
    for row in rows:
        if "graph_ms" in row:
            print(
                f"{row['batch']:5d} | {row['tokens_per_s']:11.1f} | {100 * row['fraction_of_copy']:11.1f}% | "
                f"{row['graph_tokens_per_s']:11.1f} | {100 * row['graph_fraction_of_copy']:11.1f}% | "
                f"{100 * row['graph_overhead_fraction']:.1f}%"
            )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(
                {"device": name, "copy_GBps": copy_bps / 1e9, "context": args.context, "graphs": capture,
                 "rows": rows}, out,
            )  # fmt: skip


if __name__ == "__main__":
    main()
