"""The suffix lookup behind `suffix` decoding: the longest match, the most common continuation and where it
stops, a request's growing corpus, and the per-tenant corpora's bounds and eviction."""

from __future__ import annotations

import numpy as np
import pytest

from hearth.engine.speculative.suffix_index import (
    SEPARATOR,
    RequestCorpus,
    SharedCorpus,
    TenantCorpora,
    continuation,
    draft_length,
    longest_match,
)


def arr(tokens: list[int]) -> np.ndarray:
    return np.asarray(tokens, dtype=np.int32)


def test_longest_match_finds_every_place_of_the_longest_suffix():
    corpus = arr([5, 1, 2, 3, 9, 7, 2, 3, 8, 1, 2, 3])
    positions, depth = longest_match(corpus, len(corpus), corpus, max_depth=8)
    # "1 2 3" occurs at the start (ending at index 3); "2 3" alone also at index 7, but the longer match wins.
    assert depth == 3 and positions.tolist() == [3]
    positions, depth = longest_match(corpus, len(corpus), corpus, max_depth=2)
    assert depth == 2 and positions.tolist() == [3, 7]
    assert longest_match(arr([4, 5, 6]), 3, arr([4, 5, 6]), 8)[1] == 0  # the suffix itself does not count


def test_continuation_follows_the_majority_and_stops_where_agreement_is_low():
    # After "1": 2 2 2 (three times "1 2 ..."), then the three places split 4 / 4 / 6.
    corpus = arr([1, 2, 4, SEPARATOR, 1, 2, 4, SEPARATOR, 1, 2, 6, SEPARATOR])
    positions = np.array([0, 4, 8])
    tokens, probabilities = continuation(corpus, len(corpus), positions, 8, min_probability=0.5)
    assert tokens == [2, 4] and probabilities == pytest.approx([1.0, 2 / 3])
    tokens, _ = continuation(corpus, len(corpus), positions, 8, min_probability=0.7)
    assert tokens == [2]  # 2/3 < 0.7: the uncertain token is not drafted
    tokens, _ = continuation(corpus, len(corpus), positions, 1, min_probability=0.1)
    assert tokens == [2]  # never more than asked for


def test_a_tie_goes_to_the_most_recent_place():
    corpus = arr([1, 7, SEPARATOR, 1, 8, SEPARATOR])
    tokens, probabilities = continuation(corpus, len(corpus), np.array([0, 3]), 1, 0.1)
    assert tokens == [8] and probabilities == [0.5]


def test_draft_length_grows_with_the_match():
    assert [draft_length(n, 8, 2.0) for n in (1, 2, 3, 5)] == [2, 4, 6, 8]
    assert draft_length(1, 8, 0.5) == 1


def test_request_corpus_drafts_what_followed_the_earlier_occurrence_and_keeps_up():
    corpus = RequestCorpus()
    prompt = [10, 11, 12, 13, 14, 15, 16, 99, 10, 11]
    corpus.sync(prompt)
    draft = corpus.draft(max_depth=16, max_tokens=4, tokens_per_match=2.0, min_probability=0.1)
    assert draft is not None and draft.token_ids == [12, 13, 14, 15] and draft.match_length == 2
    corpus.sync(prompt + [12, 13, 14])
    assert corpus.length == 13
    draft = corpus.draft(16, 8, 2.0, 0.1)
    assert draft is not None and draft.token_ids == [15, 16, 99, 10, 11, 12, 13, 14]
    corpus.sync(list(range(1000, 1400)))  # grows past its first buffer
    assert corpus.length == 400 and corpus.context[-1] == 1399
    assert corpus.draft(16, 4, 2.0, 0.1) is None  # nothing repeats


def test_shared_corpus_matches_across_answers_but_never_across_separators():
    shared = SharedCorpus(max_tokens=64)
    shared.add([1, 2, 3, 4])
    shared.add([7, 1, 2, 5])
    draft = shared.draft(arr([9, 9, 1, 2]), 8, 8, 4.0, 0.1)
    # "1 2" is followed by 3 (older) and by 5 (newer): a tie, the newer answer wins; then its separator ends it.
    assert draft is not None and draft.token_ids == [5] and draft.probabilities == [0.5]
    draft = shared.draft(arr([7, 1, 2]), 8, 8, 4.0, 0.1)
    assert draft is not None and draft.token_ids == [5] and draft.match_length == 3
    assert shared.draft(arr([4, 7]), 8, 8, 4.0, 0.1).match_length == 1  # "4 7" spans a separator: only "7"
    assert SEPARATOR not in shared.draft(arr([1]), 8, 8, 4.0, 0.01).token_ids


def test_shared_corpus_evicts_the_oldest_answers_to_stay_within_its_bound():
    shared = SharedCorpus(max_tokens=12)
    shared.add([1, 2, 3, 4, 5])  # 6 with its separator
    shared.add([6, 7, 8, 9, 10])  # 12: full
    shared.add([11, 12, 13])  # evicts the first answer
    assert shared.num_answers == 2 and shared.length == 10 and shared.length <= shared.max_tokens
    assert shared.draft(arr([1, 2]), 8, 8, 4.0, 0.1) is None
    assert shared.draft(arr([6, 7]), 8, 8, 4.0, 0.1).token_ids == [8, 9, 10]
    shared.add(list(range(100, 140)))  # longer than the bound: its last tokens are kept, alone
    assert shared.num_answers == 1 and shared.length == 12
    assert shared.draft(arr([135]), 8, 8, 4.0, 0.1).token_ids == [136, 137, 138, 139]


def test_tenant_corpora_keep_tenants_apart_and_drop_the_least_recently_used():
    corpora = TenantCorpora(max_tokens_per_tenant=32, max_tenants=2)
    corpora.add(b"a", [1, 2, 3])
    corpora.add(b"b", [1, 2, 4])
    assert corpora.get(b"b").draft(arr([1, 2]), 8, 8, 4.0, 0.1).token_ids == [4]
    assert corpora.get(b"a").draft(arr([1, 2]), 8, 8, 4.0, 0.1).token_ids == [3]
    corpora.add(b"c", [5])  # "a" was used more recently than "b": "b" goes
    assert len(corpora) == 2 and corpora.get(b"b") is None and corpora.get(b"a") is not None
    with pytest.raises(ValueError, match="max_tenants"):
        TenantCorpora(32, 0)
