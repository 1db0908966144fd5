"""Tiny random-weight Hugging Face checkpoints for tests, written with `transformers` itself.

Every architecture Hearth serves gets a factory here, so engine tests compare Hearth against the
same checkpoint loaded by `transformers` (the oracle).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

CHATML_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- 'You may call these tools:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    '{{- \'\\n</tools>\\nCall one as <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>\\n\' }}'
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set fn = call['function'] if call.get('function') else call %}"
    "{{- '<tool_call>{\"name\": \"' + fn['name'] + '\", \"arguments\": ' + "
    "(fn['arguments'] if fn['arguments'] is string else (fn['arguments'] | tojson)) + '}</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

ARCH_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
    "mistral": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": None},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"},
    # MoE families: 8 experts, 2 per token; a dense layer among the MoE ones.
    "qwen3_moe": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_hidden_layers": 3,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "mlp_only_layers": [1],
    },
    "deepseek_v3": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "num_hidden_layers": 3,
        "num_key_value_heads": 4,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "n_shared_experts": 1,
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1,
        "q_lora_rank": 24,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
    },
    # Gemma 3 (text): 2 sliding-window layers, then a full one, and a sliding one after it.
    "gemma3": {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "num_hidden_layers": 4,
        "head_dim": 16,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        "query_pre_attn_scalar": 24,
        "tie_word_embeddings": True,
        "rope_local_base_freq": 10000.0,
        "rope_theta": 1000000.0,
    },
    "glm4_moe": {
        "architectures": ["Glm4MoeForCausalLM"],
        "model_type": "glm4_moe",
        "num_hidden_layers": 3,
        "head_dim": 32,
        "attention_bias": True,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "n_shared_experts": 1,
        "n_group": 2,
        "topk_group": 1,
        "routed_scaling_factor": 1.5,
        "first_k_dense_replace": 1,
    },
}


def _corpus() -> list[str]:
    import inspect
    import json as json_mod
    import textwrap

    texts = []
    for module in (os, json_mod, inspect, textwrap):
        texts.append(inspect.getsource(module)[:60_000])
    texts.append("Hello world! The quick brown fox jumps over the lazy dog. " * 20)
    return texts


def write_tokenizer(path: Path, vocab_size: int = 512) -> int:
    """Train a byte-level BPE tokenizer and write tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "unk_token": None,
                "model_max_length": 2048,
                "chat_template": CHATML_TEMPLATE,
            },
            indent=2,
        )
    )
    return tokenizer.get_vocab_size()


_TOKENIZER_CACHE: dict[int, Path] = {}


def make_tiny_model(path: str | os.PathLike, arch: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """Write a random-weight checkpoint of `arch` (a key of `ARCH_CONFIGS`) into `path`."""
    import shutil

    import torch
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab_size = overrides.pop("tokenizer_vocab_size", 512)
    weights_dtype = overrides.pop("weights_dtype", "float32")  # "bfloat16": a bf16 checkpoint
    cached = _TOKENIZER_CACHE.get(vocab_size)
    if cached is not None and (cached / "tokenizer.json").exists():
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(cached / name, path / name)
        actual_vocab = vocab_size
    else:
        actual_vocab = write_tokenizer(path, vocab_size)
        _TOKENIZER_CACHE[vocab_size] = path
    tok = json.loads((path / "tokenizer.json").read_text())
    eos_id = next(t["id"] for t in tok["added_tokens"] if t["content"] == "<|im_end|>")

    base: dict[str, Any] = {
        "vocab_size": actual_vocab,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "eos_token_id": eos_id,
        "bos_token_id": None,
        "pad_token_id": None,
        "torch_dtype": "float32",
    }
    base.update(ARCH_CONFIGS[arch])
    if arch == "qwen2":
        base["attention_bias"] = True
    base.update(overrides)
    model_type = base["model_type"]
    config_cls = transformers.AutoConfig.for_model(model_type).__class__
    config = config_cls(**{k: v for k, v in base.items() if k not in ("model_type",)})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        # Larger-than-default weights make the logits spread out, so greedy ties are rare.
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.08)
            elif "bias" in str(param):
                param.normal_(0.0, 0.05)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # zeros by default: give the bias a say in routing
                buffer.normal_(0.0, 0.1)
    if weights_dtype != "float32":
        model.to(getattr(torch, weights_dtype))
    model.save_pretrained(path, safe_serialization=True)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_id}))
    return path
