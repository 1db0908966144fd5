"""Sampler: greedy, filters, seeds, penalties, min_tokens and logprobs, checked against plain references."""

from __future__ import annotations

import math

import pytest
import torch

from hearth.engine.sampler import Sampler, SamplingRow, make_generator
from hearth.engine.sampling_params import SamplingParams

VOCAB = 64
EOS = 5


def _row(
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    seed: int | None = None,
    **params: object,
) -> SamplingRow:
    sp = SamplingParams(seed=seed, **params)  # type: ignore[arg-type]
    return SamplingRow(sp, prompt or [], output or [], make_generator(seed) if seed is not None else None)


def _logits(num_rows: int, width: int = VOCAB, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, width, generator=generator) * scale


def _draw_many(sampler: Sampler, logits_row: torch.Tensor, num_draws: int, **params: object) -> torch.Tensor:
    """Many unseeded draws of one row, as one batch of identical rows."""
    rows = [_row(**params) for _ in range(num_draws)]
    return torch.tensor(sampler(logits_row.expand(num_draws, -1).clone(), rows).token_ids)


# ---- greedy ----------------------------------------------------------------------------------


def test_greedy_batch_is_argmax_and_ignores_padded_columns() -> None:
    logits = _logits(8, width=VOCAB + 16)
    logits[:, VOCAB:] = 1e9  # padding beyond the tokenizer's vocab must never win
    out = Sampler(VOCAB, {EOS})(logits, [_row(temperature=0.0) for _ in range(8)])
    assert out.token_ids == logits[:, :VOCAB].argmax(-1).tolist()
    assert out.logprobs == [None] * 8


def test_top_k_one_equals_greedy() -> None:
    logits = _logits(6)
    sampler = Sampler(VOCAB, {EOS})
    greedy = sampler(logits, [_row(temperature=0.0) for _ in range(6)]).token_ids
    assert sampler(logits, [_row(temperature=1.3, top_k=1) for _ in range(6)]).token_ids == greedy


def test_tiny_top_p_and_full_min_p_reduce_to_the_argmax() -> None:
    logits = _logits(1, seed=3)
    sampler = Sampler(VOCAB, {EOS})
    best = int(logits.argmax())
    assert set(_draw_many(sampler, logits[0], 300, top_p=1e-6).tolist()) == {best}
    assert set(_draw_many(sampler, logits[0], 300, min_p=1.0).tolist()) == {best}


def test_random_rows_never_pick_padded_columns() -> None:
    logits = _logits(1, width=VOCAB + 8, scale=0.1)
    logits[:, VOCAB:] = 50.0
    draws = _draw_many(Sampler(VOCAB, {EOS}), logits[0], 500, temperature=2.0)
    assert int(draws.max()) < VOCAB


def test_mixed_batch_keeps_greedy_rows_greedy() -> None:
    logits = _logits(5)
    rows = [
        _row(temperature=0.0),
        _row(temperature=1.0),
        _row(temperature=0.0),
        _row(top_p=0.9),
        _row(top_k=1),
    ]
    out = Sampler(VOCAB, {EOS})(logits, rows).token_ids
    assert torch.equal(logits, _logits(5)), "the sampler must not modify its input"
    argmax = logits.argmax(-1).tolist()
    assert [out[0], out[2], out[4]] == [argmax[0], argmax[2], argmax[4]]


# ---- distribution and filters ------------------------------------------------------------------


def test_samples_follow_softmax_of_logits_over_temperature() -> None:
    vocab = 6
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, 2.0, -3.0]])
    sampler = Sampler(vocab, set())
    torch.manual_seed(0)
    for temperature in (0.7, 1.0, 1.5):
        draws = _draw_many(sampler, logits[0], 8000, temperature=temperature)
        empirical = torch.bincount(draws, minlength=vocab).float() / draws.numel()
        expected = torch.softmax(logits[0] / temperature, dim=-1)
        assert torch.allclose(empirical, expected, atol=0.025), (temperature, empirical, expected)


def _allowed(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> set[int]:
    """Reference filter, one token at a time: temperature -> min_p -> top_k -> top_p."""
    values = (logits / temperature).tolist()
    order = sorted(range(len(values)), key=lambda i: -values[i])
    exp = [math.exp(v - values[order[0]]) for v in values]
    total = sum(exp)
    probs = [e / total for e in exp]
    kept = [i for i in order if probs[i] >= min_p * probs[order[0]]]
    if top_k > 0:
        kept = kept[:top_k]
    kept_total = sum(probs[i] for i in kept)
    renormalized = [probs[i] / kept_total for i in kept]
    result, cumulative = [], 0.0
    for i, p in zip(kept, renormalized, strict=True):
        result.append(i)
        cumulative += p
        if cumulative >= top_p:
            break
    return set(result)


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p",
    [
        (1.0, 5, 1.0, 0.0),
        (1.0, 0, 0.6, 0.0),
        (1.0, 0, 1.0, 0.2),
        (0.8, 10, 0.7, 0.0),
        (1.2, 8, 0.9, 0.05),
        (2.0, -1, 0.5, 0.1),
    ],
)
def test_filters_never_sample_outside_the_allowed_set(
    temperature: float, top_k: int, top_p: float, min_p: float
) -> None:
    logits = _logits(1, seed=11, scale=1.5)[0]
    allowed = _allowed(logits, temperature, top_k, top_p, min_p)
    assert 1 < len(allowed) < VOCAB
    draws = _draw_many(
        Sampler(VOCAB, {EOS}), logits, 4000, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p
    )
    seen = set(draws.tolist())
    assert seen <= allowed
    # Enough draws that every allowed token shows up: the filter is not stricter than asked.
    assert seen == allowed


@pytest.mark.parametrize(
    "configs",
    [
        # top-k on some rows, top-p on others: the full-sort path
        [dict(top_k=3), dict(top_p=0.5), dict(min_p=0.3), dict()],
        # top-k on some rows only, no top-p: the k-th value threshold path
        [dict(top_k=3), dict(top_k=7), dict(min_p=0.3), dict()],
        # every row has its own small top-k, some with top-p: the topk-candidates path
        [dict(top_k=3), dict(top_k=6, top_p=0.5), dict(top_k=20, top_p=0.8, min_p=0.02), dict(top_k=40)],
    ],
)
def test_rows_with_different_filters_in_one_batch(configs: list[dict]) -> None:
    logits = _logits(1, seed=5, scale=1.5)[0]
    sampler = Sampler(VOCAB, {EOS})
    per_config = 1500
    rows = [_row(**c) for c in configs for _ in range(per_config)]
    draws = sampler(logits.expand(len(rows), -1).clone(), rows).token_ids
    for n, config in enumerate(configs):
        allowed = _allowed(
            logits,
            1.0,
            int(config.get("top_k", 0)),
            float(config.get("top_p", 1.0)),
            float(config.get("min_p", 0.0)),
        )
        seen = set(draws[n * per_config : (n + 1) * per_config])
        assert seen <= allowed, config
        if len(allowed) <= 10:
            assert seen == allowed, config


# ---- seeds -------------------------------------------------------------------------------------


def _run_seeded(seed: int, position: int, batch_size: int, steps: int = 15, **params: object) -> list[int]:
    """The tokens a seeded row gets over `steps` steps, placed at `position` among other rows."""
    sampler = Sampler(VOCAB, {EOS})
    target = _row(seed=seed, **params)
    others = [_row(seed=100 + i if i % 2 else None, temperature=0.9) for i in range(batch_size - 1)]
    tokens = []
    for step in range(steps):
        logits = _logits(batch_size, seed=1000 + step + 37 * batch_size, scale=1.0)
        row_logits = _logits(1, seed=step, scale=1.0)
        logits[position] = row_logits[0]
        rows = others[:position] + [target] + others[position:]
        tokens.append(sampler(logits, rows).token_ids[position])
        target.output_token_ids.append(tokens[-1])
    return tokens


@pytest.mark.parametrize(
    "params",
    [dict(), dict(top_p=0.8, temperature=0.7), dict(top_k=10, min_p=0.05), dict(top_k=12, top_p=0.7)],
)
def test_same_seed_same_tokens_whatever_the_batch(params: dict) -> None:
    alone = _run_seeded(42, position=0, batch_size=1, **params)
    assert _run_seeded(42, position=3, batch_size=6, **params) == alone
    assert _run_seeded(42, position=7, batch_size=8, **params) == alone
    assert _run_seeded(43, position=0, batch_size=1, **params) != alone


def test_make_generator_is_reproducible() -> None:
    a = torch.empty(10).exponential_(generator=make_generator(7))
    b = torch.empty(10).exponential_(generator=make_generator(7))
    assert torch.equal(a, b)


# ---- penalties ---------------------------------------------------------------------------------


def _reference_penalties(logits: list[float], row: SamplingRow) -> list[float]:
    p = row.params
    out = list(logits)
    seen = set(row.prompt_token_ids) | set(row.output_token_ids)
    for t in seen:
        out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t in set(row.output_token_ids):
        count = row.output_token_ids.count(t)
        out[t] -= p.frequency_penalty * count + p.presence_penalty
    return out


def test_penalties_change_logits_exactly_as_the_formulas_say() -> None:
    logits = _logits(5, width=VOCAB + 4)
    rows = [
        _row(prompt=[1, 2, 3, 3], output=[3, 4, 4, 9], repetition_penalty=1.3),
        _row(prompt=[1, 2], output=[2, 2, 2, 7], frequency_penalty=0.5, presence_penalty=0.25),
        _row(
            prompt=[10, 11],
            output=[11, 12, 12],
            repetition_penalty=0.8,
            frequency_penalty=-0.3,
            presence_penalty=1.5,
        ),
        _row(prompt=[1, 2, 3], output=[4, 5], temperature=0.0),  # no penalties: untouched
        _row(prompt=list(range(0, VOCAB, 3)), output=[], repetition_penalty=2.0),
    ]
    processed = Sampler(VOCAB, {EOS}).processed_logits(logits, rows)
    assert processed.shape == (5, VOCAB)
    for i, row in enumerate(rows):
        expected = torch.tensor(_reference_penalties(logits[i, :VOCAB].tolist(), row))
        assert torch.allclose(processed[i], expected, atol=1e-6), i
    assert torch.equal(logits[:, :VOCAB], _logits(5, width=VOCAB + 4)[:, :VOCAB]), (
        "input logits were modified"
    )


def test_repetition_penalty_moves_greedy_away_from_repeats() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 7] = 2.0
    logits[0, 8] = 1.5
    sampler = Sampler(VOCAB, {EOS})
    assert sampler(logits, [_row(temperature=0.0, output=[7])]).token_ids == [7]
    assert sampler(logits, [_row(temperature=0.0, output=[7], repetition_penalty=1.5)]).token_ids == [8]
    assert sampler(logits, [_row(temperature=0.0, output=[7, 7], frequency_penalty=0.3)]).token_ids == [8]
    assert sampler(logits, [_row(temperature=0.0, output=[7], presence_penalty=0.6)]).token_ids == [8]


# ---- min_tokens --------------------------------------------------------------------------------


def test_min_tokens_masks_eos_and_stop_tokens_until_reached() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = 10.0
    logits[0, 9] = 9.0
    logits[0, 20] = 1.0
    sampler = Sampler(VOCAB, {EOS})

    def pick(output: list[int], **params: object) -> int:
        return sampler(logits, [_row(temperature=0.0, output=output, **params)]).token_ids[0]

    assert pick([], min_tokens=2, stop_token_ids=[9]) == 20
    assert pick([1], min_tokens=2, stop_token_ids=[9]) == 20
    assert pick([1, 2], min_tokens=2, stop_token_ids=[9]) == EOS
    assert pick([], min_tokens=2) == 9
    assert pick([], min_tokens=2, stop_token_ids=[9], ignore_eos=True) == EOS
    draws = _draw_many(sampler, logits[0], 500, min_tokens=3, stop_token_ids=[9])
    assert EOS not in draws.tolist() and 9 not in draws.tolist()


# ---- logprobs ----------------------------------------------------------------------------------


def test_logprobs_come_from_the_raw_logits() -> None:
    logits = _logits(4, width=VOCAB + 3)
    rows = [
        _row(temperature=0.0, logprobs=3),
        _row(temperature=0.7, logprobs=0, repetition_penalty=1.4, output=[1, 2]),
        _row(temperature=1.0),
        _row(
            temperature=0.0, logprobs=20, frequency_penalty=2.0, output=[int(logits[3, :VOCAB].argmax())] * 4
        ),
    ]
    out = Sampler(VOCAB, {EOS})(logits, rows)
    reference = torch.log_softmax(logits[:, :VOCAB], dim=-1)
    assert out.logprobs[2] is None
    for i, count in ((0, 3), (1, 0), (3, 20)):
        entry = out.logprobs[i]
        assert entry is not None
        assert entry.token_id == out.token_ids[i]
        assert entry.logprob == pytest.approx(float(reference[i, entry.token_id]), abs=1e-5)
        values, ids = (
            reference[i].topk(count) if count else (torch.empty(0), torch.empty(0, dtype=torch.long))
        )
        assert [t for t, _ in entry.top] == ids.tolist()
        assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=1e-5)
    # The penalty changed the choice, but the reported logprob is still the raw one.
    assert out.token_ids[3] != int(logits[3, :VOCAB].argmax())


# ---- bad input ---------------------------------------------------------------------------------


def test_bad_shapes_are_clear_errors() -> None:
    sampler = Sampler(VOCAB, {EOS})
    with pytest.raises(ValueError, match="len\\(rows\\)"):
        sampler(torch.zeros(2, VOCAB), [_row()])
    with pytest.raises(ValueError, match="vocab_size"):
        sampler(torch.zeros(1, VOCAB - 1), [_row()])
    assert sampler(torch.zeros(0, VOCAB), []).token_ids == []


@pytest.mark.parametrize("temperature", [0.0, 1e-5, 0.7, 1.0])
@pytest.mark.parametrize("repetition_penalty", [1e-38, 1e-3, 1e30])
@pytest.mark.parametrize("filters", [{}, {"top_k": 5}, {"top_p": 0.9}, {"min_p": 0.1}])
def test_extreme_penalties_never_pick_a_forbidden_token(
    temperature: float, repetition_penalty: float, filters: dict
) -> None:
    # A grammar mask leaves a few columns allowed; huge logits after the penalty must not turn into a NaN
    # row whose draw lands on the last (forbidden) column.
    vocab = 64
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, vocab, generator=generator) * 10
    allowed = [3, 17, 40]
    masked = torch.full_like(logits, float("-inf"))
    masked[:, allowed] = logits[:, allowed].abs() + 1.0  # positive: divided by the penalty, so they overflow
    params = SamplingParams(
        max_tokens=4, temperature=temperature, repetition_penalty=repetition_penalty, **filters
    )
    rows = [SamplingRow(params, prompt_token_ids=allowed + [5], output_token_ids=allowed) for _ in range(4)]
    for _ in range(20):
        out = Sampler(vocab, {vocab - 1})(masked.clone(), rows)
        assert all(token in allowed for token in out.token_ids), out.token_ids


# ---- logit_bias ------------------------------------------------------------------------------


def test_logit_bias_moves_the_greedy_pick_and_only_its_row() -> None:
    sampler = Sampler(VOCAB, {EOS})
    logits = _logits(2)
    target = int(logits[0].argmin())
    rows = [_row(temperature=0.0, logit_bias={target: 100.0}), _row(temperature=0.0)]
    picked = sampler(logits.clone(), rows).token_ids
    assert picked == [target, int(logits[1].argmax())]


def test_logit_bias_minus_100_bans_a_token_from_sampling() -> None:
    sampler = Sampler(VOCAB, {EOS})
    row = _logits(1)[0]
    favourite = int(row.argmax())
    draws = _draw_many(sampler, row, 200, temperature=1.0, logit_bias={favourite: -100.0})
    assert favourite not in draws.tolist()


def test_logit_bias_keeps_logprobs_raw() -> None:
    sampler = Sampler(VOCAB, {EOS})
    logits = _logits(1)
    target = int(logits[0].argmin())
    out = sampler(logits.clone(), [_row(temperature=0.0, logprobs=0, logit_bias={target: 100.0})])
    expected = torch.log_softmax(logits[0], dim=-1)[target].item()
    assert out.token_ids == [target]
    assert out.logprobs[0] is not None and out.logprobs[0].logprob == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("bias", [{-1: 1.0}, {3: 101.0}, {3: math.nan}])
def test_bad_logit_bias_is_refused_by_name(bias: dict[int, float]) -> None:
    from hearth.engine.sampling_params import InvalidParamError

    with pytest.raises(InvalidParamError) as raised:
        SamplingParams(logit_bias=bias)
    assert raised.value.param == "logit_bias"
