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


def brute_force_all(tokens, length, limit, min_n=1, max_n=3, candidates=3):
    """propose_all's rule from scratch: per suffix length (longest first), the latest
    occurrence per following token, latest first, at most `candidates` of them per suffix
    (the most recent), first tokens distinct across the whole answer."""
    out, firsts = [], set()
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix, seen = tokens[len(tokens) - n:], []
        for start in range(len(tokens) - 1, n - 1, -1):
            if tokens[start - n:start] == suffix and tokens[start] not in [tokens[s] for s in seen]:
                seen.append(start)
        for start in seen[:candidates]:
            if tokens[start] not in firsts:
                firsts.add(tokens[start])
                out.append((n, tokens[start:start + length]))
    return out[:limit]


def test_several_continuations_with_distinct_first_tokens():
    look = ContextLookup(1, 3, candidates=3)
    #         0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [1, 2, 7, 5, 1, 2, 8, 1, 2, 7, 6, 1, 2]
    got = [(m.ngram, m.tokens) for m in look.propose_all(tokens, 3, 5)]
    # [1, 2] was followed by 7 (latest at 9), 8 (at 6); then the 1-gram [2] adds nothing new
    assert got == [(2, [7, 6, 1]), (2, [8, 1, 2])]
    assert look.propose(tokens, 3).tokens == [7, 6, 1]
    assert look.propose_all(tokens, 3, 1) == look.propose_all(tokens, 3, 5)[:1]
    assert look.propose_all(tokens, 0, 3) == [] and look.propose_all(tokens, 3, 0) == []


def test_incremental_candidates_equal_a_fresh_search_on_random_sequences():
    rng = np.random.default_rng(1)
    for trial in range(30):
        seq = rng.integers(0, 5, 60).tolist()
        look = ContextLookup(1, 3, candidates=3)
        for end in range(2, len(seq) + 1, int(rng.integers(1, 4))):
            got = [(m.ngram, m.tokens) for m in look.propose_all(seq[:end], 4, 4)]
            assert got == brute_force_all(seq[:end], 4, 4), (trial, end)


def test_the_index_keeps_at_most_candidates_ends_per_ngram():
    look = ContextLookup(1, 2, candidates=2)
    look.propose_all(list(range(5)) * 20 + [0, 9, 0, 8, 0, 7, 0], 2, 5)
    assert max(len(ends) for ends in look._index.values()) == 2
    assert list(look._index[(0,)]) == [8, 7]  # 0 was last followed by 8, then 7: the latest two


def test_bad_candidates_are_refused():
    with pytest.raises(ValueError, match="candidates >= 1"):
        ContextLookup(1, 3, candidates=0)
