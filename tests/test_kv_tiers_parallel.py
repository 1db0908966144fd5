"""KV tiers under tensor and pipeline parallelism: every rank saves and loads its own shard of each page
(its KV heads, its stage's layers) in host RAM, a disk directory of its own, or the shared Redis, and
answers like one rank without tiers (greedy, float32). A load lands only when every rank's shard is in:
one rank's missing shard means recompute everywhere, never a mix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
SCRIPT = TESTS / "kv_tiers_parallel_llm.py"
TP2 = {"tensor_parallel_size": 2}
PP2 = {"pipeline_parallel_size": 2}


def scenario(model: Path, name: str, layout: dict, *args: str) -> list[dict]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS.parent / "src"), env.get("PYTHONPATH", "")])
    env["HEARTH_CPU_KERNELS"] = "0"  # one code path for every answer (tiers move bytes, not arithmetic)
    env["HEARTH_KV_TRANSFER_SECRET"] = "tier-secret"  # every rank seals its shard's blobs with it
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(model), name, json.dumps(layout), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])["runs"]


@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> list[dict]:
    """One rank, no parallelism: prompt A, prompt B, A again (host tier included, as in the parallel runs)."""
    return scenario(tiny_llama, "host", {})


@pytest.mark.parametrize("layout", [TP2, PP2], ids=["tp2", "pp2"])
def test_pages_pushed_out_to_host_ram_come_back_on_every_rank(tiny_llama: Path, reference, layout):
    runs = scenario(tiny_llama, "host", layout)
    assert [r["tokens"] for r in runs] == [r["tokens"] for r in reference]
    assert runs[2]["cached"] == reference[2]["cached"] == 96  # A's 6 full pages, from host RAM


def test_each_rank_keeps_its_shard_on_disk_across_a_restart(tiny_llama: Path, reference, tmp_path: Path):
    runs = scenario(tiny_llama, "restart", TP2, "-", str(tmp_path / "kv"))
    assert sorted(p.name for p in (tmp_path / "kv").iterdir()) == ["rank0", "rank1"]
    assert [r["tokens"] for r in runs] == [reference[0]["tokens"]] * 2
    assert [r["cached"] for r in runs] == [0, 96]


def test_one_rank_missing_its_shard_means_recompute_on_every_rank(
    tiny_llama: Path, reference, tmp_path: Path
):
    kv = tmp_path / "kv"
    runs = scenario(tiny_llama, "restart", TP2, "-", str(kv), str(kv / "rank1"))
    assert [r["tokens"] for r in runs] == [reference[0]["tokens"]] * 2
    assert [r["cached"] for r in runs] == [0, 0]  # rank 0's pages alone never make a load


def test_ranks_share_pages_through_redis_one_key_per_shard(tiny_llama: Path, reference, redis_server):
    import redis

    runs = scenario(tiny_llama, "restart", TP2, redis_server.url)
    assert [r["tokens"] for r in runs] == [reference[0]["tokens"]] * 2
    assert [r["cached"] for r in runs] == [0, 96]
    assert redis.Redis.from_url(redis_server.url).dbsize() == 2 * 6  # each rank's shard of A's 6 pages


def test_mla_latent_pages_come_back_from_host_ram_under_tensor_parallelism(tiny_model_factory):
    """A DeepseekV3-shaped model caches one latent per token, whole on every TP rank: each rank keeps its
    copy in its own host RAM and loads it back."""
    model = tiny_model_factory("deepseek_v3")
    one_rank = scenario(model, "host", {})
    runs = scenario(model, "host", TP2)
    assert [r["tokens"] for r in runs] == [r["tokens"] for r in one_rank]
    assert runs[2]["cached"] == one_rank[2]["cached"] == 96
