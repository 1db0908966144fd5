"""The latent KV pool kind that MLA models (DeepSeek-V3, Kimi K2) cache into: one vector of
`kv_lora_rank + qk_rope_head_dim` values per token and layer, reported at startup."""

from __future__ import annotations

import logging

import pytest
import torch

from hearth import LLM
from hearth.engine.config import EngineConfig
from hearth.engine.worker import kv_layout_for
from hearth.kv.pool import KVLayout, KVPool
from hearth.model.config import ModelConfig

FLOAT32_BYTES = 4


def test_mla_layout_holds_the_latent_per_token_not_two_times_heads_times_head_dim(tiny_model_factory):
    model_dir = tiny_model_factory("deepseek_v3")
    config = ModelConfig.from_dir(model_dir)
    mla = config.mla
    assert mla is not None
    layout = kv_layout_for(EngineConfig(model=str(model_dir), page_size=4), config, torch.float32)
    assert layout.kind == "latent" and layout.num_kv_heads == 1
    latent_bytes = config.num_layers * (mla.kv_lora_rank + mla.qk_rope_head_dim) * FLOAT32_BYTES
    assert layout.bytes_per_token == latent_bytes == 3 * (32 + 8) * 4
    # What the same model caches as multi-head attention: K (nope + rope) and V per head.
    mha_bytes = config.num_layers * config.num_heads * (mla.qk_head_dim + mla.v_head_dim) * FLOAT32_BYTES
    assert layout.bytes_per_token * 4 == mha_bytes
    pool = KVPool(layout, num_pages=5)
    assert pool.storage.nbytes == 5 * 4 * latent_bytes
    assert "latent" in layout.describe()


def test_latent_pool_stores_one_tensor_that_serves_as_keys_and_values_and_moves_by_pages():
    layout = KVLayout(
        num_layers=2, num_kv_heads=1, head_dim=6, page_size=4, kv_dtype=torch.bfloat16, kind="latent"
    )
    pool = KVPool(layout, num_pages=3)
    latent = torch.randn(3, 1, 6)
    slots = torch.tensor([1, 4, 11])
    pool.store(1, slots, latent, None)
    keys, values = pool.layer(1)
    assert keys.data_ptr() == values.data_ptr()
    torch.testing.assert_close(keys[slots].float(), latent.bfloat16().float())
    pages = pool.read_pages([0, 2])
    assert pages.shape == (2, 1, 2, 4, 1, 6)
    other = KVPool(layout, num_pages=3)
    other.write_pages([1, 0], pages)
    torch.testing.assert_close(other.layer(1)[0][4 + 1], latent[0].bfloat16())
    with pytest.raises(ValueError, match="one vector per token"):
        KVLayout(2, 2, 6, 4, torch.float32, kind="latent")


def test_startup_log_reports_the_latent_bytes_per_token_and_the_cache_holds_that_many_tokens(
    tiny_model_factory, caplog
):
    model_dir = tiny_model_factory("deepseek_v3")
    latent_bytes = 3 * (32 + 8) * FLOAT32_BYTES
    budget_bytes = 100 * 8 * latent_bytes  # room for exactly 100 pages of 8 tokens
    with caplog.at_level(logging.INFO, logger="hearth.engine"):
        llm = LLM(str(model_dir), dtype="float32", page_size=8, kv_cache_memory_gib=budget_bytes / 2**30)
    assert f"latent layout, {latent_bytes} bytes per token" in caplog.text
    assert llm.engine.num_kv_tokens == 800
