"""The Llama-family causal LM, the base the architectures in `hearth.model.models` subclass: each
declares what differs (config fields such as biases, qk-norm and the sliding window; the checkpoint's
tensor names; the decoder layer class)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from hearth.model.config import ModelConfig
from hearth.model.fused_decode import DecodeStackRunner
from hearth.model.fused_decode import enabled as fused_decode_enabled
from hearth.model.layers import DecoderLayer, LayerOptions, Linear, RMSNorm
from hearth.model.rotary import build_cos_sin_table
from hearth.model.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from hearth.model.weights import ShardId
from hearth.ops.attention import AttentionContext
from hearth.ops.cpu_kernels import decode_stack_classes
from hearth.ops.linear import LinearWeights, linear, prepare_linear_weights
from hearth.parallel.state import recv_from_previous_stage, send_to_next_stage


class MissingLayer(nn.Module):
    """A module another pipeline stage holds: no parameters here, and the loader skips its tensors."""

    def forward(self, *args: Any) -> Any:
        raise RuntimeError("this module runs on another pipeline stage")


class DecoderModel(nn.Module):
    """The embedding, the decoder layers and the final norm; a pipeline stage (`options.layers`) holds
    its layers only, the embedding on the first stage (and on the last when the LM head is tied to it),
    the norm on the last: the others are `MissingLayer`s.

    `layer_index` attributes inside the layers index the KV pool, which holds this stage's layers only:
    they are local to the stage (global index minus `first_layer`)."""

    def __init__(
        self,
        config: ModelConfig,
        options: LayerOptions | None = None,
        layer_class: type[nn.Module] = DecoderLayer,
    ) -> None:
        super().__init__()
        options = options or LayerOptions()
        stage = options.layers if options.layers is not None else range(config.num_layers)
        self.first_layer, self.end_layer = stage.start, stage.stop
        self.is_first_stage = stage.start == 0
        self.is_last_stage = stage.stop == config.num_layers
        self.embed_tokens: nn.Module = (
            VocabParallelEmbedding(config.vocab_size, config.hidden_size, options.tp)
            if self.is_first_stage or (self.is_last_stage and config.tie_word_embeddings)
            else MissingLayer()
        )
        self.layers = nn.ModuleList(
            layer_class(config, i, options) if i in stage else MissingLayer()
            for i in range(config.num_layers)
        )
        if stage.start:
            for i in stage:
                for module in self.layers[i].modules():
                    if getattr(module, "layer_index", None) == i:
                        module.layer_index = i - stage.start
        self.norm: nn.Module = (
            RMSNorm(config.hidden_size, config.rms_norm_eps) if self.is_last_stage else MissingLayer()
        )


class CausalLM(nn.Module):
    """Knows nothing of requests: token ids, positions and one attention context in; logits out.

    Across tensor-parallel ranks (`options.tp`) the attention and MLP projections are sharded by
    heads / intermediate features, the embedding and LM head by vocabulary rows, the norms replicated.
    A pipeline stage (`options.layers`) holds its own layers: the first embeds, the others receive the
    residual stream from the stage before; the last returns logits, the others send the stream on and
    return None.
    """

    # Checkpoint module name -> (our fused module, its part): q/k/v and gate/up load into one matrix each.
    packed_modules: ClassVar[dict[str, tuple[str, ShardId]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    # Checkpoint tensors we do not load (computed here instead).
    ignored_suffixes: ClassVar[tuple[str, ...]] = ("rotary_emb.inv_freq",)
    layer_class: ClassVar[type[nn.Module]] = DecoderLayer

    @classmethod
    def config_fields(cls, raw: dict[str, Any], source: str) -> dict[str, Any]:
        """The `ModelConfig` fields this architecture reads its own way from config.json (biases,
        qk-norm, the sliding window); the base has none of them. Raise ModelLoadError for values it
        cannot serve."""
        return {}

    def __init__(self, config: ModelConfig, max_positions: int, options: LayerOptions | None = None) -> None:
        super().__init__()
        self.config = config
        options = options or LayerOptions()
        self.model = DecoderModel(config, options, type(self).layer_class)
        self.dtype = torch.get_default_dtype()  # of the activations sent between pipeline stages
        self.lm_head: nn.Module = (
            ParallelLMHead(config.vocab_size, config.hidden_size, options.tp)
            if self.model.is_last_stage
            else MissingLayer()
        )
        if config.tie_word_embeddings and self.model.is_last_stage:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Built where the model is built on the meta device (the loader), the table would come out of
        # torch._refs, whose first import costs ~2.5 s of startup; real devices compute it here.
        on_meta = torch.empty(0).device.type == "meta"
        table = (
            torch.empty(max_positions, config.rotary_size)
            if on_meta
            else type(self).rotary_table(config, max_positions)
        )
        self.register_buffer("cos_sin", table, persistent=False)
        self.lm_head_weights: LinearWeights | None = None
        self.quant_method = options.quant_method if options is not None else None
        # `Int4Weights` or `Int8Weights` (`hearth.ops`) when the quantization method quantizes the head too.
        self.lm_head_quantized: Any = None
        # EAGLE-3 (`hearth.model.eagle3`): the residual stream entering these layers (num_layers: leaving the
        # last) is kept, concatenated in this order, in `aux_hidden` `[tokens, len * hidden]` after each forward.
        self.aux_hidden_layers: tuple[int, ...] = ()
        self.aux_hidden: torch.Tensor | None = None
        # `hearth.model.fused_decode`: None until tried, False where this model cannot use it.
        self._decode_stack_runner: DecodeStackRunner | None | bool = None
        self.embed_scale: float | None = None

    @classmethod
    def rotary_table(cls, config: ModelConfig, max_positions: int) -> torch.Tensor:
        """The float32 cos/sin table `forward` indexes by position (`rotary.build_cos_sin_table`); a family
        with two schedules (Gemma 3's local and global layers) lays both out in it."""
        return build_cos_sin_table(config, max_positions)

    def checkpoint_target(self, name: str) -> tuple[str, ShardId | None] | None:
        """The parameter (and part of it, for a fused one) that checkpoint tensor `name` loads into;
        None for a tensor that is not loaded."""
        if name.endswith(self.ignored_suffixes):
            return None
        if self.config.tie_word_embeddings and name == "lm_head.weight":
            return None  # the head is the embedding, as in transformers
        for part, (fused, shard) in self.packed_modules.items():
            marker = f".{part}."
            if marker in name:
                return name.replace(marker, f".{fused}."), shard
        return name, None

    def checkpoint_name(self, param_name: str, shard: ShardId | None) -> str:
        """The checkpoint tensor that fills `param_name` (part `shard`): the inverse of `checkpoint_target`."""
        if shard is not None:
            for part, (fused, part_shard) in self.packed_modules.items():
                marker = f".{fused}."
                if part_shard == shard and marker in param_name:
                    return param_name.replace(marker, f".{part}.")
        return param_name

    def prepare_for_inference(self) -> None:
        """Called once the weights are loaded: each linear layer's quantization method processes its
        weights (on CPU: the fast paths' layouts, `hearth.ops.linear`). On CPU the LM head, the
        largest matrix, gets those layouts too, plus the one-row GEMV layout when it has no bf16
        copy; its `[vocab, hidden]` weight stays (it may be the embedding)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.quant_method.process_after_loading(module)
        quantize_head = getattr(self.quant_method, "quantize_lm_head", None)
        if quantize_head is not None and self.model.is_last_stage:
            # `--quantization int4`, a GGUF's own blocks: the head is the largest matrix of a small model.
            self.lm_head_quantized = quantize_head(self.lm_head.weight)
        if (
            self.lm_head_quantized is None
            and self.model.is_last_stage
            and self.lm_head.weight.device.type == "cpu"
        ):
            self.lm_head_weights = prepare_linear_weights(self.lm_head.weight, gemv_layout=True)

    def _lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head_quantized is not None:
            from hearth.ops.int4 import int4_linear
            from hearth.ops.int8 import Int8Weights, int8_linear

            if isinstance(self.lm_head_quantized, Int8Weights):
                return int8_linear(hidden, self.lm_head_quantized, None)
            return int4_linear(hidden, self.lm_head_quantized, None)
        if self.lm_head_weights is not None:
            return self.lm_head.gather(linear(hidden, self.lm_head_weights, None))
        return self.lm_head(hidden)

    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: AttentionContext,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor | None:
        """Returns float32 logits for the rows in `logits_indices` only (the tokens that get sampled);
        None on a pipeline stage other than the last."""
        model = self.model
        if model.is_first_stage:
            hidden = model.embed_tokens(token_ids)
            if self.embed_scale is not None:  # Gemma: the embedding times sqrt(hidden), in the model's dtype
                hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
            residual = None
        else:  # the residual stream after the stage before (its last layer's output added in)
            hidden = recv_from_previous_stage(
                (token_ids.shape[0], self.config.hidden_size), self.dtype, token_ids.device
            )
            residual = None
        cos, sin = self.cos_sin[positions].to(hidden.dtype).chunk(2, dim=-1)
        kv_pool = ctx.kv_pool
        first = model.first_layer
        aux_layers = self.aux_hidden_layers
        captured: dict[int, torch.Tensor] = {}
        last_rows = self._last_layer_rows(logits_indices, token_ids.shape[0])
        stack = None if aux_layers else self._decode_stack(ctx, hidden, cos, logits_indices)
        if stack is not None:
            hidden, residual = stack.run(hidden, cos, sin, ctx)
        for index in range(first, model.end_layer) if stack is None else ():
            if aux_layers and index in aux_layers:  # a copy: the fused norms update the stream in place
                captured[index] = hidden.clone() if residual is None else hidden + residual
            layer, layer_kv = model.layers[index], kv_pool.layer(index - first)
            if last_rows is not None and index == model.end_layer - 1:
                hidden, residual = layer(hidden, residual, cos, sin, layer_kv, ctx, rows=last_rows)
            else:
                hidden, residual = layer(hidden, residual, cos, sin, layer_kv, ctx)
        if aux_layers:
            if model.end_layer in aux_layers:
                captured[model.end_layer] = hidden if residual is None else hidden + residual
            self.aux_hidden = torch.cat([captured[i] for i in aux_layers], dim=-1)
        if not model.is_last_stage:
            # One tensor, not two: the next layer's norm needs only the sum, the same add it would do.
            send_to_next_stage(hidden if residual is None else hidden + residual)
            return None
        if last_rows is None:
            hidden = hidden[logits_indices]
            residual = None if residual is None else residual[logits_indices]
        hidden = model.norm(hidden) if residual is None else model.norm.add_and_norm(hidden, residual)[0]
        return self._lm_head(hidden).float()

    def _decode_stack(
        self, ctx: AttentionContext, hidden: torch.Tensor, cos: torch.Tensor, logits_indices: torch.Tensor
    ) -> DecodeStackRunner | None:
        """The compiled all-layers decode (`hearth.model.fused_decode`) when this step qualifies; built on
        the first CPU decode step once the kernels are ready (and rebuilt for another KV pool)."""
        if hidden.device.type != "cpu" or not fused_decode_enabled():
            return None
        runner = self._decode_stack_runner
        if runner is False:
            return None
        if runner is None or runner.kv_pool is not ctx.kv_pool:
            runner = DecodeStackRunner.build(self.model, ctx.kv_pool)
            if runner is None:
                # Not this model's shape, or no kernels yet (tried again once they are built).
                self._decode_stack_runner = False if decode_stack_classes() is not None else None
                return None
            self._decode_stack_runner = runner
        return runner if runner.applies(ctx, hidden, cos, logits_indices.shape[0]) else None

    def _last_layer_rows(self, logits_indices: torch.Tensor, num_rows: int) -> torch.Tensor | None:
        """The rows the last layer must finish, when it may skip the others: in a prefill most rows only
        write KV, so the last layer's MLP (most of a layer's work) runs for the sampled rows alone. None
        where every row is needed: other stages, a captured final stream (EAGLE-3), decode-only steps,
        and layer classes with a forward of their own."""
        model = self.model
        if not model.is_last_stage or logits_indices.shape[0] >= num_rows:
            return None
        if self.aux_hidden_layers and model.end_layer in self.aux_hidden_layers:
            return None
        if type(model.layers[model.end_layer - 1]).forward is not DecoderLayer.forward:
            return None
        return logits_indices
