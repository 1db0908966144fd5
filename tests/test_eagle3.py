"""EAGLE-3 heads: the loader reads the published checkpoint layout; Hearth's paged head, fed by the
target's captured hidden states, proposes what a plain-PyTorch head over transformers' hidden states
proposes; greedy output is unchanged with rollbacks on every step; no page leaks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from demo_prompts import weather_tool_prompts
from safetensors.torch import save_file
from tiny_models import make_tiny_model

from hearth import LLM, SamplingParams
from hearth.model.config import ModelLoadError
from hearth.model.eagle3_reference import ReferenceEagle3Head

REPO_ROOT = Path(__file__).resolve().parent.parent
AUX_LAYERS = [0, 1, 2]  # the tiny target has 2 layers: the embedding, after layer 0, after layer 1


@pytest.fixture(scope="module", autouse=True)
def compiled_kernels() -> None:
    from hearth.ops import cpu_kernels

    cpu_kernels.start_build()
    cpu_kernels.paged_decode_attention_kernel(wait=True)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("eagle3") / "target", "llama", seed=0)


def head_config(target_dir: Path, draft_vocab_size: int) -> dict:
    target = json.loads((target_dir / "config.json").read_text())
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": target["hidden_size"],
        "intermediate_size": 96,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "vocab_size": target["vocab_size"],
        "draft_vocab_size": draft_vocab_size,
        "target_hidden_size": target["hidden_size"],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX_LAYERS, "use_aux_hidden_state": True},
        "torch_dtype": "float32",
    }


def target_embedding(target_dir: Path) -> torch.Tensor:
    from safetensors.torch import load_file

    return load_file(str(target_dir / "model.safetensors"))["model.embed_tokens.weight"]


def write_head(path: Path, target_dir: Path, seed: int, draft_vocab_size: int = 200) -> ReferenceEagle3Head:
    """A random head, written as published checkpoints are: separate q/k/v, `midlayer.`, d2t/t2d."""
    config = head_config(target_dir, draft_vocab_size)
    torch.manual_seed(seed)
    head = ReferenceEagle3Head(config, target_embedding(target_dir))
    with torch.no_grad():
        for param in head.parameters():
            param.normal_(0.0, 0.3 if param.dim() >= 2 else 0.05).add_(1.0 if param.dim() == 1 else 0.0)
        # A reduced vocabulary whose ids are not the target's: d2t must be applied.
        chosen = torch.randperm(config["vocab_size"], generator=torch.Generator().manual_seed(seed))
        head.set_vocab(chosen[:draft_vocab_size].sort().values)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in head.state_dict().items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return head


def transformers_aux(target_dir: Path, token_ids: list[int]) -> torch.Tensor:
    """The oracle's residual streams at AUX_LAYERS (id j: entering layer j; num_layers: after the last)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
    captured: list[torch.Tensor] = []
    last = model.model.layers[-1]
    handle = last.register_forward_hook(
        lambda _m, _i, out: captured.append(out[0] if isinstance(out, tuple) else out)
    )
    with torch.no_grad():
        out = model(torch.tensor([token_ids]), output_hidden_states=True)
    handle.remove()
    streams = list(out.hidden_states[: len(model.model.layers)]) + [captured[0]]
    return torch.cat([streams[j][0] for j in AUX_LAYERS], dim=-1)


PROMPTS = [[5 + (i * 7 + n) % 300 for i in range(n)] for n in (6, 21, 35, 13)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def eagle_llm(target_dir: Path, head_dir: Path, k: int = 3, **options) -> LLM:
    llm = LLM(
        str(target_dir),
        dtype="float32",
        num_threads=1,
        speculative_method="eagle3",
        speculative_model=str(head_dir),
        num_speculative_tokens=k,
        **options,
    )
    llm.engine.speculator.adaptive = False  # drafts on every step, whatever the machine's load
    return llm


def test_paged_head_proposes_what_the_reference_proposes(target_dir, tmp_path):
    reference = write_head(tmp_path / "head", target_dir, seed=1)
    llm = eagle_llm(target_dir, tmp_path / "head", k=3)
    proposer = llm.engine.speculator.proposer
    calls: list[tuple[list[int], int, list[int]]] = []
    original = proposer.propose

    def recording(batch):  # type: ignore[no-untyped-def]
        out = original(batch)
        calls.extend((list(r.token_ids), r.num_tokens, p) for r, p in zip(batch, out, strict=True))
        return out

    proposer.propose = recording
    llm.generate(PROMPTS[1:3], GREEDY)
    assert len(calls) >= 10
    for token_ids, num_tokens, proposed in calls[:12]:
        aux = transformers_aux(target_dir, token_ids)
        expected = reference.propose(token_ids, aux, num_tokens)
        assert proposed == expected, f"after {len(token_ids)} tokens"


@pytest.mark.parametrize(
    "engine_options",
    [
        dict(),
        dict(page_size=4, max_num_batched_tokens=9),  # chunked prefill
        # 2 layers x 2 KV heads x 16 dims x fp32 x (K, V) = 512 bytes per token; 18 pages of 4 tokens.
        dict(page_size=4, kv_cache_memory_gib=18 * 4 * 512 / 2**30),  # preemption
        dict(page_size=8),  # prefix caching: the second batch hits the first's pages
    ],
    ids=["batch", "chunked", "preempt", "prefix"],
)
def test_greedy_output_is_unchanged_and_rollback_leaks_nothing(target_dir, tmp_path, engine_options):
    write_head(tmp_path / "head", target_dir, seed=2)
    expected = LLM(str(target_dir), dtype="float32", num_threads=1, **engine_options).generate(
        PROMPTS, GREEDY
    )
    llm = eagle_llm(target_dir, tmp_path / "head", k=4, **engine_options)
    got = llm.generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    if "page_size" in engine_options and len(engine_options) == 1:
        again = llm.generate(PROMPTS, GREEDY)
        assert [r.token_ids for r in again] == [r.token_ids for r in expected]
        assert sum(r.cached_tokens for r in again) > 0
    stats = llm.engine.speculator.stats
    assert stats.num_drafts > 0
    assert stats.num_accepted_tokens < stats.num_draft_tokens  # a random head is wrong: rollbacks happened
    if "kv_cache_memory_gib" in engine_options:
        assert llm.engine.stats().num_preemptions_total > 0
    assert llm.engine.stats().kv_pages_used == 0
    assert llm.engine.speculator.proposer.kv.num_used_pages == 0  # the head's own pages came back


def test_loader_names_what_a_checkpoint_lacks_and_checks_the_aux_layers(target_dir, tmp_path):
    from safetensors.torch import load_file

    head_dir = tmp_path / "head"
    write_head(head_dir, target_dir, seed=3)
    tensors = load_file(str(head_dir / "model.safetensors"))
    del tensors["midlayer.hidden_norm.weight"]
    save_file(tensors, str(head_dir / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="midlayer.hidden_norm.weight"):
        eagle_llm(target_dir, head_dir)
    write_head(head_dir, target_dir, seed=3)
    config = json.loads((head_dir / "config.json").read_text())
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 1, 7]
    (head_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="aux hidden state layer ids"):
        eagle_llm(target_dir, head_dir)


def test_shipped_demo_head_is_lossless_on_tool_calls():
    head_dir = REPO_ROOT / "models" / "demo-eagle3"
    if not (head_dir / "config.json").exists():
        pytest.skip("models/demo-eagle3 is not trained yet")
    demo = REPO_ROOT / "models" / "demo"
    prompts = weather_tool_prompts(demo)
    params = SamplingParams(temperature=0.0, max_tokens=48)
    expected = LLM(str(demo), dtype="float32", num_threads=1).generate(prompts, params)
    llm = eagle_llm(demo, head_dir, k=4)
    got = llm.generate(prompts, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    # How much it accepts is a benchmark figure (docs/benchmarks.md), not a correctness property.
    assert llm.engine.speculator.stats.num_drafts > 0
