"""Context lookup: draft tokens copied from the request's own context (prompt lookup decoding,
Saxena 2023; the n-gram drafter of vLLM and Spec-Bench's "PLD").

The latest n committed tokens (n from `max_ngram` down to `min_ngram`) are matched against
earlier positions of the prompt and the text generated so far; the tokens that followed the
most recent earlier occurrence are the proposal. `propose_all` also returns the continuations
of other earlier occurrences that start with another token (the latest occurrence per first
token, longest suffix first), so a draft tree can try several of them as siblings, as the suffix
structures of SAM-Decoding and Arctic Inference's suffix decoding do. Summaries, RAG answers,
extraction and code edits copy long spans of their prompt, and those spans are exactly what a
draft head trained on other text does not predict.

The index is per request and bounded by the request's length: for each n-gram, the end of its
latest occurrence per following token, at most `candidates` of them (the most recent kept), so
at most `(max_ngram - min_ngram + 1) * len(committed)` n-grams and `candidates` ends each,
updated incrementally.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class LookupMatch:
    """A proposal: `tokens` (the continuation, at most the requested length) that followed
    the latest earlier occurrence of the last `ngram` committed tokens."""

    ngram: int
    tokens: list[int]


class ContextLookup:
    """Incremental n-gram index over one request's committed tokens.

    min_ngram / max_ngram: suffix lengths tried, longest first (ValueError unless
    1 <= min_ngram <= max_ngram); candidates: most continuations kept per n-gram, with distinct
    first tokens (ValueError below 1). `reset()` starts a new request."""

    def __init__(self, min_ngram: int = 1, max_ngram: int = 3, candidates: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"context lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if candidates < 1:
            raise ValueError(f"context lookup needs candidates >= 1, got {candidates}")
        self.min_ngram, self.max_ngram, self.candidates = min_ngram, max_ngram, candidates
        self.reset()

    def reset(self) -> None:
        self._tokens: list[int] = []
        # n-gram -> {first following token: position right after that occurrence}, oldest first
        self._index: dict[tuple[int, ...], dict[int, int]] = {}

    def _extend(self, committed: Sequence[int]) -> None:
        """Index every n-gram that ends before the last committed token (its continuation,
        at least one token, is known)."""
        n_old = len(self._tokens)
        if n_old > len(committed) or list(committed[: min(n_old, 8)]) != self._tokens[: min(n_old, 8)]:
            self.reset()  # another request's tokens: start over
            n_old = 0
        self._tokens.extend(int(t) for t in committed[n_old:])
        toks = self._tokens
        # end positions e (exclusive) already indexed: those < n_old; e == len(toks) has no continuation
        for e in range(max(n_old, 1), len(toks)):
            for n in range(self.min_ngram, min(self.max_ngram, e) + 1):
                ends = self._index.setdefault(tuple(toks[e - n:e]), {})
                ends.pop(toks[e], None)  # re-inserted as the latest
                ends[toks[e]] = e
                if len(ends) > self.candidates:
                    del ends[next(iter(ends))]  # the oldest

    def propose(self, committed: Sequence[int], length: int) -> LookupMatch | None:
        """The continuation (at most `length` tokens) of the latest earlier occurrence of the
        longest matching suffix of `committed`, or None when no suffix of at least min_ngram
        tokens occurred before."""
        found = self.propose_all(committed, length, 1)
        return found[0] if found else None

    def propose_all(self, committed: Sequence[int], length: int, limit: int) -> list[LookupMatch]:
        """Up to `limit` continuations (each at most `length` tokens) with distinct first
        tokens: the longest matching suffix's occurrences latest first, then shorter suffixes'
        (the first is `propose`'s). [] when nothing matches or length < 1."""
        if length < 1 or limit < 1:
            return []
        self._extend(committed)
        toks, out, firsts = self._tokens, [], set()
        for n in range(min(self.max_ngram, len(toks) - 1), self.min_ngram - 1, -1):
            for first, start in reversed(self._index.get(tuple(toks[len(toks) - n:]), {}).items()):
                if first not in firsts:
                    firsts.add(first)
                    out.append(LookupMatch(n, toks[start:start + length]))
                    if len(out) == limit:
                        return out
        return out
