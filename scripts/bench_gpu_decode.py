"""Decode speed of a Llama-3-8B-shaped model with random weights, and the HBM bandwidth it achieves.

Per batch size: a decode step of `batch` rows at `--context` tokens each (model forward + KV write,
no sampling), timed over `--steps` steps after warm-up. Achieved bandwidth = (bytes of weights read +
bytes of KV read) per step / step time, printed beside the device's measured copy bandwidth (a
device-to-device copy of `--copy-gib`, counting bytes read + written).

    python scripts/bench_gpu_decode.py --batch-sizes 1,8,64 --context 1024       # on a GPU
    python scripts/bench_gpu_decode.py --tiny --device cpu --batch-sizes 1,2      # smoke test anywhere
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from hearth.engine.forward_batch import ForwardBatch
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


def decode_step_input(batch: int, context: int, page_size: int) -> ForwardBatch:
    pages_per_row = -(-context // page_size)
    table = [row * pages_per_row + p for row in range(batch) for p in range(pages_per_row)]
    position = context - 1
    return ForwardBatch(
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


def page_tag_check_seconds(step: ForwardBatch, pool: KVPool, device: torch.device, repeats: int) -> float:
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
    pool = KVPool(layout, max(batch_sizes) * pages_per_row, device)
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
    rows = []
    for batch in batch_sizes:
        step = decode_step_input(batch, args.context, args.page_size)
        ids = torch.tensor(step.token_ids, device=device)
        positions = torch.tensor(step.positions, device=device)
        logits_indices = torch.tensor(step.logits_indices, device=device)

        for _ in range(3):
            model(ids, positions, AttentionContext(backend, backend.prepare(step), pool), logits_indices)
        sync(device)
        start = time.perf_counter()
        for _ in range(args.steps):
            model(ids, positions, AttentionContext(backend, backend.prepare(step), pool), logits_indices)
        sync(device)
        step_s = (time.perf_counter() - start) / args.steps
        check_s = page_tag_check_seconds(step, pool, device, args.steps)
        kv_bytes = batch * args.context * layout.bytes_per_page // args.page_size
        achieved = (weight_bytes + kv_bytes) / step_s
        rows.append({
            "batch": batch, "step_ms": step_s * 1e3, "tokens_per_s": batch / step_s,
            "achieved_GBps": achieved / 1e9, "fraction_of_copy": achieved / copy_bps,
            "page_tag_check_us": check_s * 1e6, "page_tag_check_fraction": check_s / step_s,
        })  # fmt: skip
        print(
            f"batch {batch:>3}: step {step_s * 1e3:7.2f} ms, {batch / step_s:9.1f} tok/s, "
            f"{achieved / 1e9:7.0f} GB/s = {100 * achieved / copy_bps:5.1f}% of copy; "
            f"KV page-tag check {check_s * 1e6:.1f} us = {100 * check_s / step_s:.3f}% of the step"
        )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(
                {"device": name, "copy_GBps": copy_bps / 1e9, "context": args.context, "rows": rows}, out
            )


if __name__ == "__main__":
    main()
