"""The model registry: each Hugging Face architecture name is served by its own class, which reads
the config fields it decides (biases, qk-norm, sliding window); unknown names fail with the list."""

from __future__ import annotations

import pytest
from hf_oracle import hf_greedy

from hearth import LLM, SamplingParams
from hearth.contracts.registry import UnknownNameError
from hearth.model import registry
from hearth.model.config import ModelConfig, ModelLoadError
from hearth.model.decoder import CausalLM
from hearth.model.models.llama import LlamaForCausalLM
from hearth.model.models.mistral import MistralForCausalLM
from hearth.model.models.qwen2 import Qwen2ForCausalLM
from hearth.model.models.qwen3 import Qwen3ForCausalLM
from hearth.model.registry import get_model_class, register_model, supported_architectures

BASE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "vocab_size": 100,
}


def config(arch: str, **fields) -> ModelConfig:
    return ModelConfig.from_dict({"architectures": [arch], **BASE, **fields})


def test_each_architecture_has_its_own_class():
    assert supported_architectures() == (
        "DeepseekV3ForCausalLM",
        "Gemma3ForCausalLM",
        "Glm4MoeForCausalLM",
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
    )
    assert get_model_class("LlamaForCausalLM") is LlamaForCausalLM
    assert get_model_class("MistralForCausalLM") is MistralForCausalLM
    assert get_model_class("Qwen2ForCausalLM") is Qwen2ForCausalLM
    assert get_model_class("Qwen3ForCausalLM") is Qwen3ForCausalLM
    assert all(issubclass(get_model_class(name), CausalLM) for name in supported_architectures())


def test_unknown_architecture_names_the_supported_ones():
    with pytest.raises(
        UnknownNameError,
        match="unknown model architecture 'GPT2LMHeadModel'; choose one of DeepseekV3ForCausalLM, Gemma3",
    ):
        get_model_class("GPT2LMHeadModel")
    with pytest.raises(
        ModelLoadError, match="'GPT2LMHeadModel' is not supported; supported: DeepseekV3ForCausalLM, Gemma3"
    ):
        config("GPT2LMHeadModel")


def test_a_new_family_is_one_registered_class(monkeypatch):
    monkeypatch.setattr(registry, "MODELS", registry.MODELS.copy())

    @register_model("TinyNormForCausalLM", "TinyNormV2ForCausalLM")
    class TinyNorm(CausalLM):
        @classmethod
        def config_fields(cls, raw, source):
            return {"qk_norm": True, "sliding_window": raw["window"]}

    assert get_model_class("TinyNormV2ForCausalLM") is TinyNorm
    parsed = config("TinyNormForCausalLM", window=7)
    assert (parsed.qk_norm, parsed.sliding_window) == (True, 7)
    with pytest.raises(ValueError, match="model architecture 'LlamaForCausalLM' is already registered"):
        register_model("LlamaForCausalLM")(TinyNorm)


def test_architectures_read_their_own_config_fields():
    llama = config("LlamaForCausalLM", attention_bias=True, mlp_bias=True, sliding_window=16)
    assert (llama.attention_bias, llama.attention_out_bias, llama.mlp_bias) == (True, True, True)
    assert llama.sliding_window is None and not llama.qk_norm  # Llama has no window, whatever the file says
    mistral = config("MistralForCausalLM", sliding_window=16)
    assert mistral.sliding_window == 16 and not mistral.attention_bias
    qwen2 = config("Qwen2ForCausalLM", sliding_window=16)  # use_sliding_window defaults to false
    assert qwen2.attention_bias and not qwen2.attention_out_bias and qwen2.sliding_window is None
    qwen3 = config("Qwen3ForCausalLM", sliding_window=16, attention_bias=False)
    assert qwen3.qk_norm and not qwen3.attention_bias and qwen3.sliding_window is None


def test_qwen_sliding_window_per_layer():
    window = dict(use_sliding_window=True, sliding_window=16)
    assert config("Qwen2ForCausalLM", **window, max_window_layers=0).sliding_window == 16
    assert config("Qwen3ForCausalLM", **window, max_window_layers=4).sliding_window is None
    assert config("Qwen3ForCausalLM", **window, layer_types=["sliding_attention"] * 4).sliding_window == 16
    mixed = config("Qwen2ForCausalLM", **window, max_window_layers=2)
    assert [mixed.layer_attention(i) for i in range(4)] == [(None, None)] * 2 + [(16, None)] * 2
    with pytest.raises(ModelLoadError, match="layer_types must name"):
        config("Qwen2ForCausalLM", **window, layer_types=["chunked_attention"] * 4)


@pytest.mark.parametrize(
    "arch,overrides",
    [("llama", {"attention_bias": True, "mlp_bias": True}), ("qwen3", {"attention_bias": True})],
    ids=["llama-biases", "qwen3-bias"],
)
def test_optional_biases_match_transformers(tiny_model_factory, arch, overrides):
    model_dir = tiny_model_factory(arch, **overrides)
    prompts = [[(13 * i + 7) % 500 for i in range(n)] for n in (11, 4)]
    results = LLM(str(model_dir), dtype="float32").generate(
        prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    )
    for prompt, result in zip(prompts, results):
        assert result.token_ids == hf_greedy(model_dir, prompt, 12)
