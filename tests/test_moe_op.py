"""The fused MoE op (`hearth.ops.moe`) and the expert-parallel split of the MoE layer (`hearth.model.moe`)."""

from __future__ import annotations

import pytest
import torch

from hearth.model.config import ModelConfig
from hearth.model.layers import LayerOptions
from hearth.model.loader import build_model, load_weights
from hearth.model.moe import FusedExperts, SparseMoeBlock, TopKRouter, expert_range
from hearth.model.weights import TPRank
from hearth.ops import moe as moe_ops
from hearth.ops.moe import fused_moe, moe_reference
from hearth.parallel.state import ParallelState, set_parallel_state


def random_moe(num_tokens: int, num_experts: int = 6, top_k: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, 16, generator=g)
    gate_up = torch.randn(num_experts, 2 * 8, 16, generator=g) * 0.3
    down = torch.randn(num_experts, 16, 8, generator=g) * 0.3
    logits = torch.randn(num_tokens, num_experts, generator=g)
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    return hidden, gate_up, down, weights, ids


@pytest.mark.parametrize("grouped", [False, True], ids=["expert-loop", "grouped-mm"])
@pytest.mark.parametrize("num_tokens", [1, 3, 40])
def test_fused_moe_equals_the_token_by_token_sum(num_tokens, grouped):
    """Both grouped-GEMM forms (the per-expert loop, and torch._grouped_mm that CUDA uses in bf16)."""
    hidden, gate_up, down, weights, ids = random_moe(num_tokens)
    torch.testing.assert_close(
        fused_moe(hidden, gate_up, down, weights, ids, grouped=grouped),
        moe_reference(hidden, gate_up, down, weights, ids),
    )


def test_fused_moe_runs_one_gemm_pair_per_expert_with_tokens(monkeypatch):
    """Grouped by expert, not a loop over tokens: 40 tokens x top-2 over 6 experts is 6 x 2 GEMMs."""
    hidden, gate_up, down, weights, ids = random_moe(40)
    calls = []
    real_mm = torch.mm

    class CountingTorch:
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def mm(*args, **kwargs):
            calls.append(args[0].shape[0])
            return real_mm(*args, **kwargs)

    monkeypatch.setattr(moe_ops, "torch", CountingTorch())
    fused_moe(hidden, gate_up, down, weights, ids)
    assert len(calls) == 2 * len(set(ids.flatten().tolist()))
    assert sum(calls) == 2 * 40 * 2  # every (token, expert) pair once per projection


def test_expert_slices_are_contiguous_balanced_and_cover_every_expert():
    for num_experts, size in [(8, 2), (384, 8), (10, 4), (3, 4)]:
        slices = [expert_range(num_experts, rank, size) for rank in range(size)]
        assert [start for start, _ in slices] == [sum(c for _, c in slices[:r]) for r in range(size)]
        assert sum(count for _, count in slices) == num_experts
        assert max(c for _, c in slices) - min(c for _, c in slices) <= 1


@pytest.mark.parametrize("grouped", [False, True], ids=["expert-loop", "grouped-mm"])
def test_expert_parallel_ranks_sum_to_the_whole_layer(grouped):
    """Each EP rank computes only its experts' tokens; the all-reduce (here: a sum) gives the full output."""
    hidden, gate_up, down, weights, ids = random_moe(25, num_experts=7, top_k=3)
    whole = fused_moe(hidden, gate_up, down, weights, ids)
    partial = torch.zeros_like(whole)
    for rank in range(3):
        start, count = expert_range(7, rank, 3)
        partial += fused_moe(
            hidden,
            gate_up[start : start + count],
            down[start : start + count],
            weights,
            ids,
            first_expert=start,
            grouped=grouped,
        )
    torch.testing.assert_close(partial, whole)


def test_sigmoid_grouped_router_picks_within_the_best_groups_and_weights_by_plain_scores():
    moe = ModelConfig.from_dict(
        {
            "architectures": ["DeepseekV3ForCausalLM"],
            "vocab_size": 8,
            "hidden_size": 4,
            "intermediate_size": 8,
            "num_hidden_layers": 1,
            "num_attention_heads": 1,
            "kv_lora_rank": 4,
            "qk_nope_head_dim": 2,
            "qk_rope_head_dim": 2,
            "v_head_dim": 2,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 4,
            "n_group": 4,
            "topk_group": 1,
            "routed_scaling_factor": 2.0,
            "norm_topk_prob": False,
        }
    ).moe
    router = TopKRouter(4, moe)
    with torch.no_grad():
        router.weight.zero_()
        router.weight[:, 0] = torch.tensor([0.0, 0.1, 3.0, -3.0, 0.5, 0.4, 1.0, 0.9])
        router.e_score_correction_bias.zero_()
        router.e_score_correction_bias[3] = 2.0  # group 1 = experts (2, 3): best by bias-corrected scores
    weights, ids = router(torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    assert sorted(ids[0].tolist()) == [2, 3]
    expected = 2.0 * torch.tensor([3.0, -3.0]).sigmoid()  # the bias chooses; the plain scores weigh
    torch.testing.assert_close(weights[0].sort().values, expected.sort().values)


def test_each_expert_parallel_rank_loads_only_its_experts_and_the_ranks_sum_to_one_rank(tiny_model_factory):
    model_dir = tiny_model_factory("qwen3_moe")
    config = ModelConfig.from_dir(model_dir)
    hidden = torch.randn(9, config.hidden_size, generator=torch.Generator().manual_seed(0))
    outputs = []
    try:
        for state in [
            ParallelState(),
            ParallelState(ep_rank=0, ep_size=2),
            ParallelState(ep_rank=1, ep_size=2),
        ]:
            set_parallel_state(state)
            model = build_model(config, torch.float32, 32)
            # Complete: each rank needs its experts' tensors and no others.
            load_weights(model, model_dir)
            block = model.model.layers[0].mlp
            assert isinstance(block, SparseMoeBlock)
            assert block.experts.gate_up_proj.shape[0] == (8 if state.ep_size == 1 else 4)
            with torch.no_grad():
                # The routed part only: the real all-reduce is the parallel layer's; here the test sums.
                weights, ids = block.gate(hidden)
                outputs.append(block.experts(hidden, weights, ids))
    finally:
        set_parallel_state(ParallelState())
    torch.testing.assert_close(outputs[1] + outputs[2], outputs[0])
    assert not torch.equal(outputs[1], outputs[0])


def test_tensor_parallel_experts_slice_the_intermediate_dim_and_sum_to_one_rank():
    num_experts, hidden_size, intermediate = 4, 8, 6
    g = torch.Generator().manual_seed(1)
    gate = torch.randn(num_experts, intermediate, hidden_size, generator=g)
    up = torch.randn(num_experts, intermediate, hidden_size, generator=g)
    down = torch.randn(num_experts, hidden_size, intermediate, generator=g)
    hidden = torch.randn(5, hidden_size, generator=g)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0], [0, 2]])
    weights = torch.rand(5, 2, generator=g)

    def experts(tp: TPRank) -> FusedExperts:
        module = FusedExperts(num_experts, hidden_size, intermediate, "silu", LayerOptions(tp=tp))
        for e in range(num_experts):
            for part, tensor in (("gate", gate[e]), ("up", up[e])):
                module.weight_loader(module.gate_up_proj, tensor, f"{part}:{e}")
            module.weight_loader(module.down_proj, down[e], f"down:{e}")
        return module

    whole = experts(TPRank())(hidden, weights, ids)
    split = sum(experts(TPRank(rank, 2))(hidden, weights, ids) for rank in range(2))
    torch.testing.assert_close(split, whole)
