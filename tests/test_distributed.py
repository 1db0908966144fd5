"""Tensor and pipeline parallelism across rank processes (gloo on CPU): the same greedy tokens as one
rank, multi-node rendezvous on loopback, lazy per-rank loading, and a dead rank ending the deployment
instead of hanging it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hearth.engine.config import EngineConfig
from hearth.engine.llm import LLM
from hearth.engine.ranks.executor import free_port
from hearth.engine.sampling_params import SamplingParams
from hearth.model.config import ModelConfig
from hearth.model.lazy_tensor import LOADED_BYTES
from hearth.model.loader import load_model
from hearth.model.weights import TPRank
from hearth.parallel.topology import ParallelConfig, rank_kv_heads, split_layers

TESTS = Path(__file__).parent
SRC = TESTS.parent / "src"
SCRIPT = TESTS / "parallel_llm.py"
PROMPTS = [[1, 5, 9, 33, 100, 7], [3, 4, 200, 11], list(range(40, 90))]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
    return env


def one_rank_tokens(model_dir: Path, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    llm = LLM(str(model_dir), kv_cache_memory_gib=0.02)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    return [r.token_ids for r in llm.generate(prompts, params)]


def run_layouts(
    model_dir: Path,
    layouts: list[dict],
    timeout_s: float = 600,
    kv_tags: list[str] | None = None,
    prompts: list[list[int]] = PROMPTS,
    drafted: list[int] | None = None,
) -> list[list[list[int]]]:
    """Greedy tokens under each layout, from a process of their own; `kv_tags` collects the KV layout tags,
    `drafted` the draft tokens each layout's speculative decoding proposed."""
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(model_dir), json.dumps(layouts), "--prompts", json.dumps(prompts)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=_env(),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [line["layout"] for line in lines] == layouts
    if kv_tags is not None:
        kv_tags.extend(line["kv_tag"] for line in lines)
    if drafted is not None:
        drafted.extend(line["drafted"] for line in lines)
    return [line["tokens"] for line in lines]


# ---- arithmetic, no processes ---------------------------------------------------------------------


def test_stages_balance_the_largest_stage_cost():
    assert split_layers([1] * 8, 2) == [range(0, 4), range(4, 8)]
    # The LM head on the last stage counts: it gets fewer layers.
    assert split_layers([1] * 8, 3, last_extra=2) == [range(0, 3), range(3, 6), range(6, 8)]
    # Cheap dense first layers, costly MoE layers after them.
    assert split_layers([1, 1, 5, 5, 5, 5], 2) == [range(0, 4), range(4, 6)]
    with pytest.raises(ValueError, match="at least as many layers"):
        split_layers([1, 1], 3)


def test_ranks_are_tensor_parallel_innermost_and_nodes_take_consecutive_ranks():
    config = ParallelConfig(tp_size=2, pp_size=2, expert_parallel=True, nnodes=2, node_rank=1)
    assert list(config.local_ranks) == [2, 3]
    state = config.state_of(3)
    assert (state.tp_rank, state.pp_rank, state.ep_rank, state.ep_size) == (1, 1, 1, 2)
    assert state.is_last_stage and not state.is_sampling_rank
    assert config.state_of(2).is_sampling_rank
    assert config.state_of(0).layout_tag == "tp2pp2ep2"
    assert rank_kv_heads(8, 2) == 4 and rank_kv_heads(2, 4) == 1


def test_engine_config_refuses_layouts_it_cannot_place():
    with pytest.raises(ValueError, match="do not split evenly"):
        EngineConfig("m", tensor_parallel_size=3, nnodes=2, master_port=1)
    with pytest.raises(ValueError, match="master_port"):
        EngineConfig("m", tensor_parallel_size=2, nnodes=2)
    with pytest.raises(ValueError, match="node_rank"):
        EngineConfig("m", nnodes=2, node_rank=2, master_port=1)


def test_cli_flags_reach_the_engine_config():
    import argparse

    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_arguments(parser)
    args = parser.parse_args(
        "--model m --tensor-parallel-size 2 --pipeline-parallel-size 2 --expert-parallel --nnodes 2 "
        "--node-rank 1 --master-addr 10.0.0.1 --master-port 29999".split()
    )
    config = EngineConfig.from_cli_args(args)
    assert (config.tensor_parallel_size, config.pipeline_parallel_size, config.expert_parallel) == (
        2,
        2,
        True,
    )
    assert (config.nnodes, config.node_rank, config.master_addr, config.master_port) == (
        2,
        1,
        "10.0.0.1",
        29999,
    )


# ---- one process: shards whose partial results add up ----------------------------------------------


def test_vocab_parallel_embedding_and_head_add_up_to_the_whole_with_padding(tmp_path):
    from hearth.model.vocab_parallel import ParallelLMHead, VocabParallelEmbedding

    vocab, hidden = 11, 4  # 11 rows over 2 ranks: 6 + 5, the last block padded by one row
    weight = torch.randn(vocab, hidden)
    ids = torch.tensor([0, 5, 6, 10])
    # On one process the all-reduce is the identity, so each rank's masked lookup can be summed here.
    shards = []
    for rank in range(2):
        embedding = VocabParallelEmbedding(vocab, hidden, TPRank(rank, 2))
        embedding.weight_loader(embedding.weight, weight)
        shards.append(embedding)
    torch.testing.assert_close(sum(s(ids) for s in shards), weight[ids])
    head = ParallelLMHead(vocab, hidden, TPRank(1, 2))
    head.weight_loader(head.weight, weight)
    x = torch.randn(3, hidden)
    local = torch.nn.functional.linear(x, head.weight)
    torch.testing.assert_close(local[:, :5], x @ weight[6:].T)
    assert not local[:, 5].any()  # the padding row


def test_each_tensor_parallel_rank_reads_only_its_slices(tiny_model_factory):
    model_dir = tiny_model_factory("llama")
    config = ModelConfig.from_dir(model_dir)

    def read_bytes(tp_rank: int, tp_size: int) -> tuple[int, int]:
        LOADED_BYTES.clear()
        load_model(model_dir, config, torch.float32, 64, tp_rank=tp_rank, tp_size=tp_size)
        return LOADED_BYTES["sliced"], LOADED_BYTES["whole"]

    sliced_1, whole_1 = read_bytes(0, 1)
    sliced_2, whole_2 = read_bytes(1, 2)
    assert sliced_2 * 2 == sliced_1  # every sliced tensor: exactly half
    assert whole_2 == whole_1 < sliced_1 / 50  # only the norms are read whole


def test_a_pipeline_stage_holds_and_reads_only_its_layers(tiny_model_factory):
    model_dir = tiny_model_factory("llama")
    config = ModelConfig.from_dir(model_dir)
    LOADED_BYTES.clear()
    last = load_model(model_dir, config, torch.float32, 64, layers=range(1, 2))
    names = {name for name, _ in last.named_parameters()}
    assert not any(name.startswith(("model.layers.0.", "model.embed_tokens")) for name in names)
    assert "lm_head.weight" in names and "model.norm.weight" in names
    assert last.model.layers[1].self_attn.layer_index == 0  # the stage's KV pool holds one layer


# ---- rank processes --------------------------------------------------------------------------------


def test_tensor_and_pipeline_parallel_give_the_tokens_of_one_rank(tiny_model_factory):
    model_dir = tiny_model_factory("qwen2", num_hidden_layers=4)  # q/k/v biases, 4 layers
    expected = one_rank_tokens(model_dir)
    tags: list[str] = []
    tp, pp = run_layouts(
        model_dir, [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], kv_tags=tags
    )
    assert tp == expected
    assert pp == expected
    # Each layout's pages have keys of their own (one KV head per TP rank; two layers per stage).
    assert tags == ["mha/float32/p16/h1x16/l4/tp2pp1ep1", "mha/float32/p16/h2x16/l2/tp1pp2ep1"]


def test_pipeline_micro_batches_give_the_tokens_of_one_rank(tiny_model_factory):
    # 9 requests of unequal lengths: prefill steps and decode steps cut in 3 micro-batches, and in 1.
    model_dir = tiny_model_factory("llama", num_hidden_layers=4)
    prompts = [[(11 * i + 3 * j) % 500 + 1 for j in range(4 + 5 * i)] for i in range(9)]
    expected = one_rank_tokens(model_dir, prompts)
    three, one = run_layouts(
        model_dir,
        [
            {"pipeline_parallel_size": 2, "pipeline_micro_batches": 3},
            {"pipeline_parallel_size": 2, "pipeline_micro_batches": 1},
        ],
        prompts=prompts,
    )
    assert three == expected, (three, expected)
    assert one == expected, (one, expected)


@pytest.mark.slow
def test_tensor_times_pipeline_parallel_on_four_ranks(tiny_model_factory):
    model_dir = tiny_model_factory("llama", num_hidden_layers=4, tie_word_embeddings=True)
    expected = one_rank_tokens(model_dir)
    (tokens,) = run_layouts(model_dir, [{"tensor_parallel_size": 2, "pipeline_parallel_size": 2}])
    assert tokens == expected, (tokens, expected)


@pytest.mark.slow
def test_two_nodes_on_loopback_give_the_tokens_of_one_rank(tiny_model_factory):
    model_dir = tiny_model_factory("llama")
    expected = one_rank_tokens(model_dir)
    port = free_port()
    node_options = f"--tensor-parallel-size 2 --nnodes 2 --master-port {port} --device cpu".split()
    node1 = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hearth.engine.ranks.node",
            "--model",
            str(model_dir),
            "--node-rank",
            "1",
            *node_options,
        ],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        layout = {"tensor_parallel_size": 2, "nnodes": 2, "node_rank": 0, "master_port": port}
        (tokens,) = run_layouts(model_dir, [layout])
        assert tokens == expected, (tokens, expected)
        assert node1.wait(timeout=60) == 0  # node 0 stopped its ranks; the node exits cleanly
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()


def test_a_killed_rank_ends_the_deployment_with_an_error(tiny_model_factory):
    model_dir = tiny_model_factory("llama")
    process = subprocess.Popen(
        [sys.executable, str(SCRIPT), str(model_dir), json.dumps([{"tensor_parallel_size": 2}]), "--forever"],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        pid = json.loads(line)["pids"]["1"]
        time.sleep(1.0)  # mid-generation
        os.kill(pid, signal.SIGKILL)
        _, stderr = process.communicate(timeout=60)  # no hang
        assert process.returncode == 1
        assert "rank 1" in stderr and "stopping every rank" in stderr
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_more_ranks_than_gpus_is_a_clear_error_before_any_process_starts():
    from hearth.engine.ranks.executor import check_devices_for_ranks

    check_devices_for_ranks(4, torch.device("cpu"))  # gloo ranks share the CPU
    too_many = torch.cuda.device_count() + 1
    with pytest.raises(ValueError, match=f"{too_many} ranks on this node need {too_many} GPUs"):
        check_devices_for_ranks(too_many, torch.device("cuda"))
