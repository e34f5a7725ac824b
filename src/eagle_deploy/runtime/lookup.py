"""Context lookup: draft tokens copied from the request's own context (prompt lookup decoding,
Saxena 2023; the n-gram drafter of vLLM and Spec-Bench's "PLD").

The latest n committed tokens (n from `max_ngram` down to `min_ngram`) are matched against
earlier positions of the prompt and the text generated so far; the tokens that followed the
most recent earlier occurrence are the proposal. Summaries, RAG answers, extraction and code
edits copy long spans of their prompt, and those spans are exactly what a draft head trained
on other text does not predict.

The index is per request and bounded by the request's length: one entry per (n, position),
at most `(max_ngram - min_ngram + 1) * len(committed)` entries, updated incrementally.
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
    1 <= min_ngram <= max_ngram). `reset()` starts a new request."""

    def __init__(self, min_ngram: int = 1, max_ngram: int = 3):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"context lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.reset()

    def reset(self) -> None:
        self._tokens: list[int] = []
        self._index: dict[tuple[int, ...], int] = {}  # n-gram -> position right after its latest occurrence

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
                self._index[tuple(toks[e - n:e])] = e

    def propose(self, committed: Sequence[int], length: int) -> LookupMatch | None:
        """The continuation (at most `length` tokens) of the longest matching suffix of
        `committed`, or None when no suffix of at least min_ngram tokens occurred before."""
        if length < 1:
            return None
        self._extend(committed)
        toks = self._tokens
        for n in range(min(self.max_ngram, len(toks) - 1), self.min_ngram - 1, -1):
            start = self._index.get(tuple(toks[len(toks) - n:]))
            if start is not None:
                return LookupMatch(n, toks[start:start + length])
        return None
