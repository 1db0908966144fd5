"""lm-evaluation-harness against a live server: a local multiple-choice (log-likelihood) task through
`local-completions` (`echo` + `logprobs`) scores what transformers computes for the same token sequences."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tiny_models import make_tiny_model

from hearth.server.process import ServerProcess

lm_eval = pytest.importorskip("lm_eval")

CONTEXTS = ["The cat sat on the", "One two three four", "Rain falls from the", "Paris is the capital of"]
DISTRACTORS = [" zebra quantum", " !!??", " 0 0 0 0", " mat"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("lm_eval") / "tiny", seed=3)


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("lm_eval-serve")
    tokenizer_dir = root / "tokenizer"  # served with --tokenizer from elsewhere, as vLLM users may
    tokenizer_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, tokenizer_dir / name)
    args = [str(model_dir), "--dtype", "float32", "--kv-cache-memory", "0.02", "--served-model-name", "tiny"]
    args += ["--tokenizer", str(tokenizer_dir), "--enable-log-requests"]
    with ServerProcess(args, root / "server.log") as process:
        yield process


def _hf_loglikelihood(model_dir: Path, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    from hf_oracle import _load

    tokens = context + continuation
    with torch.no_grad():
        logits = _load(str(model_dir))(torch.tensor([tokens])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)[len(context) - 1 : -1]
    target = torch.tensor(continuation)
    chosen = logprobs.gather(1, target[:, None]).squeeze(1)
    return float(chosen.sum()), bool((logprobs.argmax(dim=-1) == target).all())


def _greedy_text(model_dir: Path, lm: object, context: str) -> str:
    """The model's own greedy continuation of `context`: the answer it must pick."""
    from hf_oracle import hf_greedy

    ids = lm.tok_encode(context)  # type: ignore[attr-defined]
    return lm.tokenizer.decode(hf_greedy(model_dir, ids, 3))  # type: ignore[attr-defined]


def test_multiple_choice_scores_equal_transformers(
    server: ServerProcess, model_dir: Path, tmp_path: Path
) -> None:
    from lm_eval import simple_evaluate
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    lm = get_model("local-completions")(
        base_url=server.url + "/v1/completions",
        model="tiny",
        tokenizer=str(model_dir),
        tokenizer_backend="huggingface",
        tokenized_requests=True,
        max_length=256,
    )
    docs = []
    for context, distractor in zip(CONTEXTS, DISTRACTORS, strict=True):
        answer = _greedy_text(model_dir, lm, context)
        choices = [distractor, answer] if answer != distractor else [distractor + " x", answer]
        docs.append({"context": context, "choices": choices, "label": 1})
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "hearth_mc.yaml").write_text(
        "task: hearth_mc\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: '{{context}}'\n"
        "doc_to_choice: '{{choices}}'\n"
        "doc_to_target: label\n"
        "target_delimiter: ''\n"
        "metric_list:\n  - metric: acc\n"
    )
    results = simple_evaluate(
        model=lm, tasks=["hearth_mc"], task_manager=TaskManager(include_path=str(tasks)), log_samples=True
    )
    samples = results["samples"]["hearth_mc"]
    expected_correct = 0
    for sample in samples:
        doc = sample["doc"]
        scores = []
        for choice, response in zip(doc["choices"], sample["resps"], strict=True):
            context_ids, continuation_ids = lm._encode_pair(doc["context"], choice)
            expected, greedy = _hf_loglikelihood(model_dir, context_ids, continuation_ids)
            got, got_greedy = response[0]
            assert got == pytest.approx(expected, abs=1e-3), (doc, choice)
            assert got_greedy == greedy
            scores.append(expected)
        expected_correct += int(max(range(len(scores)), key=scores.__getitem__) == doc["label"])
    accuracy = results["results"]["hearth_mc"]["acc,none"]
    assert accuracy == expected_correct / len(samples)
    assert accuracy > 0.5  # the model's own greedy continuation wins
    assert "request cmpl-" in server.log()  # --enable-log-requests
