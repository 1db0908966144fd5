"""`Registry[T]`: lazy `module:attr` entries, aliases, metadata, one error naming the choices, duplicates
refused; and every registry of Hearth built on it lists its names without importing torch."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from hearth.contracts.registry import Registry, UnknownNameError


@pytest.fixture
def plugin_module(tmp_path, monkeypatch):
    """A module no test has imported yet: `hearth_test_plugin_<n>:Thing`."""
    name = f"hearth_test_plugin_{abs(hash(str(tmp_path)))}"
    (tmp_path / f"{name}.py").write_text("class Thing:\n    loaded = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_a_lazy_entry_is_imported_on_first_get_only(plugin_module):
    registry: Registry[type] = Registry("thing")
    registry.add("thing", f"{plugin_module}:Thing", fast=True)
    assert plugin_module not in sys.modules
    assert "thing" in registry and registry.names() == ("thing",)
    assert registry.metadata("thing") == {"fast": True}
    assert plugin_module not in sys.modules  # metadata is read without loading
    thing = registry.get("thing")
    assert plugin_module in sys.modules and thing.loaded
    assert registry.get("thing") is thing


def test_an_alias_reaches_its_entry_and_is_a_choice_but_not_a_name():
    registry: Registry[int] = Registry("number")
    registry.add("one", 1, aliases=("uno", "eins"))
    registry.add("two", 2)
    assert registry.get("uno") == 1 and registry["eins"] == 1 and registry.canonical("eins") == "one"
    assert registry.names() == ("one", "two")
    assert registry.choices() == ("eins", "one", "two", "uno")
    assert list(registry) == ["one", "two"]


def test_a_name_or_alias_is_registered_once():
    registry: Registry[int] = Registry("number")
    registry.add("one", 1, aliases=("uno",))
    with pytest.raises(ValueError, match="number 'one' is already registered"):
        registry.add("one", 11)
    with pytest.raises(ValueError, match="number 'uno' is already registered \\(by 'one'\\)"):
        registry.add("un", 1, aliases=("uno",))
    with pytest.raises(ValueError, match="already registered"):
        registry.register("uno")(1)
    assert registry.get("one") == 1


def test_an_unknown_name_raises_one_error_listing_the_choices():
    registry: Registry[int] = Registry("number")
    registry.add("two", 2)
    registry.add("one", 1)
    with pytest.raises(UnknownNameError) as info:
        registry.get("three")
    assert str(info.value) == "unknown number 'three'; choose one of one, two"
    assert info.value.choices == ("one", "two")
    assert isinstance(info.value, KeyError) and isinstance(info.value, ValueError)
    with pytest.raises(UnknownNameError):
        registry.metadata("three")


def test_a_bad_lazy_target_fails_when_loaded():
    registry: Registry[object] = Registry("thing")
    registry.add("broken", "no_colon_here")
    with pytest.raises(ValueError, match="not 'module:attr'"):
        registry.get("broken")


def test_a_copy_is_independent():
    registry: Registry[int] = Registry("number")
    registry.add("one", 1)
    copy = registry.copy()
    copy.add("two", 2)
    assert "two" in copy and "two" not in registry


def test_the_decorator_returns_what_it_registers():
    registry: Registry[type] = Registry("thing")

    @registry.register("widget", colour="red")
    class Widget:
        pass

    assert registry.get("widget") is Widget and registry.metadata("widget")["colour"] == "red"


# The registries the CLIs and the config read: (module, attribute, names it must hold). Listing them imports
# no torch and no implementation, so CLI choices and config checks stay cheap.
REGISTRIES = [
    ("hearth.model.registry", "MODELS", {"LlamaForCausalLM", "Qwen3ForCausalLM", "DeepseekV3ForCausalLM"}),
    ("hearth.model.quantization.registry", "QUANTIZATION_METHODS", {"unquantized", "gptq", "awq", "gguf"}),
    ("hearth.engine.speculative.registry", "PROPOSERS", {"ngram", "suffix", "draft", "eagle3"}),
    ("hearth.kv_transfer", "KV_TRANSPORTS", {"tcp", "mooncake"}),
    ("hearth.server.tool_parsers", "TOOL_PARSERS", {"hermes", "openai", "qwen3_coder"}),
    ("hearth.server.reasoning_parsers", "REASONING_PARSERS", {"deepseek_r1", "qwen3", "openai_gptoss"}),
    ("hearth.router.policies", "POLICIES", {"round_robin", "default", "prefix_aware"}),
    ("hearth.router.pd", "PD_ADAPTERS", {"hearth", "sglang", "vllm"}),
    ("hearth.model.named_models", "NAMED_MODELS", {"smollm2"}),
]


def test_registries_list_their_names_without_importing_torch_or_an_implementation():
    code = textwrap.dedent(
        f"""
        import importlib, json, sys
        names = {{}}
        for module, attr, _ in {[(m, a, None) for m, a, _ in REGISTRIES]!r}:
            registry = getattr(importlib.import_module(module), attr)
            names[attr] = list(registry.choices())
            assert not any(registry.entry(n).loaded for n in registry.names() if isinstance(registry.entry(n).target, str)), attr
        heavy = sorted(m for m in sys.modules if m == "torch" or m.startswith(("hearth.model.models.",
            "hearth.model.quantization.gptq", "hearth.engine.speculative.draft", "hearth.kv_transfer.tcp",
            "hearth.server.tool_parsers.hermes")))
        print(json.dumps({{"names": names, "heavy": heavy}}))
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    import json

    report = json.loads(result.stdout)
    assert report["heavy"] == []
    for _, attr, expected in REGISTRIES:
        assert expected <= set(report["names"][attr]), attr


# Registries inside torch-using packages (the tier stack, the attention ops): lazy all the same.
TORCH_REGISTRIES = [
    ("hearth.kv.tiers.registry", "KV_STORES", {"redis", "rediss", "valkey", "mooncake"}),
    ("hearth.ops.attention.registry", "ATTENTION_BACKENDS", {"cpu", "torch_ref", "triton"}),
]


@pytest.mark.parametrize(("module", "attr", "expected"), REGISTRIES + TORCH_REGISTRIES)
def test_every_entry_of_every_registry_loads(module, attr, expected):
    import importlib

    registry = getattr(importlib.import_module(module), attr)
    assert expected <= set(registry.choices())
    # Their modules import what they need: the Mooncake engine, Triton.
    optional = {"mooncake", "triton"}
    for name in registry.names():
        if name not in optional:
            assert registry.get(name) is not None, name
