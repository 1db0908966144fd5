"""KV tokens held for the same memory: MLA's latent pool against the multi-head layout the same model would
need without it (K of qk_nope + qk_rope dims and V of v_head_dim, per head), and against the KV heads of
dense peers. Pools are really allocated (`KVPool`, `torch.empty`: nothing is written, so nothing is
committed) and sized by the engine's own rule (`KVPool.num_pages_for_budget`).

    PYTHONPATH=src python scripts/bench_mla_kv_capacity.py [--budget-gib 16] [--page-size 16]
"""

from __future__ import annotations

import argparse

import torch

from hearth.kv.pool import KVLayout, KVPool

GIB = 1 << 30

# (name, layers, heads, kv_lora_rank, qk_nope, qk_rope, v_head_dim): the published config.json values.
MLA_MODELS = [
    ("Kimi K2 / DeepSeek-V3 (61 layers, 128 heads)", 61, 128, 512, 128, 64, 128),
    ("tiny test DeepSeek-V3 (3 layers, 4 heads)", 3, 4, 32, 16, 8, 16),
]


def tokens_held(layout: KVLayout, budget_bytes: int) -> tuple[int, int]:
    """(tokens, bytes the pool allocated) for a pool built in `budget_bytes`."""
    num_pages = KVPool.num_pages_for_budget(layout, budget_bytes)
    pool = KVPool(layout, num_pages)
    return num_pages * layout.page_size, pool.storage.nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-gib", type=float, default=16.0)
    parser.add_argument("--page-size", type=int, default=16)
    args = parser.parse_args()
    budget = int(args.budget_gib * GIB)
    dtype = torch.bfloat16
    print(f"KV budget {args.budget_gib} GiB, bfloat16, page size {args.page_size}\n")
    print("| model | layout | bytes/token | tokens held | pool bytes | MLA gain |")
    print("|---|---|---:|---:|---:|---:|")
    for name, layers, heads, rank, nope, rope, v_dim in MLA_MODELS:
        latent = KVLayout(layers, 1, rank + rope, args.page_size, dtype, kind="latent")
        # The uncompressed cache: K per head is nope + rope dims, V is v_head_dim; as an "mha" layout
        # (K and V share one head_dim) that is heads x max(nope + rope, v) each, the common padded form,
        # and heads x (nope + rope + v) / 2 unpadded, which the row uses for a fair count.
        unpadded_head_dim = (nope + rope + v_dim) // 2
        mha = KVLayout(layers, heads, unpadded_head_dim, args.page_size, dtype)
        latent_tokens, latent_bytes = tokens_held(latent, budget)
        mha_tokens, mha_bytes = tokens_held(mha, budget)
        print(
            f"| {name} | latent ({rank}+{rope}) | {latent.bytes_per_token:,} | {latent_tokens:,} | {latent_bytes:,} | "
            f"{latent_tokens / max(mha_tokens, 1):.1f}x |"
        )
        print(
            f"| {name} | MHA ({heads} x ({nope}+{rope}) K + {heads} x {v_dim} V) | {mha.bytes_per_token:,} | "
            f"{mha_tokens:,} | {mha_bytes:,} | 1x |"
        )


if __name__ == "__main__":
    main()
