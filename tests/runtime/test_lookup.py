"""Context lookup (runtime/lookup.py): the latest earlier occurrence of the longest matching
suffix, its continuation, an index that grows with the request and starts over on reset."""
from __future__ import annotations

import numpy as np
import pytest

from eagle_deploy.runtime.lookup import ContextLookup


def brute_force(tokens, length, min_n=1, max_n=3):
    """The reference rule, recomputed from scratch."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for start in range(len(tokens) - 1, n - 1, -1):  # latest occurrence that ends before the end
            if tokens[start - n:start] == suffix:
                return n, tokens[start:start + length]
    return None


def test_the_longest_suffix_wins_and_its_latest_occurrence():
    look = ContextLookup(1, 3)
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [7, 1, 2, 3, 9, 1, 2, 4, 5, 1, 2]
    m = look.propose(tokens, 4)
    assert (m.ngram, m.tokens) == (2, [4, 5, 1, 2])  # [1, 2] last seen at 5..6, followed by 4
    look.reset()
    m = look.propose([7, 8, 1, 2, 3, 1, 2, 3, 0, 7, 8], 3)
    assert (m.ngram, m.tokens) == (2, [1, 2, 3])


def test_no_match_gives_none_and_length_caps_the_continuation():
    look = ContextLookup(2, 3)
    assert look.propose([1, 2, 3, 4], 5) is None  # no 2-gram repeats
    look.reset()
    assert look.propose([1, 2, 3, 1, 2], 1).tokens == [3]
    assert look.propose([1, 2, 3, 1, 2], 0) is None


def test_incremental_index_equals_a_fresh_one_on_random_sequences():
    rng = np.random.default_rng(0)
    for trial in range(30):
        seq = rng.integers(0, 6, 60).tolist()
        look = ContextLookup(1, 3)
        for end in range(2, len(seq) + 1, int(rng.integers(1, 4))):
            m = look.propose(seq[:end], 5)
            want = brute_force(seq[:end], 5)
            assert (None if m is None else (m.ngram, m.tokens)) == want, (trial, end)


def test_a_new_request_starts_over():
    look = ContextLookup(1, 2)
    assert look.propose([4, 5, 4], 2).tokens == [5, 4]
    look.reset()
    assert look.propose([9, 8, 7], 2) is None
    assert look.propose([4, 5, 6, 4], 2).tokens == [5, 6]  # other tokens than before: no stale entries


@pytest.mark.parametrize("lo, hi", [(0, 2), (3, 2)])
def test_bad_ngram_bounds_are_refused(lo, hi):
    with pytest.raises(ValueError, match="min_ngram <= max_ngram"):
        ContextLookup(lo, hi)
