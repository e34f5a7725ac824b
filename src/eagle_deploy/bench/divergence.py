"""Greedy identity: does EAGLE emit exactly what vanilla decoding emits on the same engine?

Lossless greedy speculation must reproduce plain greedy token for token, up to floating-point
noise: verification runs the target over many tokens at once, vanilla over one, and the two
kernels round differently. So each divergence is judged against a noise floor measured on
the same engine: the largest |logit difference| between a one-token-at-a-time pass and one
batched pass over the same ~16 positions. At the first differing position the target's own
top-2 logit gap is recomputed (one forward over the common prefix); a gap below the floor is
"numerics" (a near-tie that rounding can flip), a gap above it is "bug".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from eagle_deploy.runtime.backends.base import StepInputs
from eagle_deploy.runtime.drafter import causal_mask

NUMERICS, BUG = "numerics", "bug"


@dataclass(frozen=True)
class Divergence:
    """position: index into the generated tokens; eagle/vanilla: the tokens there; gap: the
    target's top-1 minus top-2 logit at that position; kind: "numerics" or "bug"."""

    position: int
    eagle: int | None
    vanilla: int | None
    gap: float | None
    kind: str

    def to_json(self) -> dict:
        return {"position": self.position, "eagle_token": self.eagle, "vanilla_token": self.vanilla,
                "top2_gap": None if self.gap is None else round(float(self.gap), 6), "class": self.kind}


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where two token lists differ (a length difference counts at the end
    of the shorter one); None when they are identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def classify(gap: float | None, floor: float) -> str:
    """"numerics" when the target's top-2 gap is below the measured batched-vs-single noise
    floor (rounding can flip such a near-tie), else "bug". An unknown gap counts as a bug."""
    return NUMERICS if gap is not None and gap < floor else BUG


def top2_gap(logits: np.ndarray) -> float:
    """top-1 minus top-2 of a [V] logit vector."""
    top = np.partition(np.asarray(logits, np.float64), -2)[-2:]
    return float(top.max() - top.min())


def _forward(backend, ids: Sequence[int], past: int, kv, logits_at) -> np.ndarray:
    n = len(ids)
    inputs = StepInputs(np.asarray(ids, np.int64)[None], np.arange(past, past + n)[None], causal_mask(past, n),
                        np.asarray(logits_at, np.int64)[None])
    return backend.run(inputs, kv, past).logits[0].copy()


def last_logits(backend, ids: Sequence[int]) -> np.ndarray:
    """Target logits after `ids` from one forward (a fresh KV buffer)."""
    kv = backend.allocate_kv(len(ids) + 1)
    return _forward(backend, ids, 0, kv, [len(ids) - 1])[0]


def batch_vs_single(backend, ids: Sequence[int]) -> float:
    """max |logit difference| between feeding `ids` one token per forward and in one batched
    forward (same engine, logits at every position)."""
    n = len(ids)
    batched = _forward(backend, ids, 0, backend.allocate_kv(n + 1), np.arange(n))
    kv = backend.allocate_kv(n + 1)
    single = np.stack([_forward(backend, [t], i, kv, [0])[0] for i, t in enumerate(ids)])
    return float(np.abs(batched.astype(np.float64) - single).max())


def check_greedy(backend, prompt: Sequence[int], eagle: Sequence[int], vanilla: Sequence[int],
                 floor: float) -> Divergence | None:
    """None when EAGLE's greedy output equals vanilla's; else the first divergence, its
    top-2 gap (one target forward over prompt + common prefix) and its class."""
    pos = first_difference(eagle, vanilla)
    if pos is None:
        return None
    gap = top2_gap(last_logits(backend, list(prompt) + list(vanilla[:pos])))
    at = lambda seq: int(seq[pos]) if pos < len(seq) else None  # noqa: E731
    return Divergence(pos, at(eagle), at(vanilla), gap, classify(gap, floor))


def summarize(records: list[dict], floor: float) -> dict:
    """Aggregate of per-prompt greedy records ({"identical": bool, "divergence": dict|None})."""
    divs = [r["divergence"] for r in records if r.get("divergence")]
    gaps = [d["top2_gap"] for d in divs if d.get("top2_gap") is not None]
    n = len(records)
    return {"prompts": n, "identical": sum(bool(r["identical"]) for r in records),
            "percent_identical": round(100.0 * sum(bool(r["identical"]) for r in records) / n, 1) if n else None,
            "numerics_floor": round(floor, 6), "numerics": sum(d["class"] == NUMERICS for d in divs),
            "bugs": sum(d["class"] == BUG for d in divs), "largest_gap_at_divergence": max(gaps) if gaps else None}
