"""Prompt-lookup proposals (engine_server.speculative.ngram)."""

from __future__ import annotations

import random

import pytest

from engine_server.speculative.ngram import NgramProposer


def test_the_continuation_of_the_latest_earlier_match_is_proposed() -> None:
    proposer = NgramProposer(min_n=2, max_n=3)
    tokens = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert proposer.propose("r", tokens, 3) == [7, 8, 1]  # the later "1 2 3" was followed by 7 8 1


def test_the_longest_matching_n_wins() -> None:
    proposer = NgramProposer(min_n=1, max_n=3)
    tokens = [5, 6, 7, 40, 9, 7, 41, 5, 6, 7]
    assert proposer.propose("r", tokens, 1) == [40]  # "5 6 7" matched, though "7" alone matched later (41)


def test_nothing_matching_proposes_nothing_and_max_tokens_bounds() -> None:
    proposer = NgramProposer(min_n=2, max_n=4)
    assert proposer.propose("r", [1, 2, 3, 4], 4) == []
    assert proposer.propose("s", [1, 2, 3, 4, 5, 6, 1, 2], 2) == [3, 4]


def test_growing_a_sequence_proposes_as_indexing_it_whole() -> None:
    rng = random.Random(0)
    tokens = [rng.randrange(6) for _ in range(300)]
    growing = NgramProposer(min_n=2, max_n=4)
    for end in range(1, len(tokens) + 1):
        fresh = NgramProposer(min_n=2, max_n=4)
        assert growing.propose("r", tokens[:end], 5) == fresh.propose("r", tokens[:end], 5)


def test_finish_forgets_the_request() -> None:
    proposer = NgramProposer()
    proposer.propose("r", [1, 2, 3, 1, 2], 2)
    proposer.finish("r", [1, 2, 3, 1, 2], 3)
    proposer.finish("unknown", [], 0)
    assert proposer.propose("r", [7, 8, 1, 2], 2) == []  # a fresh index: the old "1 2 -> 3" is gone


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError):
        NgramProposer(min_n=3, max_n=2)


def test_a_match_near_the_end_goes_on_with_its_period() -> None:
    proposer = NgramProposer(min_n=2, max_n=2)
    # "7 8" occurred 3 tokens back (followed by 9 7 8): the loop 9 7 8 continues.
    assert proposer.propose("r", [1, 2, 7, 8, 9, 7, 8], 7) == [9, 7, 8, 9, 7, 8, 9]
