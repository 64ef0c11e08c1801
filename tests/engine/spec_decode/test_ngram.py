"""N-gram prompt lookup against a brute-force reference, and the draft caps."""

from __future__ import annotations

import random

import pytest

from engine.spec_decode.ngram import NgramProposer


def naive_propose(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The rule spelled out: n from max_n down to min_n; the latest earlier
    start j with tokens[j:j+n] == the last n tokens; the k tokens after it."""
    for n in range(max_n, min_n - 1, -1):
        if len(tokens) <= n:
            continue
        suffix = tokens[-n:]
        for j in range(len(tokens) - n - 1, -1, -1):
            if tokens[j:j + n] == suffix:
                return tokens[j + n:j + n + k]
    return []


def test_drafts_the_continuation_of_the_latest_longest_match():
    p = NgramProposer(min_n=1, max_n=3)
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 1, 6, 7, 9, 5, 6, 7]
    # The 3-gram [5, 6, 7] recurs at 0; the 2-gram [6, 7] later at 5 loses to it.
    assert p.propose(tokens, 2) == [8, 1]
    assert p.propose([1, 2, 3, 9, 2, 3], 3) == [9, 2, 3]  # the 2-gram at 1 (no 3-gram match)
    assert p.propose([4, 1, 4, 2, 4], 1) == [2]  # the latest of two 1-gram matches


def test_no_match_or_too_short_proposes_nothing():
    p = NgramProposer(min_n=2, max_n=4)
    assert p.propose([1, 2, 3, 4], 4) == []
    assert p.propose([1, 2, 9, 2], 4) == []  # only a 1-gram recurs
    assert p.propose([7], 4) == []
    assert p.propose([1, 2, 1, 2], 0) == []


def test_a_repeating_pattern_drafts_into_its_own_suffix():
    p = NgramProposer(min_n=1, max_n=4)
    assert p.propose([3, 4, 3, 4, 3], 5) == [4, 3]  # all that follows the match


@pytest.mark.parametrize("min_n,max_n", [(1, 1), (1, 4), (2, 4), (3, 5)])
def test_matches_the_brute_force_rule_on_random_sequences(min_n, max_n):
    rng = random.Random(min_n * 10 + max_n)
    p = NgramProposer(min_n=min_n, max_n=max_n)
    for _ in range(400):
        tokens = [rng.randrange(rng.choice([2, 4, 12])) for _ in range(rng.randrange(1, 40))]
        k = rng.randrange(0, 6)
        assert p.propose(tokens, k) == naive_propose(tokens, k, min_n, max_n), tokens
