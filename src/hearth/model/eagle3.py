"""The EAGLE-3 draft head (Li et al. 2025), in the published checkpoint layout.

A head is one decoder layer that runs beside a target model. At position p it reads the embedding of
token p+1 and a hidden vector, and predicts token p+2 over a reduced "draft" vocabulary:

- the hidden vector comes from the target: `fc` maps the concatenation of three of the target's
  residual-stream vectors at p (a low, a middle and a high layer: `eagle_aux_hidden_state_layer_ids`)
  from 3 x target hidden to hidden; when the head chains its own guesses, the hidden vector is instead the
  head's own output at the position before (pre-norm), which is already `hidden` wide;
- `midlayer` is a Llama decoder layer whose attention reads `concat(input_layernorm(embedding),
  hidden_norm(hidden))`, so its q/k/v projections take 2 x hidden inputs; the residual around the
  attention is the hidden vector (before `hidden_norm`, unless `norm_before_residual`);
- `norm` and `lm_head` give logits over `draft_vocab_size` ids; draft id d is target id `d + d2t[d]`
  (`t2d` is the inverse, a mask over the target vocabulary, kept for completeness).

Checkpoint tensors (safetensors): `fc.weight`, `midlayer.{input_layernorm,hidden_norm,
post_attention_layernorm}.weight`, `midlayer.self_attn.{q,k,v,o}_proj.weight`,
`midlayer.mlp.{gate,up,down}_proj.weight`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d`, and optionally
`embed_tokens.weight` (absent: the head shares the target's embedding). config.json is a Llama config with
`draft_vocab_size`, optionally `target_hidden_size`, and the aux layer ids at the top level or in
`eagle_config`. Aux layer id j names the residual stream entering target layer j (0 = the embedding), as
in vLLM; Hearth also accepts j = num_layers (the stream after the last layer, before the final norm), which
vLLM's capture would not produce.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hearth.model.config import ModelConfig, ModelLoadError
from hearth.model.layers import MLP, Attention, LayerOptions, Linear, QKVParallelLinear, RMSNorm
from hearth.model.rotary import build_cos_sin_table
from hearth.ops.attention import AttentionContext


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    target_hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any]
    vocab_size: int  # the target's
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]
    max_position_embeddings: int = 4096
    norm_before_residual: bool = False
    attention_bias: bool = False
    hidden_act: str = "silu"
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @staticmethod
    def default_aux_layer_ids(num_target_layers: int) -> tuple[int, ...]:
        """vLLM's default choice (low, middle, high) when a checkpoint names none."""
        return (2, num_target_layers // 2, num_target_layers - 3)

    @classmethod
    def from_dir(cls, head_dir: str | Path, num_target_layers: int) -> Eagle3Config:
        path = Path(head_dir) / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"{path} is missing: an EAGLE-3 head directory needs config.json")
        return cls.from_dict(json.loads(path.read_text()), num_target_layers, str(path))

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], num_target_layers: int, source: str = "config.json"
    ) -> Eagle3Config:
        from hearth.model.config import _rope_parameters

        def need(key: str) -> int:
            value = raw.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ModelLoadError(f"{source}: {key!r} must be a positive integer, got {value!r}")
            return value

        if raw.get("num_hidden_layers", 1) != 1:
            raise ModelLoadError(
                f"{source}: an EAGLE-3 head has one decoder layer, not {raw['num_hidden_layers']}"
            )
        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        eagle_config = raw.get("eagle_config") or {}
        if eagle_config.get("use_aux_hidden_state", True) is False:
            raise ModelLoadError(
                f"{source}: heads without aux hidden states (EAGLE-1/2 style) are not supported"
            )
        ids = raw.get("eagle_aux_hidden_state_layer_ids") or eagle_config.get(
            "eagle_aux_hidden_state_layer_ids"
        )
        aux = tuple(int(i) for i in ids) if ids else cls.default_aux_layer_ids(num_target_layers)
        if len(aux) != 3 or not all(0 <= i <= num_target_layers for i in aux):
            raise ModelLoadError(
                f"{source}: need three aux hidden state layer ids in [0, {num_target_layers}] "
                f"(the target has {num_target_layers} layers), got {list(aux)}"
            )
        rope_theta, rope_scaling = _rope_parameters(raw, source)
        return cls(
            hidden_size=hidden,
            target_hidden_size=int(raw.get("target_hidden_size") or hidden),
            intermediate_size=need("intermediate_size"),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            vocab_size=need("vocab_size"),
            draft_vocab_size=int(raw.get("draft_vocab_size") or raw["vocab_size"]),
            aux_layer_ids=aux,
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            norm_before_residual=bool(raw.get("norm_before_residual", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            hidden_act=str(raw.get("hidden_act", "silu")),
            raw=raw,
        )

    def layer_config(self) -> ModelConfig:
        """The midlayer's shapes as a `ModelConfig` (what hearth's Attention and MLP are built from)."""
        return ModelConfig(
            architecture="LlamaForCausalLM",
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_layers=1,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            attention_bias=self.attention_bias,
            hidden_act=self.hidden_act,
        )


class Eagle3MidLayer(nn.Module):
    def __init__(self, config: Eagle3Config, options: LayerOptions) -> None:
        super().__init__()
        layer_config = config.layer_config()
        self.self_attn = Attention(layer_config, 0, options)
        # The attention reads [embedding; hidden]: twice as wide as the target's.
        self.self_attn.qkv_proj = QKVParallelLinear(
            2 * config.hidden_size,
            config.head_dim,
            config.num_heads,
            config.num_kv_heads,
            bias=config.attention_bias,
            options=options,
        )
        self.mlp = MLP(layer_config, options)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm_before_residual = config.norm_before_residual

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        ctx: AttentionContext,
    ) -> torch.Tensor:
        """The residual stream after the layer (pre-norm), `[tokens, hidden]`."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        x = self.self_attn(x, cos, sin, kv, ctx)
        x, residual = self.post_attention_layernorm.add_and_norm(x, residual)
        return self.mlp(x) + residual


class Eagle3Head(nn.Module):
    """The head for inference through Hearth's paged attention (its KV pool holds one layer)."""

    def __init__(self, config: Eagle3Config, max_positions: int, embed_tokens: nn.Module | None) -> None:
        super().__init__()
        self.config = config
        options = LayerOptions()
        self.fc = Linear(3 * config.target_hidden_size, config.hidden_size, False, options)
        self.midlayer = Eagle3MidLayer(config, options)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.draft_vocab_size, False, options)
        self.embed_tokens = embed_tokens  # None until loaded: its own, or the target's
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long), persistent=False)
        self.register_buffer(
            "cos_sin", build_cos_sin_table(config.layer_config(), max_positions), persistent=False
        )

    def combine(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """The target's three concatenated hidden vectors -> the head's hidden vector."""
        return self.fc(aux_hidden)

    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        ctx: AttentionContext,
        logits_indices: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`hidden` `[tokens, hidden]` (fc(target aux) or the head's own previous output). Returns, at
        `logits_indices`, the greedy guess as target token ids and the pre-norm output (to chain on)."""
        assert self.embed_tokens is not None
        embeds = self.embed_tokens(token_ids).to(hidden.dtype)
        cos, sin = self.cos_sin[positions].to(hidden.dtype).chunk(2, dim=-1)
        out = self.midlayer(embeds, hidden, cos, sin, ctx.kv_pool.layer(0), ctx)[logits_indices]
        logits = self.lm_head(self.norm(out))
        draft_ids = logits.argmax(dim=-1)
        return draft_ids + self.d2t[draft_ids], out


def _checkpoint_name(name: str) -> str:
    """Published heads differ in prefixes: `model.` (speculators), `layers.0.` for the midlayer."""
    name = name.removeprefix("model.")
    return "midlayer." + name.removeprefix("layers.0.") if name.startswith("layers.0.") else name


def load_eagle3_head(
    head_dir: str | Path,
    config: Eagle3Config,
    target_embed_tokens: nn.Module,
    dtype: torch.dtype,
    max_positions: int,
    device: torch.device,
) -> Eagle3Head:
    """The head with its checkpoint's weights, processed for inference (CPU fast-path layouts)."""
    from safetensors.torch import load_file

    files = sorted(Path(head_dir).glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{head_dir}: no *.safetensors files (an EAGLE-3 head checkpoint)")
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        tensors.update({_checkpoint_name(k): v for k, v in load_file(str(path)).items()})
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            head = Eagle3Head(config, max_positions, None)
    finally:
        torch.set_default_dtype(previous)
    packed = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}  # fmt: skip
    params = dict(head.named_parameters())
    filled: set[tuple[str, object]] = set()
    embed = None
    with torch.no_grad():
        for name, tensor in tensors.items():
            if name == "d2t":
                head.d2t.copy_(tensor.to(torch.long))
                filled.add(("d2t", None))
                continue
            if name == "t2d":
                continue  # the inverse map: nothing at inference needs it
            if name == "embed_tokens.weight":
                embed = nn.Embedding.from_pretrained(tensor.to(dtype=dtype, device=device), freeze=True)
                continue
            shard: object = None
            for part, (fused, part_shard) in packed.items():
                if f".{part}." in name:
                    name, shard = name.replace(f".{part}.", f".{fused}."), part_shard
            param = params.get(name)
            if param is None:
                raise ModelLoadError(f"{head_dir}: unexpected tensor {name!r} for an EAGLE-3 head")
            loader = getattr(param, "weight_loader", None)
            if loader is not None:
                loader(param, tensor.to(dtype), shard)
            else:
                if tuple(param.shape) != tuple(tensor.shape):
                    raise ModelLoadError(
                        f"{head_dir}: {name} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
                    )
                param.data.copy_(tensor.to(param.dtype))
            filled.add((name, shard))
    expected = {("d2t", None)} | {
        (n, s) for n, p in params.items() for s in (getattr(p, "shard_ids", None) or (None,))
    }
    missing = sorted(f"{n}[{s}]" if s is not None else n for n, s in expected - filled)
    if missing:
        raise ModelLoadError(f"{head_dir}: the EAGLE-3 checkpoint lacks {', '.join(missing)}")
    head.embed_tokens = embed if embed is not None else target_embed_tokens
    head.eval()
    for module in head.modules():
        if isinstance(module, Linear):
            module.quant_method.process_after_loading(module)
    return head
