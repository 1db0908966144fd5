"""Where an FP8 KV pool's per (layer, KV head) scales come from, in order:

1. the checkpoint: `...layers.N.self_attn.{k,v}_scale` (vLLM's name; compressed-tensors also puts them on
   `k_proj`/`v_proj` or `attn`), a scalar per layer or one value per KV head;
2. otherwise a calibration pass at start: one prefill of a fixed text through a float32 pool, whose
   per-head absolute maxima (with headroom) become the scales.

Never a silent 1.0: with unit scales every |x| past 448 saturates and small values flush to zero.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch

from hearth.kv.pool import KVLayout, KVPool
from hearth.ops.fp8 import scales_from_amax
from hearth.parallel.state import parallel_state

logger = logging.getLogger("hearth.kv")

# Mixed prose, code and chat markup, so the keys and values seen cover more than one kind of text.
CALIBRATION_TEXT = (
    "The quick brown fox jumps over the lazy dog. In 1905, Albert Einstein published four papers that "
    "changed physics: on the photoelectric effect, Brownian motion, special relativity and the equivalence "
    "of mass and energy.\n\n"
    "def fibonacci(n: int) -> list[int]:\n    values = [0, 1]\n    while len(values) < n:\n"
    "        values.append(values[-1] + values[-2])\n    return values[:n]\n\n"
    "<|im_start|>user\nWhat is the weather in Paris today?<|im_end|>\n<|im_start|>assistant\n"
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>'
    "<|im_end|>\nUser: Summarise the meeting notes in three bullet points, please. 42 + 17 = 59; "
    "SELECT name, COUNT(*) FROM orders GROUP BY name ORDER BY 2 DESC LIMIT 10;\n"
)


def scales_from_checkpoint(
    found: dict[tuple[int, str], torch.Tensor], layout: KVLayout
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`[num_layers, num_kv_heads]` K and V scales from the tensors the loader set aside, or None when the
    checkpoint ships none. A checkpoint that has them for some layers only is an error, not a partial 1.0."""
    if not found:
        return None
    scales = {which: torch.empty(layout.num_layers, layout.num_kv_heads) for which in "kv"}
    for layer in range(layout.num_layers):
        for which in "kv":
            tensor = found.get((layer, which))
            if tensor is None:
                raise ValueError(f"the checkpoint has KV-cache scales but no {which}_scale for layer {layer}")
            flat = tensor.float().flatten()
            if flat.numel() not in (1, layout.num_kv_heads):
                raise ValueError(
                    f"layer {layer} {which}_scale has {flat.numel()} values; expected 1 or {layout.num_kv_heads}"
                )
            scales[which][layer] = flat.expand(layout.num_kv_heads)
    return scales["k"], scales["v"]


@torch.inference_mode()
def calibrate_kv_amax(
    model: torch.nn.Module, layout: KVLayout, device: torch.device, token_ids: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (layer, KV head) absolute maxima of the keys and values of one prefill of `token_ids`."""
    from hearth.engine.forward_batch import ForwardBatch
    from hearth.ops.attention import AttentionContext
    from hearth.ops.attention.torch_ref import TorchRefBackend

    num_tokens = len(token_ids)
    page_size = layout.page_size
    num_pages = -(-num_tokens // page_size)
    float_layout = KVLayout(
        layout.num_layers, layout.num_kv_heads, layout.head_dim, page_size, torch.float32, layout.kind
    )
    pool = KVPool(float_layout, num_pages, device)
    backend = TorchRefBackend(
        device=device, page_size=page_size, max_num_seqs=1, max_pages_per_seq=num_pages, dtype=torch.float32
    )
    step = ForwardBatch(
        token_ids=token_ids,
        positions=list(range(num_tokens)),
        query_start_loc=[0, num_tokens],
        seq_lens=[num_tokens],
        num_decode_rows=0,
        page_table=list(range(num_pages)),
        page_table_width=num_pages,
        slot_mapping=list(range(num_tokens)),
        logits_indices=[num_tokens - 1],
        sampling=[],
    )
    ids = torch.tensor(token_ids, dtype=torch.long, device=device)
    positions = torch.arange(num_tokens, device=device)
    ctx = AttentionContext(backend, backend.prepare(step), pool)
    model(ids, positions, ctx, torch.tensor([num_tokens - 1], device=device))
    written = pool.storage[:, :, :num_tokens]  # [layers, planes, tokens, kv_heads, head_dim]
    amax = written.abs().amax(dim=(2, 4))  # [layers, planes, kv_heads]
    # A latent pool's one plane is read as keys and as values: one scale serves both.
    return amax[:, 0].float().cpu(), amax[:, -1].float().cpu()


def calibration_token_ids(model_dir: str | Path, max_tokens: int) -> list[int]:
    from hearth.model.tokenizer import Tokenizer

    ids = Tokenizer.from_dir(model_dir).encode(CALIBRATION_TEXT)
    return ids[:max_tokens]


def rank_kv_scales(scales: torch.Tensor, layers: range, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's `[stage layers, local KV heads]` slice of the checkpoint's global `[layers, kv_heads]`
    scales: the heads its qkv projection holds (`QKVParallelLinear`: a contiguous share of the heads, or,
    with more ranks than KV heads, the one head it replicates)."""
    num_kv_heads = scales.shape[1]
    if num_kv_heads >= tp_size:
        local = num_kv_heads // tp_size
        start = tp_rank * local
    else:
        local, start = 1, tp_rank // (tp_size // num_kv_heads)
    return scales[layers.start : layers.stop, start : start + local].contiguous()


def init_fp8_kv_scales(
    pool: KVPool,
    model: torch.nn.Module,
    model_dir: str | Path,
    max_tokens: int,
    stage: range | None = None,
    model_shape: tuple[int, int] | None = None,
) -> str:
    """Give an FP8 pool its scales (checkpoint's, else calibrated); returns where they came from, for the log.

    Under tensor/pipeline parallelism (`stage`: this rank's global layers, `model_shape`: the model's (layers,
    KV heads); both None on one rank) the pool holds the stage's layers and this rank's KV heads: checkpoint scales (global
    layer and head indices) are sliced to those; calibration runs the sharded model itself, every rank at
    once (its all-reduces and stage hand-offs are the ones of a prefill), so each rank measures its own."""
    found: dict[tuple[int, str], torch.Tensor] = getattr(model, "checkpoint_kv_scales", {})
    layout = pool.layout
    if stage is not None and model_shape is not None:
        layout = dataclasses.replace(layout, num_layers=model_shape[0], num_kv_heads=model_shape[1])
    from_checkpoint = scales_from_checkpoint(found, layout)
    if from_checkpoint is not None:
        if layout is not pool.layout:
            state = parallel_state()
            assert stage is not None
            from_checkpoint = (
                rank_kv_scales(from_checkpoint[0], stage, state.tp_rank, state.tp_size),
                rank_kv_scales(from_checkpoint[1], stage, state.tp_rank, state.tp_size),
            )
        pool.set_scales(*from_checkpoint)
        return "checkpoint k_scale/v_scale"
    token_ids = calibration_token_ids(model_dir, max_tokens)
    if len(token_ids) < 2:
        raise ValueError("FP8 KV calibration: the calibration text tokenized to fewer than 2 tokens")
    k_amax, v_amax = calibrate_kv_amax(model, pool.layout, pool.device, token_ids)
    pool.set_scales(scales_from_amax(k_amax), scales_from_amax(v_amax))
    logger.info(
        "FP8 KV scales calibrated on %d tokens: K %.3g..%.3g, V %.3g..%.3g",
        len(token_ids),
        float(pool.k_scales.min()),  # type: ignore[union-attr]
        float(pool.k_scales.max()),  # type: ignore[union-attr]
        float(pool.v_scales.min()),  # type: ignore[union-attr]
        float(pool.v_scales.max()),  # type: ignore[union-attr]
    )
    return f"calibrated on {len(token_ids)} tokens"
