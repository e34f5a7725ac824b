"""`KVBuffer`: one graph's KV cache, allocated once and written in place.

Two layouts per layer and kind (`onnx_io.KV_LAYOUTS`, chosen by the graph):
- "seq_major" [capacity, batch, kv_heads, head_dim]: rows [0, past) are one contiguous block
  to bind as the graph's past input and rows [past, past + seq) one contiguous block to bind
  as its present output (standard-op graphs, TensorRT);
- "shared" [batch, kv_heads, capacity, head_dim]: the whole buffer is bound as both the past
  input and the present output, and the graph's fused attention writes rows [past, past + seq)
  in place (onnxruntime's GroupQueryAttention with a shared past/present buffer).
No step copies or concatenates the cache; the only copy is compaction of an accepted tree
path (a few rows). `rows(i)` views array i sequence-major in either layout.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from eagle_deploy.contract.onnx_io import KV_LAYOUTS, KV_SEQ_AXIS, KV_SEQ_MAJOR, KV_SHARED


class CapacityError(RuntimeError):
    """A forward would read or write past the end of a KV buffer."""


def _seq_first(a, axis: int):
    """View of `a` (numpy or torch) with axis `axis` moved first."""
    if axis == 0:
        return a
    return a.movedim(axis, 0) if hasattr(a, "movedim") else np.moveaxis(a, axis, 0)


class KVBuffer:
    """Preallocated KV storage for one graph.

    `arrays[i]` pairs with `names[i]` = (past input name, present output name); `layout` is
    the graph's KV layout. Arrays are numpy on CPU backends; device backends pass their own
    array type (e.g. torch CUDA tensors) which must support slicing and fancy-index assignment.
    """

    def __init__(self, names: Sequence[tuple[str, str]], arrays: Sequence[Any], layout: str = KV_SEQ_MAJOR):
        if len(names) != len(arrays) or not arrays:
            raise ValueError("KVBuffer needs one array per (past, present) name pair")
        if layout not in KV_LAYOUTS:
            raise ValueError(f"KV layout {layout!r} is not one of {', '.join(KV_LAYOUTS)}")
        self.names = list(names)
        self.arrays = list(arrays)
        self.layout = layout
        self.seq_axis = KV_SEQ_AXIS[layout]
        self.capacity = int(arrays[0].shape[self.seq_axis])
        self.batch = int(arrays[0].shape[1 if self.seq_axis == 0 else 0])  # seq_major [cap, B, ..]; shared [B, ..]

    @staticmethod
    def shape(layout: str, capacity: int, batch: int, kv_heads: int, head_dim: int) -> tuple[int, int, int, int]:
        """The shape of one array of `layout`."""
        if layout == KV_SHARED:
            return (batch, kv_heads, capacity, head_dim)
        return (capacity, batch, kv_heads, head_dim)

    @classmethod
    def allocate(cls, names, capacity: int, batch: int, kv_heads: int, head_dim: int, dtype,
                 layout: str = KV_SEQ_MAJOR) -> "KVBuffer":
        """Host (numpy) buffers, zero-filled once."""
        shape = cls.shape(layout, capacity, batch, kv_heads, head_dim)
        return cls(names, [np.zeros(shape, dtype=dtype) for _ in names], layout)

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) if hasattr(a, "nbytes") else a.numel() * a.element_size() for a in self.arrays)

    def slots(self, lo: int, hi: int) -> "KVBuffer":
        """Sequences [lo, hi) of a batched buffer as a KVBuffer of batch hi - lo (views: writes go
        to this buffer). In the "shared" layout they are one contiguous block, which a backend
        can bind for a forward of those sequences alone; in "seq_major" they are strided
        (compaction and reads work; binding by pointer does not)."""
        if not 0 <= lo < hi <= self.batch:
            raise IndexError(f"slots [{lo}, {hi}) of a KV buffer holding {self.batch} sequences")
        if self.layout == KV_SHARED:
            return KVBuffer(self.names, [a[lo:hi] for a in self.arrays], self.layout)
        return KVBuffer(self.names, [a[:, lo:hi] for a in self.arrays], self.layout)

    def rows(self, i: int):
        """Array i viewed sequence-major, [capacity, batch, kv_heads, head_dim], in either
        layout (a view: writes go to the buffer)."""
        return _seq_first(self.arrays[i], self.seq_axis)

    def check(self, past: int, seq: int) -> None:
        """Raise CapacityError unless rows [past, past + seq) fit."""
        if past < 0 or seq < 0 or past + seq > self.capacity:
            raise CapacityError(f"KV rows [{past}, {past + seq}) exceed the buffer capacity {self.capacity}")

    def compact(self, start: int, rows: Sequence[int]) -> None:
        """Move rows start + rows[j] to start + j for every layer (accepted tree path ->
        contiguous). `rows` must be increasing with rows[j] >= j, which a root-to-node path in
        tree order always is."""
        if all(int(r) == j for j, r in enumerate(rows)):  # already in place (vanilla decoding: [0]); no numpy
            return
        rows = np.asarray(rows, dtype=np.int64)
        if np.any(np.diff(rows) <= 0) or rows[0] < 0:
            raise ValueError(f"compaction rows must be increasing and non-negative: {rows.tolist()}")
        self.check(start, int(rows[-1]) + 1)
        src = start + rows
        for i in range(len(self.arrays)):
            a = self.rows(i)
            a[start:start + len(rows)] = a[src]  # fancy index makes a temporary copy first
