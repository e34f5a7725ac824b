"""`KVBuffer`: one graph's KV cache, allocated once and written in place.

Layout per layer and kind: [capacity, batch, kv_heads, head_dim] (sequence-major), so rows
[0, past) are one contiguous block to bind as the graph's past input and rows
[past, past + seq) one contiguous block to bind as its present output. No step copies or
concatenates the cache; the only copy is compaction of an accepted tree path (a few rows).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np


class CapacityError(RuntimeError):
    """A forward would read or write past the end of a KV buffer."""


class KVBuffer:
    """Preallocated KV storage for one graph.

    `arrays[i]` pairs with `names[i]` = (past input name, present output name). Arrays are
    numpy on CPU backends; device backends pass their own array type (e.g. torch CUDA
    tensors) which must support slicing and fancy-index assignment.
    """

    def __init__(self, names: Sequence[tuple[str, str]], arrays: Sequence[Any]):
        if len(names) != len(arrays) or not arrays:
            raise ValueError("KVBuffer needs one array per (past, present) name pair")
        self.names = list(names)
        self.arrays = list(arrays)
        self.capacity = int(arrays[0].shape[0])

    @classmethod
    def allocate(cls, names, capacity: int, batch: int, kv_heads: int, head_dim: int, dtype) -> "KVBuffer":
        """Host (numpy) buffers, zero-filled once."""
        return cls(names, [np.zeros((capacity, batch, kv_heads, head_dim), dtype=dtype) for _ in names])

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) if hasattr(a, "nbytes") else a.numel() * a.element_size() for a in self.arrays)

    def check(self, past: int, seq: int) -> None:
        """Raise CapacityError unless rows [past, past + seq) fit."""
        if past < 0 or seq < 0 or past + seq > self.capacity:
            raise CapacityError(f"KV rows [{past}, {past + seq}) exceed the buffer capacity {self.capacity}")

    def compact(self, start: int, rows: Sequence[int]) -> None:
        """Move rows start + rows[j] to start + j for every layer (accepted tree path ->
        contiguous). `rows` must be increasing with rows[j] >= j, which a root-to-node path in
        tree order always is."""
        rows = np.asarray(rows, dtype=np.int64)
        if len(rows) == 0 or np.array_equal(rows, np.arange(len(rows))):
            return
        if np.any(np.diff(rows) <= 0) or rows[0] < 0:
            raise ValueError(f"compaction rows must be increasing and non-negative: {rows.tolist()}")
        self.check(start, int(rows[-1]) + 1)
        src = start + rows
        for a in self.arrays:
            a[start:start + len(rows)] = a[src]  # fancy index makes a temporary copy first
