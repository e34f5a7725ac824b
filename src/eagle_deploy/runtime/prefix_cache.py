"""`PrefixCache`: target KV and draft features of earlier requests, reused exactly by later
requests that start with the same tokens (multi-turn chat, a shared system prompt, few-shot
templates), as vLLM's automatic prefix caching, SGLang's RadixAttention and llama.cpp's
cache_prompt reuse them.

Exactness. A prefill run in chunks of two rows or more computes every row with the same bits
as one forward of the whole prompt (decode.Decoder, `prefill_chunk`;
tests/runtime/test_prefill_chunk.py), so a row's KV and features depend only on the tokens up
to it. An entry holds only rows computed that way:
- a prompt's rows, from its prefill (chunks of 2 or more rows: decode.chunk_end);
- an answer's rows once *settled*: the answer's tokens, computed in tree verifications and
  one-token forwards whose rows may differ in the last bit, are run again after the request
  has ended as prefill chunks at past = the prompt's length (Decoder.settle), which rewrites
  their KV rows and gives their features as a fresh prefill of prompt + answer would.
A later prompt of n tokens whose first p tokens are an entry's copies those p rows of KV and
features in and prefills rows [p, n) in chunks, p <= n - 2 so the last chunk still has two
rows (never a one-row forward, whose kernel rounds differently; row-exact decoding needs the
same): its logits, features and KV are those of a fresh prefill, bit for bit
(tests/runtime/test_prefix_cache.py), and its tokens the same with the cache as without.

Entries are kept in least-recently-used order and scanned for the longest common prefix (a
handful of entries, each compared with one numpy operation; no trie); an entry another one
extends is dropped when the longer one is stored (a conversation's turns keep one entry).
Entries do not share rows: two prompts with one system prompt each hold its rows (a radix
tree would share them). They are evicted least recently used first, so that `nbytes` stays
within the budget; an entry larger than the whole budget is not stored.

One cache per loaded export: it lives and dies with its EagleRuntime (or BatchRuntime), so it
is invalidated with the export. Its rows are those of the graph that prefills: the export's
int8 prefill graph where the runtime uses one (RuntimeOptions.prefill_graph; prompts and
settled answers both run on it, so an entry is still what a fresh prefill computes), else the
target graph; a cache handed to another runtime (EagleRuntime's `prefix_cache`) must come from
one that prefills with the same graph. A BatchRuntime's slots share one cache (a lock guards it), so a
conversation's next turn hits whichever slot it lands on: a superset of a cache per slot.
The arrays are host (numpy) arrays: the onnxruntime CPU backend only (RuntimeOptions), and
only for the fused target graph (KV layout "shared"): the standard-op graph (`--graph
standard`) computes a prompt's rows in the last bit differently in parts than at once
(EagleRuntime refuses the cache for it).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .kv import KVBuffer


@dataclass(frozen=True)
class PrefixEntry:
    """One cached sequence: its token ids [n], per KV array i (KVBuffer order) rows [0, n)
    sequence-major `kv[i]` [n, 1, kv_heads, head_dim], and the target's draft features
    `features` [n, F] (EAGLE-3: the tapped features). Never written after it is made."""

    tokens: np.ndarray
    kv: tuple[np.ndarray, ...]
    features: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.tokens.nbytes + sum(a.nbytes for a in self.kv) + self.features.nbytes)

    @classmethod
    def of(cls, tokens: Sequence[int], kv: KVBuffer, features: np.ndarray) -> "PrefixEntry":
        """A copy of rows [0, len(tokens)) of `kv` (batch 1) with their `features` [n, F]."""
        n = len(tokens)
        if features.shape[0] != n:
            raise ValueError(f"{features.shape[0]} feature rows for {n} tokens")
        return cls(np.asarray(tokens, np.int64).copy(), tuple(kv.rows(i)[:n].copy() for i in range(len(kv.arrays))),
                   np.ascontiguousarray(features).copy())

    def load(self, kv: KVBuffer, rows: int) -> None:
        """Copy rows [0, rows) into `kv` (batch 1, the layout it was copied from)."""
        for i in range(len(kv.arrays)):
            kv.rows(i)[:rows] = self.kv[i][:rows]

    def common(self, tokens: np.ndarray) -> int:
        """How many leading tokens `tokens` shares with this entry."""
        k = min(len(tokens), len(self.tokens))
        differ = np.flatnonzero(tokens[:k] != self.tokens[:k])
        return int(differ[0]) if len(differ) else k


@dataclass
class CacheCounters:
    """lookups: prompts looked up; hits: of them, prompts that reused cached rows;
    cached_tokens: rows reused in all; stored / evicted: entries; settled: answers settled
    (Decoder.settle), settle_seconds: the time they took (after their requests ended)."""

    lookups: int = 0
    hits: int = 0
    cached_tokens: int = 0
    stored: int = 0
    evicted: int = 0
    settled: int = 0
    settle_seconds: float = 0.0


@dataclass
class PrefixCache:
    """Entries under a byte budget, least recently used evicted first (module doc).
    Thread-safe: `match` and `store` hold a lock; an entry's arrays are never written, so a
    caller copies from a matched entry after the lock is released."""

    budget: int  # bytes
    counters: CacheCounters = field(default_factory=CacheCounters)

    def __post_init__(self):
        if isinstance(self.budget, bool) or not isinstance(self.budget, int) or self.budget < 0:
            raise ValueError(f"a prefix cache's budget is a whole number of bytes >= 0, got {self.budget!r}")
        self._entries: OrderedDict[int, PrefixEntry] = OrderedDict()  # least recently used first
        self._next = 0
        self._lock = threading.Lock()

    @classmethod
    def of_mb(cls, mb: float) -> "PrefixCache | None":
        """A cache of `mb` MiB (RuntimeOptions.prefix_cache_mb), None for 0 (off)."""
        return cls(int(mb * 2**20)) if mb else None

    @property
    def nbytes(self) -> int:
        """Bytes the entries hold (at most `budget`)."""
        with self._lock:
            return sum(e.nbytes for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[PrefixEntry]:
        """The entries, least recently used first."""
        with self._lock:
            return list(self._entries.values())

    def match(self, tokens: Sequence[int], most: int) -> tuple[int, PrefixEntry | None]:
        """(p, entry): the longest prefix of `tokens` an entry holds, at most `most` tokens,
        and that entry (the most recently used among equals; it becomes the most recent);
        (0, None) when none shares a token. Counts the lookup and, for p > 0, the hit."""
        ids = np.asarray(tokens, np.int64)
        with self._lock:
            self.counters.lookups += 1
            best, found = 0, None
            for key, entry in reversed(self._entries.items()):
                p = entry.common(ids)
                if p > best:
                    best, found = p, key
            p = min(best, most)
            if p <= 0:
                return 0, None
            self._entries.move_to_end(found)
            self.counters.hits += 1
            self.counters.cached_tokens += p
            return p, self._entries[found]

    def store(self, entry: PrefixEntry) -> bool:
        """Add `entry` as the most recent (dropping entries it extends, then the least recently
        used while over budget); False when it is larger than the budget or an entry already
        holds all its tokens (that one becomes the most recent)."""
        size = entry.nbytes
        if size > self.budget:
            return False
        with self._lock:
            for key, old in list(self._entries.items()):
                p = old.common(entry.tokens)
                if p == len(entry.tokens):  # already held: nothing new
                    self._entries.move_to_end(key)
                    return False
                if p == len(old.tokens):  # the new entry extends it (a conversation's next turn)
                    del self._entries[key]
            held = sum(e.nbytes for e in self._entries.values())
            while self._entries and held + size > self.budget:
                _, old = self._entries.popitem(last=False)
                held -= old.nbytes
                self.counters.evicted += 1
            self._entries[self._next] = entry
            self._next += 1
            self.counters.stored += 1
            return True

    def settled(self, seconds: float) -> None:
        """Count one answer settled (Decoder.settle) and the seconds it took."""
        with self._lock:
            self.counters.settled += 1
            self.counters.settle_seconds += seconds

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
