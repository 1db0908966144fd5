"""The typed KV pool: layout and dtype, storing a step's K/V, whole pages out and in, page tags."""

from __future__ import annotations

import pytest
import torch

from hearth.engine.config import EngineConfig
from hearth.kv.pool import KVCacheDtypeError, KVLayout, KVPool, resolve_kv_dtype

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, page_size=4, kv_dtype=torch.float32)


def filled_pool(layout: KVLayout = LAYOUT, num_pages: int = 6, seed: int = 0) -> KVPool:
    pool = KVPool(layout, num_pages)
    generator = torch.Generator().manual_seed(seed)
    pool.storage.copy_(torch.randn(pool.storage.shape, generator=generator))
    return pool


def test_kv_dtype_is_separate_from_the_model_dtype_and_salts_prefix_keys():
    assert resolve_kv_dtype("auto", torch.bfloat16) is torch.bfloat16
    assert resolve_kv_dtype("float16", torch.float32) is torch.float16
    half = KVLayout(3, 2, 8, 4, torch.bfloat16)
    assert half.bytes_per_page * 2 == LAYOUT.bytes_per_page
    assert "bfloat16" in half.describe() and "float32" in LAYOUT.describe()
    assert half.describe() != LAYOUT.describe()
    assert KVPool(half, 3).storage.dtype is torch.bfloat16


def test_fp8_is_a_kv_dtype():
    assert resolve_kv_dtype("fp8_e4m3", torch.float32) == torch.float8_e4m3fn
    assert EngineConfig(model="m", kv_cache_dtype="fp8_e4m3").kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(KVCacheDtypeError, match="kv_cache_dtype must be one of"):
        resolve_kv_dtype("int3", torch.float32)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(model="m", kv_cache_dtype="int3")


def test_store_writes_slots_in_the_pool_dtype():
    pool = KVPool(KVLayout(2, 2, 8, 4, torch.bfloat16), 4)
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    slots = torch.tensor([5, 0, 14])
    pool.store(1, slots, k, v)
    k_pool, v_pool = pool.layer(1)
    torch.testing.assert_close(k_pool[slots].float(), k.bfloat16().float())
    torch.testing.assert_close(v_pool[slots].float(), v.bfloat16().float())


def test_pages_read_out_and_written_into_another_pool_keep_every_layer():
    source = filled_pool(seed=1)
    target = filled_pool(seed=2)
    data = source.read_pages([4, 1])
    assert data.shape == (3, 2, 2, 4, 2, 8)
    target.write_pages([0, 5], data)
    for layer in range(3):
        for kv in (0, 1):
            src, dst = source.layer(layer)[kv], target.layer(layer)[kv]
            torch.testing.assert_close(dst[0:4], src[16:20], rtol=0, atol=0)
            torch.testing.assert_close(dst[20:24], src[4:8], rtol=0, atol=0)
    untouched = filled_pool(seed=2)
    torch.testing.assert_close(target.layer(2)[0][4:20], untouched.layer(2)[0][4:20], rtol=0, atol=0)


def test_writing_pages_converts_between_kv_dtypes_and_checks_the_shape():
    source = filled_pool()
    target = KVPool(KVLayout(3, 2, 8, 4, torch.bfloat16), 6)
    target.write_pages([2], source.read_pages([3]))
    torch.testing.assert_close(target.read_pages([2]).float(), source.read_pages([3]).bfloat16().float())
    with pytest.raises(ValueError, match="shape"):
        target.write_pages([2, 3], source.read_pages([3]))


def test_page_tags_live_on_the_pool_and_start_unset():
    pool = KVPool(LAYOUT, 5)
    assert pool.page_tags.tolist() == [0] * 5  # the allocator's first tag is 1: nothing matches an unset page
    pool.set_page_tags([3, 1], [7, 2])
    pool.set_page_tags([], [])
    assert pool.page_tags.tolist() == [0, 2, 0, 7, 0]
    assert pool.page_tags.device == pool.storage.device


def test_an_fp8_latent_pool_stores_the_latent_quantized_with_its_scale():
    from hearth.ops.fp8 import FP8_DTYPE, quantize_fp8

    pool = KVPool(KVLayout(2, 1, 40, 4, FP8_DTYPE, "latent"), 4)
    scales = torch.tensor([[0.02], [0.05]])
    pool.set_scales(scales, scales)
    latent = torch.randn(3, 1, 40)
    pool.store(1, torch.tensor([5, 6, 7]), latent, None)
    k, v = pool.layer(1)
    assert k.data_ptr() == v.data_ptr()  # one tensor: read as keys and as values
    assert torch.equal(k[5:8].view(torch.uint8), quantize_fp8(latent, scales[1]).view(torch.uint8))
