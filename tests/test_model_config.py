import json

import pytest

from hearth import LLM
from hearth.model.config import ModelConfig, ModelLoadError


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        ModelConfig.from_dir(tmp_path)


def test_missing_and_malformed_config(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json is missing"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": -1})
    )
    with pytest.raises(ModelLoadError, match="hidden_size"):
        ModelConfig.from_dir(tmp_path)


def test_missing_weights_is_one_clear_error(tiny_llama, tmp_path):
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tiny_llama / name).read_bytes())
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        LLM(str(tmp_path))


def test_sharded_checkpoint_loads(tiny_model_factory, tmp_path):
    import transformers

    source = tiny_model_factory("qwen3")
    model = transformers.AutoModelForCausalLM.from_pretrained(source)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (tmp_path / name).write_bytes((source / name).read_bytes())
    assert (tmp_path / "model.safetensors.index.json").exists()
    from hearth import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    a = LLM(str(tmp_path), dtype="float32").generate([[5, 6, 7, 8]], params)[0].token_ids
    b = LLM(str(source), dtype="float32").generate([[5, 6, 7, 8]], params)[0].token_ids
    assert a == b


def test_rope_parameters_old_and_new_formats():
    base = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": 100,
    }
    old = ModelConfig.from_dict(
        {**base, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}}
    )
    new = ModelConfig.from_dict(
        {**base, "rope_parameters": {"rope_theta": 5e5, "rope_type": "linear", "factor": 2.0}}
    )
    assert old.rope_theta == new.rope_theta == 5e5
    assert old.rope_scaling == new.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    with pytest.raises(ModelLoadError, match="rope type 'longrope'"):
        ModelConfig.from_dict({**base, "rope_scaling": {"rope_type": "longrope", "factor": 2.0}})
