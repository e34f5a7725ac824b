"""The rows of a batched forward: one slot's forward as a `BatchRuntime` holds it (`_Call`), the
slots' inputs padded into one batched forward (`_pad`), each slot's rows of its outputs
(`_rows`), a chunked prefill's outputs joined (`_join_chunks`), and outputs copied out of the
backend's reused arrays (`_copied`).

How rows are laid out (each row at its own past, its new tokens first, padding after them):
runtime/batch.py's module doc, "Padding". These are the batch runtime's own helpers (runtime/batch.py
imports them), not an API.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np

from .backends.base import StepInputs, StepOutputs

# output fields whose axis 1 follows logits_indices (N); every other output follows the new tokens (S)
_PER_LOGIT = {"logits", "topk_logprobs", "topk_ids"}


@dataclass
class _Call:
    """One slot's forward waiting for the batch runtime."""

    slot: int
    role: str  # "target" | "draft"
    inputs: StepInputs
    past: int
    result: StepOutputs | BaseException | None = None
    done: bool = False
    rows_done: int = 0  # a chunked prefill: rows already run
    parts: list = field(default_factory=list)  # a chunked prefill: (first row, last row + 1, outputs, logit rows)

    @property
    def seq(self) -> int:
        return int(self.inputs.input_ids.shape[1])

    @property
    def signature(self) -> tuple:
        """Forwards with equal signatures can share one batched forward."""
        rows = tuple(a is not None and a.shape[1] > 0 for a in (self.inputs.features, self.inputs.tapped_features))
        return (self.role, rows)


def _copied(out: StepOutputs) -> StepOutputs:
    """`out` with its arrays copied (a backend reuses its output arrays on the next call)."""
    return type(out)(**{f.name: None if getattr(out, f.name) is None else getattr(out, f.name).copy()
                        for f in fields(out)})


def _join_chunks(parts: list, want: np.ndarray) -> StepOutputs:
    """One prefill's outputs from its chunks [(a, b, outputs, logit rows)]: the per-token
    outputs concatenated along the rows, the per-logit ones (_PER_LOGIT) taken at `want` (the
    prefill's logits_indices) from the chunk holding each row."""
    kind = type(parts[0][2])
    joined = {}
    for f in fields(kind):
        if getattr(parts[0][2], f.name) is None:
            joined[f.name] = None
        elif f.name in _PER_LOGIT:
            picks = []
            for i in (int(i) for i in want):
                _, _, out, rows = next(p for p in parts if p[0] <= i < p[1])
                picks.append(getattr(out, f.name)[:, rows.index(i)])
            joined[f.name] = np.stack(picks, axis=1)
        else:
            joined[f.name] = np.concatenate([getattr(out, f.name) for _, _, out, _ in parts], axis=1)
    return kind(**joined)


def _rows(a: np.ndarray | None, slot: int, n: int) -> np.ndarray | None:
    """Slot `slot`'s first n rows of a batched output, as batch 1 (a view)."""
    return None if a is None else a[slot:slot + 1, :n]


def _pad(calls: dict[int, _Call], pasts: list[int], S: int) -> StepInputs:
    """The batched StepInputs for len(pasts) rows (`calls` by row): row b at past pasts[b] with
    S new tokens, its call's tokens first and padding after them (runtime/batch.py, "Padding")."""
    B, T = len(pasts), max(pasts) + S
    group = list(calls.values())
    N = max(c.inputs.logits_indices.shape[1] for c in group)
    ids = np.zeros((B, S), np.int64)
    pos = np.full((B, S), min(int(c.inputs.position_ids.min()) for c in group), np.int64)
    mask = np.zeros((B, S, T), bool)
    for b, past in enumerate(pasts):
        mask[b, np.arange(S), past + np.arange(S)] = True  # padding rows see themselves only
    logits_at = np.zeros((B, N), np.int64)
    first = group[0].inputs
    feats = {name: None if a is None else np.zeros((B, S if a.shape[1] else 0, a.shape[2]), a.dtype)
             for name, a in (("features", first.features), ("tapped_features", first.tapped_features))}
    for b, c in calls.items():
        s, x, past = c.seq, c.inputs, c.past
        ids[b, :s], pos[b, :s] = x.input_ids[0], x.position_ids[0]
        mask[b, :s, :past + s] = x.attention_mask[0]
        logits_at[b, :x.logits_indices.shape[1]] = x.logits_indices[0]
        for name, buf in feats.items():
            if buf is not None and buf.shape[1]:
                buf[b, :s] = getattr(x, name)[0]
    return StepInputs(ids, pos, mask, logits_at, feats["features"], feats["tapped_features"])
