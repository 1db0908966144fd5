"""DeepSeek-V3 (and Kimi K2, which ships this architecture name): multi-head latent attention over the
latent KV pool (`hearth.model.mla`), and the MoE with sigmoid grouped routing, a correction bias, shared
experts and the first `first_k_dense_replace` layers dense (`hearth.model.moe`). The checkpoint's
multi-token-prediction layers (past `num_hidden_layers`) are not loaded."""

from __future__ import annotations

from typing import Any, ClassVar

from torch import nn

from hearth.model.config import MLAConfig, ModelLoadError
from hearth.model.mla import MLAttention
from hearth.model.moe import MoECausalLM, MoEDecoderLayer, sigmoid_moe_config
from hearth.model.weights import ShardId


class DeepseekV3DecoderLayer(MoEDecoderLayer):
    attention_class: ClassVar[type[nn.Module]] = MLAttention


class DeepseekV3ForCausalLM(MoECausalLM):
    layer_class: ClassVar[type[nn.Module]] = DeepseekV3DecoderLayer
    # MLA's `q_proj` (no query compression) is its own matrix: only the MLPs' gate/up are fused.
    packed_modules: ClassVar[dict[str, tuple[str, ShardId]]] = {
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    @classmethod
    def config_fields(cls, raw: dict[str, Any], source: str) -> dict[str, Any]:
        num_layers = int(raw.get("num_hidden_layers") or 0)
        try:
            q_lora_rank = raw.get("q_lora_rank")
            mla = MLAConfig(
                q_lora_rank=int(q_lora_rank) if q_lora_rank else None,
                kv_lora_rank=int(raw["kv_lora_rank"]),
                qk_nope_head_dim=int(raw["qk_nope_head_dim"]),
                qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
                v_head_dim=int(raw["v_head_dim"]),
                rope_interleave=bool(raw.get("rope_interleave", True)),
            )
        except KeyError as exc:
            raise ModelLoadError(f"{source}: MLA needs {exc.args[0]!r}") from None
        attention_bias = bool(raw.get("attention_bias", False))
        return {
            "attention_bias": attention_bias,
            "attention_out_bias": attention_bias,
            "rotary_dim": mla.qk_rope_head_dim,
            "mla": mla,
            "moe": sigmoid_moe_config(raw, source, num_layers),
        }

    def prepare_for_inference(self) -> None:
        for module in self.modules():
            if isinstance(module, MLAttention):
                module.absorb_weights()
        super().prepare_for_inference()
