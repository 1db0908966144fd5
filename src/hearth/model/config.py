"""The model's shape, read from a Hugging Face `config.json` and checked once, with errors that say what to fix."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hearth.model.registry import get_model_class, supported_architectures

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


class ModelLoadError(Exception):
    """A checkpoint that cannot be served; the message is one line that names the problem."""


@dataclass(frozen=True)
class MoEConfig:
    """The mixture-of-experts MLP of an MoE family (`hearth.model.moe`).

    `scoring` "softmax": top-k of the softmax of the router logits (Qwen3-MoE); "sigmoid": DeepSeek-V3's
    grouped routing (sigmoid scores, plus `e_score_correction_bias` for the choice only; the `topk_group`
    best of `num_groups` groups by their two best scores; top-k within them). `dense_layers` are the
    layers that keep the dense MLP (`intermediate_size`) instead.
    """

    num_experts: int
    top_k: int
    intermediate_size: int  # per expert
    norm_topk_prob: bool
    scoring: str = "softmax"
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    num_shared_experts: int = 0  # their MLP is num_shared_experts * intermediate_size wide
    dense_layers: frozenset[int] = frozenset()


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): the KV cache holds, per token, the
    `kv_lora_rank` latent and the `qk_rope_head_dim` rotated key shared by all heads."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values the KV cache holds per token and layer."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict[str, Any] = field(default_factory=dict)  # rope_type plus its parameters
    tie_word_embeddings: bool = False
    # What the architecture decides (its `config_fields` in hearth.model.models.*):
    attention_bias: bool = False  # on q/k/v
    attention_out_bias: bool = False  # on o_proj
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    hidden_act: str = "silu"
    checkpoint_dtype: str = "float32"
    eos_token_ids: tuple[int, ...] = ()
    # MoE and MLA families (`hearth.model.models.{qwen3_moe,deepseek_v3,glm4_moe}`):
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None
    rotary_dim: int | None = None  # the rotated dims of each head when not all of them (None: head_dim)
    # Per-layer attention kinds (transformers' `layer_types`): "full_attention", "sliding_attention" (the last
    # `sliding_window` positions), "chunked_attention" (`attention_chunk_size`-token chunks). Empty: every
    # layer full, or windowed when `sliding_window` is set.
    layer_types: tuple[str, ...] = ()
    attention_chunk_size: int | None = None
    no_rope_layers: frozenset[int] = frozenset()  # layers whose queries and keys are not rotated (NoPE)
    rope_local_theta: float | None = None  # the sliding layers' own rotary base (Gemma 3)
    query_pre_attn_scalar: float | None = None  # attention scale: 1/sqrt(this), not 1/sqrt(head_dim) (Gemma)

    def layer_attention(self, layer: int) -> tuple[int | None, int | None]:
        """(sliding window, chunk size) of decoder layer `layer`'s attention; (None, None) for full attention."""
        if not self.layer_types:
            return self.sliding_window, None
        kind = self.layer_types[layer]
        if kind == "sliding_attention":
            return self.sliding_window, None
        if kind == "chunked_attention":
            return None, self.attention_chunk_size
        return None, None

    @property
    def rotary_size(self) -> int:
        """Dims of a head that rotary embedding rotates (the cos/sin table's width)."""
        return self.rotary_dim or self.head_dim

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        """From `model_dir/config.json`, or from the metadata of a GGUF file when `model_dir` is one."""
        from hearth.model.gguf_file import GGUFCheckpoint, is_gguf_path

        if is_gguf_path(model_dir):
            return cls.from_dict(GGUFCheckpoint(model_dir).hf_config(), source=str(model_dir))
        path = Path(model_dir) / "config.json"
        if not Path(model_dir).is_dir():
            raise ModelLoadError(f"model directory {model_dir} does not exist")
        if not path.is_file():
            raise ModelLoadError(f"{path} is missing: a Hugging Face checkpoint directory needs config.json")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
        if not isinstance(raw, dict):
            raise ModelLoadError(f"{path} must hold a JSON object")
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        architectures = raw.get("architectures") or []
        arch = architectures[0] if architectures else None
        if arch not in supported_architectures():
            raise ModelLoadError(
                f"{source}: architecture {arch!r} is not supported; supported: {', '.join(supported_architectures())}"
            )
        model_class = get_model_class(arch)

        def need(key: str, kind: type = int) -> Any:
            value = raw.get(key)
            if value is None or isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ModelLoadError(f"{source}: {key!r} must be a positive number, got {value!r}")
            return kind(value)

        hidden_size = need("hidden_size")
        num_heads = need("num_attention_heads")
        num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv_heads:
            raise ModelLoadError(
                f"{source}: num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}"
            )
        head_dim = raw.get("head_dim") or hidden_size // num_heads
        rope_theta, rope_scaling = _rope_parameters(raw, source)
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        # Gemma's configs call it hidden_activation.
        hidden_act = raw.get("hidden_act") or raw.get("hidden_activation") or "silu"
        if hidden_act not in ("silu", "gelu", "gelu_pytorch_tanh"):
            raise ModelLoadError(f"{source}: hidden_act {hidden_act!r} is not supported (silu, gelu)")
        return cls(
            architecture=arch,
            vocab_size=need("vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=need("intermediate_size"),
            num_layers=need("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            hidden_act=hidden_act,
            checkpoint_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            eos_token_ids=eos_ids,
            **model_class.config_fields(raw, source),
        )


def _rope_parameters(raw: dict[str, Any], source: str) -> tuple[float, dict[str, Any]]:
    # transformers 5 writes `rope_parameters` (theta inside); older checkpoints use rope_theta + rope_scaling.
    params = dict(raw.get("rope_parameters") or {})
    if isinstance(params.get("full_attention"), dict):  # per layer type (Gemma 3): the global layers' here
        params = dict(params["full_attention"])
    legacy = raw.get("rope_scaling") or {}
    if legacy:
        params = {**legacy, **params}
    theta = float(params.pop("rope_theta", None) or raw.get("rope_theta") or 10000.0)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"{source}: rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type != "default" and rope_type != "dynamic" and "factor" not in params and rope_type != "yarn":
        raise ModelLoadError(f"{source}: rope scaling {rope_type!r} needs a 'factor'")
    if rope_type in ("llama3", "yarn"):
        params.setdefault("original_max_position_embeddings", raw.get("max_position_embeddings", 4096))
    params["rope_type"] = rope_type
    return theta, params
