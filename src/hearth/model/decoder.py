"""The Llama-family causal LM (Llama, Mistral, Qwen2, Qwen3): one module, switched by the config's flags."""

from __future__ import annotations

import torch
from torch import nn

from hearth.model.config import ModelConfig
from hearth.model.layers import DecoderLayer, Linear, RMSNorm
from hearth.model.rotary import build_cos_sin_table
from hearth.ops.attention import AttentionContext
from hearth.ops.linear import LinearWeights, linear, prepare_linear_weights


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # An explicit (uninitialised) weight skips Embedding's random init: on the meta device that init
        # goes through torch._refs, whose first import costs ~2.5 s of startup.
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size, _weight=torch.empty(config.vocab_size, config.hidden_size)
        )
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """Knows nothing of requests: token ids, positions and one attention context in; logits out."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Built where the model is built on the meta device (the loader), the table would come out of
        # torch._refs, whose first import costs ~2.5 s of startup; real devices compute it here.
        on_meta = torch.empty(0).device.type == "meta"
        table = (
            torch.empty(max_positions, config.head_dim)
            if on_meta
            else build_cos_sin_table(config, max_positions)
        )
        self.register_buffer("cos_sin", table, persistent=False)
        self.lm_head_weights: LinearWeights | None = None

    def prepare_for_inference(self) -> None:
        """Called once the weights are loaded: lay weights out for the CPU's fast paths
        (`hearth.ops.linear`). The LM head, the largest matrix, also gets the one-row GEMV layout
        when it has no bf16 copy; its `[vocab, hidden]` weight stays (it may be the embedding)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepare_for_inference()
        if self.lm_head.weight.device.type == "cpu":
            self.lm_head_weights = prepare_linear_weights(self.lm_head.weight, gemv_layout=True)

    def _lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head_weights is not None:
            return linear(hidden, self.lm_head_weights, None)
        return self.lm_head(hidden)

    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: AttentionContext,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Returns float32 logits for the rows in `logits_indices` only (the tokens that get sampled)."""
        hidden = self.model.embed_tokens(token_ids)
        cos, sin = self.cos_sin[positions].to(hidden.dtype).chunk(2, dim=-1)
        residual = None
        kv_pool = ctx.kv_pool
        for index, layer in enumerate(self.model.layers):
            hidden, residual = layer(hidden, residual, cos, sin, kv_pool.layer(index), ctx)
        hidden = hidden[logits_indices]
        hidden = (
            self.model.norm(hidden)
            if residual is None
            else self.model.norm.add_and_norm(hidden, residual[logits_indices])[0]
        )
        return self._lm_head(hidden).float()
