"""Rejection sampling keeps the target's distribution (chi-square on a small vocabulary), and the pieces
around it: prompt lookup, adaptive K, the counters."""

from __future__ import annotations

import torch

from hearth.engine.request import Request
from hearth.engine.sampler import Sampler, SamplingRow
from hearth.engine.sampling_params import SamplingParams
from hearth.engine.speculative.ngram import lookup
from hearth.engine.speculative.proposer import ProposalRequest, Proposer
from hearth.engine.speculative.rejection import rejection_sample
from hearth.engine.speculative.speculator import Speculator
from hearth.kv.prefix_keys import root_key

VOCAB = 6
# Chi-square critical values at p = 0.001 (df = VOCAB - 1 = 5): a correct sampler fails 1 run in 1000.
CHI2_CRITICAL_DF5 = 20.515


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token with zero probability was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def sample_many(
    logits: torch.Tensor, drafts: list[int], params: SamplingParams, trials: int
) -> list[list[int]]:
    sampler = Sampler(VOCAB, eos_token_ids=set())
    rows = [SamplingRow(params, [], [], num_output_tokens=i) for i in range(len(drafts) + 1)]
    return [rejection_sample(sampler, logits, rows, drafts)[0] for _ in range(trials)]


def test_first_token_has_the_target_distribution_whatever_the_draft():
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0], [0.0, 1.0, 2.0, 0.0, 0.0, 0.0]])
    params = SamplingParams(temperature=0.9, max_tokens=10)
    probs = torch.softmax(logits / 0.9, dim=-1)
    for draft in (0, 3, 5):  # likely, unlikely, almost never: acceptance differs, the distribution doesn't
        results = sample_many(logits, [draft], params, trials=2500)
        first = torch.bincount(torch.tensor([r[0] for r in results]), minlength=VOCAB).double()
        assert chi_square(first, probs[0].double()) < CHI2_CRITICAL_DF5, draft
        # After an accepted draft the next token follows the target's next position.
        second = [r[1] for r in results if len(r) == 2]
        assert all(r[0] == draft for r in results if len(r) == 2)
        if len(second) > 300:
            counts = torch.bincount(torch.tensor(second), minlength=VOCAB).double()
            assert chi_square(counts, probs[1].double()) < CHI2_CRITICAL_DF5, draft


def test_truncated_distribution_is_kept_and_a_broken_sampler_is_caught():
    torch.manual_seed(1)
    logits = torch.tensor([[1.0, 0.8, 0.6, 0.4, 0.2, 0.0]] * 2)
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=10)
    results = sample_many(logits, [4], params, trials=1500)  # the draft is outside the top-k: always rejected
    assert all(len(r) == 1 for r in results)
    counts = torch.bincount(torch.tensor([r[0] for r in results]), minlength=VOCAB).double()
    probs = torch.softmax(torch.tensor([1.0, 0.8, 0.6, -1e9, -1e9, -1e9]), dim=-1).double()
    assert chi_square(counts, probs) < CHI2_CRITICAL_DF5
    # The test can fail: the untruncated distribution is rejected by the same statistic.
    full = torch.softmax(logits[0], dim=-1).double()
    assert (counts[3:] == 0).all() and (full[3:] > 0).all()


def test_accepting_the_draft_always_would_be_caught():
    """The check has teeth: a 'sampler' that always keeps the draft fails the chi-square test."""
    probs = torch.softmax(torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0]), dim=-1).double()
    always_draft = torch.zeros(VOCAB, dtype=torch.float64)
    always_draft[3] = 6000
    assert chi_square(always_draft, probs) > CHI2_CRITICAL_DF5


def test_seeded_rows_repeat():
    sampler = Sampler(VOCAB, eos_token_ids=set())
    logits = torch.randn(3, VOCAB)
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=10)

    def run() -> list[list[int]]:
        generator = torch.Generator().manual_seed(5)
        rows = [SamplingRow(params, [], [], generator=generator, num_output_tokens=i) for i in range(3)]
        return [rejection_sample(sampler, logits, rows, [1, 2])[0] for _ in range(20)]

    assert run() == run()


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    assert lookup([1, 2, 3, 4, 5, 9, 2, 3], 3) == [4, 5, 9]
    assert lookup([1, 2, 3, 7, 1, 2, 3, 8, 2, 3], 2) == [8, 2]  # the most recent of two matches
    assert lookup([7, 8, 9], 2) == []
    assert lookup([1, 2, 3, 9, 2, 3], 4, min_n=3) == []  # only a 2-gram matches


class FixedProposer(Proposer):
    name = "fixed"

    def __init__(self) -> None:
        self.asked: list[int] = []

    def propose(self, batch: list[ProposalRequest]) -> list[list[int]]:
        self.asked = [r.num_tokens for r in batch]
        return [[5] * r.num_tokens for r in batch]


def decoding_request(index: int) -> Request:
    request = Request(
        request_id=f"r{index}",
        prompt_token_ids=[1, 2, 3],
        params=SamplingParams(max_tokens=50),
        prefix_root=root_key("m"),
        arrival_index=index,
        max_model_len=100,
    )
    request.num_computed_tokens = 2  # the last prompt token is next: a decode
    return request


def test_adaptive_k_follows_acceptance_and_large_batches_turn_speculation_off():
    proposer = FixedProposer()
    speculator = Speculator(proposer, max_num_tokens=4, max_batch_size=2)
    good, bad = decoding_request(0), decoding_request(1)
    speculator.propose([good, bad])
    assert proposer.asked == [4, 4] and good.draft_token_ids == [5, 5, 5, 5]
    for _ in range(4):
        speculator.observe("r0", 4, 4)
        speculator.observe("r1", 4, 0)
    speculator.propose([good, bad])
    assert proposer.asked[0] == 4
    assert bad.draft_token_ids == []  # its drafts kept failing: it sits out a cooldown
    speculator.propose([good, bad, decoding_request(2)])
    assert not good.draft_token_ids  # three decode rows > max_batch_size 2: no drafts this step
    stats = speculator.stats
    assert stats.num_draft_tokens == 32 and stats.num_accepted_tokens == 16
    assert stats.acceptance_rate == 0.5 and stats.mean_accepted_length == 3.0


def test_a_middling_request_settles_between():
    proposer = FixedProposer()
    speculator = Speculator(proposer, max_num_tokens=6, max_batch_size=8)
    request = decoding_request(0)
    for _ in range(6):
        speculator.observe("r0", 4, 1)
    speculator.propose([request])
    assert proposer.asked == [3]


def test_metrics_report_acceptance_per_method():
    from hearth.engine.messages import EngineStats
    from hearth.server.metrics import ServerMetrics

    stats = EngineStats(0, 0, 0, 4, 0, 0, 0, 0, 0, 0, "ngram", 10, 40, 25)
    text = ServerMetrics("demo", lambda: stats).render().decode()
    assert 'hearth_spec_decode_acceptance_rate{method="ngram",model_name="demo"} 0.625' in text
    assert 'hearth_spec_decode_mean_accepted_length{method="ngram",model_name="demo"} 3.5' in text
    assert 'hearth_spec_decode_num_accepted_tokens_total{method="ngram",model_name="demo"} 25.0' in text
    plain = ServerMetrics("demo", lambda: EngineStats(0, 0, 0, 4, 0, 0, 0, 0, 0, 0)).render().decode()
    assert "spec_decode" not in plain


def test_options_are_checked_where_the_user_sets_them(tmp_path):
    import pytest

    from hearth.engine.config import EngineConfig

    with pytest.raises(ValueError, match="needs --speculative-model"):
        EngineConfig(model="m", speculative_method="draft")
    with pytest.raises(ValueError, match="no config.json"):
        EngineConfig(model="m", speculative_method="draft", speculative_model=str(tmp_path))
    with pytest.raises(ValueError, match="no config.json"):
        EngineConfig(model="m", speculative_method="eagle3", speculative_model=str(tmp_path))
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(model="m", speculative_method="ngram", num_speculative_tokens=0)
    assert EngineConfig(model="m", speculative_method="ngram").num_speculative_tokens == 4


def test_payoff_turns_drafts_off_where_they_cost_more_and_keeps_measuring():
    from hearth.engine.speculative.speculator import _EXPLORE_EVERY_STEPS, Payoff

    payoff = Payoff()
    assert payoff.use_drafts(8)  # nothing measured: try drafts first
    payoff.record(8, True, seconds=1.0, num_tokens=10)
    assert not payoff.use_drafts(8)  # then measure without
    payoff.record(8, False, seconds=0.5, num_tokens=10)
    choices = [payoff.use_drafts(8) for _ in range(2 * _EXPLORE_EVERY_STEPS)]
    assert choices.count(True) == 2  # drafts cost more here: only the periodic re-measurement uses them
    assert payoff.use_drafts(1)  # another batch size is measured on its own
    payoff.record(1, True, seconds=0.2, num_tokens=10)
    payoff.record(1, False, seconds=0.5, num_tokens=10)
    assert sum(payoff.use_drafts(1) for _ in range(_EXPLORE_EVERY_STEPS)) == _EXPLORE_EVERY_STEPS - 1


def test_a_requests_first_drafted_step_is_not_charged_to_the_payoff():
    """That step also pays the proposer's catch-up over the request's context (a draft model's prefill);
    the steps after it are the per-token rate the switch compares."""
    from hearth.engine.scheduler import ScheduledRequest

    speculator = Speculator(FixedProposer(), max_num_tokens=2, max_batch_size=8)
    request = decoding_request(0)
    speculator.propose([request])
    assert request.draft_token_ids == [5, 5]
    speculator.step_finished([ScheduledRequest(request, 3, [5, 5])], num_output_tokens=3)
    assert speculator.payoff.cost_s == {}  # the first drafted step: not recorded
    speculator.observe("r0", 2, 2)
    speculator.propose([request])
    speculator.step_finished([ScheduledRequest(request, 3, [5, 5])], num_output_tokens=3)
    assert list(speculator.payoff.cost_s) == [(1, 2)]  # (batch size bucket, draft cap K)


def test_payoff_settles_each_batch_size_on_its_cheapest_draft_cap():
    from hearth.engine.speculative.speculator import _EXPLORE_EVERY_STEPS, Payoff, draft_caps

    assert draft_caps(8) == (8, 2, 0) and draft_caps(1) == (1, 0)
    payoff = Payoff(draft_caps(8))
    assert [payoff.choose(16) for _ in range(3)] == [8, 8, 8]  # unmeasured caps first, largest first
    payoff.record(16, 8, seconds=1.0, num_tokens=10)
    assert payoff.choose(16) == 2
    payoff.record(16, 2, seconds=0.6, num_tokens=10)
    assert payoff.choose(16) == 0
    payoff.record(16, 0, seconds=0.8, num_tokens=10)
    choices = [payoff.choose(16) for _ in range(4 * _EXPLORE_EVERY_STEPS)]
    assert choices.count(2) == len(choices) - 4  # short drafts pay at this batch size...
    assert sorted(set(choices)) == [0, 2, 8]  # ...and the other caps are re-measured in turn
    payoff.record(1, 8, seconds=0.2, num_tokens=10)  # batch 1 is measured on its own
    assert payoff.choose(1) == 2


def test_a_step_under_a_cap_proposes_no_more_than_the_cap_and_is_recorded_under_it():
    from hearth.engine.scheduler import ScheduledRequest

    proposer = FixedProposer()
    speculator = Speculator(proposer, max_num_tokens=8, max_batch_size=8)
    speculator.payoff.cost_s[(1, 8)] = 1.0  # K=8 measured expensive at batch 1: the cap of 2 is tried next
    request = decoding_request(0)
    speculator.observe("r0", 4, 4)  # not its first drafted step
    speculator.propose([request])
    assert request.draft_token_ids == [5, 5]
    speculator.step_finished([ScheduledRequest(request, 3, [5, 5])], num_output_tokens=3)
    assert (1, 2) in speculator.payoff.cost_s


class ConfidentProposer(FixedProposer):
    sizes_own_drafts = True

    def __init__(self) -> None:
        super().__init__()
        self.done: list[tuple[str, list[int], bytes]] = []

    def request_done(self, request: ProposalRequest) -> None:
        self.done.append((request.request_id, list(request.token_ids), request.tenant))


def test_a_proposer_sizing_its_own_drafts_gets_k_and_learns_each_finished_request():
    proposer = ConfidentProposer()
    speculator = Speculator(proposer, max_num_tokens=6, max_batch_size=8, adaptive=False)
    request = decoding_request(0)
    for _ in range(4):
        speculator.observe("r0", 6, 1)  # low acceptance would shrink K for others (to 3)...
    speculator.propose([request])
    assert proposer.asked == [6]  # ...not for a proposer that stops where it is unsure
    request.token_ids += [9, 9]
    speculator.request_finished("r0")
    assert proposer.done == [("r0", [1, 2, 3, 9, 9], root_key("m"))]
    speculator.request_finished("r0")  # a second end (abort after finish) teaches nothing twice
    assert len(proposer.done) == 1
