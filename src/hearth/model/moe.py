"""The mixture-of-experts MLP: a router, the routed experts as stacked weights run by the fused MoE op
(`hearth.ops.moe`), and optional shared experts; plus the decoder layer and the checkpoint name
mapping the MoE families share (`hearth.model.models.{qwen3_moe,deepseek_v3,glm4_moe}`).

Expert parallelism: at construction, `parallel_state()` says this rank's place; the rank holds the
contiguous, balanced slice `expert_range(num_experts, ep_rank, ep_size)` of the experts and loads only
their checkpoint tensors. Tokens routed to other ranks' experts contribute zero here, and the routed
output is summed over the expert-parallel group (`all_reduce_ep`, the identity on one process).
Without expert parallelism and with several tensor-parallel ranks, every rank holds every expert's
slice of the intermediate dim instead (as a row-parallel MLP) and the sum is `all_reduce_tp`.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any, ClassVar

import torch
from torch import nn

from hearth.model.config import ModelConfig, ModelLoadError, MoEConfig
from hearth.model.decoder import CausalLM
from hearth.model.layers import ACTIVATIONS, MLP, Attention, DecoderLayer, LayerOptions, RMSNorm
from hearth.model.lazy_tensor import LazyTensor, materialize
from hearth.model.weights import ShardId, TPRank, WeightShapeError, divide, set_weight_attrs
from hearth.ops.moe import fused_moe
from hearth.parallel.state import all_reduce_ep, all_reduce_tp, parallel_state

# `model.layers.3.mlp.experts.17.gate_proj.weight` -> stacked parameter `...experts.gate_up_proj`, part "gate:17"
_EXPERT_TENSOR = re.compile(
    r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<part>gate|up|down)_proj\.weight$"
)
_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


def expert_range(num_experts: int, ep_rank: int, ep_size: int) -> tuple[int, int]:
    """(first expert, number of experts) of rank `ep_rank`: contiguous slices whose sizes differ by at most one."""
    base, extra = divmod(num_experts, ep_size)
    count = base + (1 if ep_rank < extra else 0)
    return ep_rank * base + min(ep_rank, extra), count


def expert_shard_id(part: str, expert: int) -> str:
    return f"{part}:{expert}"


class TopKRouter(nn.Module):
    """Chooses `top_k` experts per token and their weights (float32). Its weight (and DeepSeek's
    correction bias) stay float32 whatever the model dtype, as transformers keeps them: routing
    decisions flip on small differences."""

    def __init__(self, hidden_size: int, moe: MoEConfig) -> None:
        super().__init__()
        self.moe = moe
        if moe.scoring not in ("softmax", "sigmoid"):
            raise ModelLoadError(f"router scoring {moe.scoring!r} is not supported (softmax, sigmoid)")
        if moe.scoring == "sigmoid" and moe.num_experts % moe.num_groups:
            raise ModelLoadError(f"{moe.num_experts} experts do not split into {moe.num_groups} groups")
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden_size, dtype=torch.float32))
        if moe.scoring == "sigmoid":
            self.e_score_correction_bias = nn.Parameter(torch.empty(moe.num_experts, dtype=torch.float32))

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights float32 `[tokens, top_k]`, expert ids long `[tokens, top_k]`)."""
        logits = torch.mm(hidden.float(), self.weight.t())
        moe = self.moe
        if moe.scoring == "softmax":
            probs = logits.softmax(dim=-1)
            weights, ids = probs.topk(moe.top_k, dim=-1)
            if moe.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return weights * moe.routed_scaling_factor if moe.routed_scaling_factor != 1.0 else weights, ids
        scores = logits.sigmoid()
        # The bias steers which experts are chosen (load balancing); the weights are the plain scores.
        choice = scores + self.e_score_correction_bias
        num_tokens = choice.shape[0]
        if moe.num_groups > 1:
            grouped = choice.view(num_tokens, moe.num_groups, -1)
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
            best_groups = group_scores.topk(moe.topk_groups, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
            choice = grouped.masked_fill(~group_mask.unsqueeze(-1), float("-inf")).view(num_tokens, -1)
        ids = choice.topk(moe.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if moe.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * moe.routed_scaling_factor, ids


class FusedExperts(nn.Module):
    """This rank's experts as two stacked parameters, `gate_up_proj` `[local_experts, 2 * intermediate,
    hidden]` and `down_proj` `[local_experts, hidden, intermediate]`, loaded from the checkpoint's
    per-expert tensors (parts "gate:E", "up:E", "down:E" of expert E)."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        options: LayerOptions,
    ) -> None:
        super().__init__()
        state = parallel_state()
        self.num_experts = num_experts
        self.first_expert, self.num_local_experts = expert_range(num_experts, state.ep_rank, state.ep_size)
        # With expert parallelism each rank holds whole experts; without it, tensor parallelism slices them.
        self.tp = options.tp if state.ep_size == 1 else TPRank()
        self.intermediate_size = intermediate_size  # whole, as in the checkpoint
        self.intermediate_per_rank = divide(intermediate_size, self.tp.size, "moe_intermediate_size")
        self.hidden_size = hidden_size
        self.act = ACTIVATIONS[hidden_act]
        dtype = torch.get_default_dtype()
        size = self.intermediate_per_rank
        self.gate_up_proj = nn.Parameter(
            torch.empty(self.num_local_experts, 2 * size, hidden_size, dtype=dtype), requires_grad=False
        )
        self.down_proj = nn.Parameter(
            torch.empty(self.num_local_experts, hidden_size, size, dtype=dtype), requires_grad=False
        )
        local = range(self.first_expert, self.first_expert + self.num_local_experts)
        set_weight_attrs(
            self.gate_up_proj,
            weight_loader=self.weight_loader,
            holds_shard=self.holds_shard,
            lazy_loading=True,  # the loader hands a LazyTensor: other ranks' experts are never read
            shard_ids=tuple(expert_shard_id(part, e) for e in local for part in ("gate", "up")),
        )
        set_weight_attrs(
            self.down_proj,
            weight_loader=self.weight_loader,
            holds_shard=self.holds_shard,
            lazy_loading=True,  # the loader hands a LazyTensor: other ranks' experts are never read
            shard_ids=tuple(expert_shard_id("down", e) for e in local),
        )

    def holds_shard(self, shard_id: ShardId | None) -> bool:
        """Whether this rank keeps checkpoint part `shard_id` (a loader may skip reading the others)."""
        expert = int(str(shard_id).split(":")[1])
        return self.first_expert <= expert < self.first_expert + self.num_local_experts

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor | LazyTensor, shard_id: ShardId | None
    ) -> None:
        """Copy expert E's whole `gate_proj`/`up_proj` `[intermediate, hidden]` or `down_proj` `[hidden,
        intermediate]` into its place; another rank's expert is skipped."""
        part, expert_text = str(shard_id).split(":")
        local = int(expert_text) - self.first_expert
        if not 0 <= local < self.num_local_experts:
            return
        size = self.intermediate_per_rank
        start = self.tp.rank * size
        gate_or_up = part in ("gate", "up")
        expected = (
            (self.intermediate_size, self.hidden_size)
            if gate_or_up
            else (self.hidden_size, self.intermediate_size)
        )
        if tuple(loaded_weight.shape) != expected:
            raise WeightShapeError(loaded_weight.shape, expected)
        if gate_or_up:
            source = loaded_weight.narrow(0, start, size)
            target = param.data[local].narrow(0, 0 if part == "gate" else size, size)
        else:
            source = loaded_weight.narrow(1, start, size)
            target = param.data[local]
        target.copy_(materialize(source))

    def forward(
        self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """This rank's part of the routed output: a partial sum when experts are split over ranks."""
        return fused_moe(
            hidden,
            self.gate_up_proj,
            self.down_proj,
            topk_weights,
            topk_ids,
            first_expert=self.first_expert,
            activation=self.act,
        )


class SparseMoeBlock(nn.Module):
    """Router + routed experts (+ shared experts, which every token goes through)."""

    def __init__(self, config: ModelConfig, options: LayerOptions | None = None) -> None:
        super().__init__()
        options = options or LayerOptions()
        moe = config.moe
        assert moe is not None
        self.gate = TopKRouter(config.hidden_size, moe)
        self.experts = FusedExperts(
            moe.num_experts, config.hidden_size, moe.intermediate_size, config.hidden_act, options
        )
        self.shared_experts = (
            MLP(replace(config, intermediate_size=moe.intermediate_size * moe.num_shared_experts), options)
            if moe.num_shared_experts
            else None
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.gate(hidden)
        routed = self.experts(hidden, topk_weights, topk_ids)
        if parallel_state().ep_size > 1:
            routed = all_reduce_ep(routed)
        elif self.experts.tp.size > 1:
            routed = all_reduce_tp(routed)
        if self.shared_experts is not None:
            routed = routed + self.shared_experts(hidden)
        return routed


class MoEDecoderLayer(DecoderLayer):
    """The pre-norm decoder layer (its forward is `DecoderLayer`'s) with a sparse MoE block in place of the
    MLP, except on the config's dense layers. Families set `attention_class`."""

    attention_class: ClassVar[type[nn.Module]] = Attention

    def __init__(self, config: ModelConfig, layer_index: int, options: LayerOptions | None = None) -> None:
        nn.Module.__init__(self)  # DecoderLayer's init would build the dense MLP and attention this replaces
        assert config.moe is not None
        self.self_attn = self.attention_class(config, layer_index, options)
        self.mlp: nn.Module = (
            MLP(config, options)
            if layer_index in config.moe.dense_layers
            else SparseMoeBlock(config, options)
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class MoECausalLM(CausalLM):
    """The base of the MoE families: per-expert checkpoint tensors load into the stacked expert
    parameters, and layers past `num_hidden_layers` (DeepSeek's multi-token-prediction modules) are skipped."""

    layer_class: ClassVar[type[nn.Module]] = MoEDecoderLayer

    def checkpoint_target(self, name: str) -> tuple[str, ShardId | None] | None:
        layer = _LAYER_INDEX.match(name)
        if layer is not None and int(layer.group(1)) >= self.config.num_layers:
            return None
        expert = _EXPERT_TENSOR.match(name)
        if expert is not None:
            part = expert.group("part")
            param = "gate_up_proj" if part in ("gate", "up") else "down_proj"
            return f"{expert.group('prefix')}.{param}", expert_shard_id(part, int(expert.group("expert")))
        return super().checkpoint_target(name)

    def checkpoint_name(self, param_name: str, shard: ShardId | None) -> str:
        if isinstance(shard, str) and ":" in shard:
            part, expert = shard.split(":")
            return f"{param_name.rsplit('.', 1)[0]}.{expert}.{part}_proj.weight"
        return super().checkpoint_name(param_name, shard)


def sigmoid_moe_config(raw: dict[str, Any], source: str, num_layers: int) -> MoEConfig:
    """DeepSeek-V3's (and GLM-4.5's) routing fields: sigmoid scores with a correction bias, grouped
    top-k, shared experts, the first `first_k_dense_replace` layers dense."""
    scoring = raw.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise ModelLoadError(f"{source}: scoring_func {scoring!r} is not supported here (sigmoid)")
    if int(raw.get("moe_layer_freq", 1)) != 1:
        raise ModelLoadError(f"{source}: moe_layer_freq {raw['moe_layer_freq']} is not supported (1)")
    first_dense = int(raw.get("first_k_dense_replace") or 0)
    return MoEConfig(
        num_experts=int(raw.get("n_routed_experts") or raw["num_local_experts"]),
        top_k=int(raw["num_experts_per_tok"]),
        intermediate_size=int(raw["moe_intermediate_size"]),
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        scoring="sigmoid",
        num_groups=int(raw.get("n_group") or 1),
        topk_groups=int(raw.get("topk_group") or 1),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        num_shared_experts=int(raw.get("n_shared_experts") or 0),
        dense_layers=frozenset(range(min(first_dense, num_layers))),
    )
