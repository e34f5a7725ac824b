"""Sampling settings and the processed target distribution they define.

Temperature, top-k and top-p apply to the *target* distribution (in that order, as
transformers' logits warpers do); verification then samples exactly from it (see verify.py).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from eagle_deploy.contract.errors import SettingError

_PARTIAL = 1024  # top-p: sort only this many best tokens when they already hold top_p mass


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def finite_number(value, name: str) -> float:
    """`value` as a float if it is a real, finite number (True, "0.5", nan and inf are not);
    else SettingError (a ValueError) naming `name`. Range checks come after, so their
    messages stay true."""
    if not _is_real(value) or not math.isfinite(value):
        raise SettingError(name, f"must be a finite number, got {value!r}")
    return float(value)


def whole_number(value, name: str, minimum: int) -> int:
    """`value` as an int if it is a whole number >= `minimum` (3 and 3.0 pass; True, 3.5,
    inf and "3" do not); else SettingError (a ValueError) naming `name`."""
    if not _is_real(value) or not math.isfinite(value) or int(value) != value or value < minimum:
        raise SettingError(name, f"must be an integer >= {minimum}, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy (argmax, lowest token id on ties). top_k 0 = off; top_p 1 = off.
    seed: None draws a fresh seed; an int makes sampled runs reproducible. A bad value raises
    SettingError naming the field."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self):
        if finite_number(self.temperature, "temperature") < 0:
            raise SettingError("temperature", f"must be >= 0, got {self.temperature!r}")
        if not (0.0 < finite_number(self.top_p, "top_p") <= 1.0):
            raise SettingError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        object.__setattr__(self, "top_k", whole_number(self.top_k, "top_k", 0))
        if self.seed is not None:
            object.__setattr__(self, "seed", whole_number(self.seed, "seed", 0))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def rng(self) -> np.random.Generator:
        return np.random.default_rng(self.seed)


def greedy_token(logits: np.ndarray) -> int:
    """argmax of [V] logits; ties go to the lowest id."""
    return int(np.argmax(logits))


def target_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """[V] logits -> [V] float64 probabilities after temperature, top-k and top-p.

    top-p keeps the smallest set of most likely tokens whose mass reaches top_p (the token
    that crosses the threshold included), then renormalises."""
    if params.greedy:
        p = np.zeros(len(logits), dtype=np.float64)
        p[greedy_token(logits)] = 1.0
        return p
    z = logits.astype(np.float64)
    with np.errstate(over="ignore"):  # <= 0 before dividing: a tiny T gives -inf (probability 0), never NaN
        z = (z - z.max()) / params.temperature
    if params.top_k and params.top_k < len(z):
        kth = np.partition(z, len(z) - params.top_k)[len(z) - params.top_k]
        z = np.where(z >= kth, z, -np.inf)
    p = np.exp(z)
    p /= p.sum()
    if params.top_p < 1.0:
        p = _top_p(p, params.top_p)
    return p


def _top_p(p: np.ndarray, top_p: float) -> np.ndarray:
    n = min(_PARTIAL, len(p))
    cand = np.argpartition(-p, n - 1)[:n] if n < len(p) else np.arange(len(p))
    if p[cand].sum() < top_p:
        cand = np.arange(len(p))
    order = cand[np.argsort(-p[cand], kind="stable")]
    cum = np.cumsum(p[order])
    keep = order[: int(np.searchsorted(cum, top_p)) + 1]
    out = np.zeros_like(p)
    out[keep] = p[keep]
    return out / out.sum()


def sample(p: np.ndarray, rng: np.random.Generator) -> int:
    """One draw from [V] probabilities (inverse CDF; exact for float64 inputs)."""
    cdf = np.cumsum(p)
    i = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    # u * cdf[-1] can round up to cdf[-1]: fall back to the last token that has any mass
    return i if i < len(p) else int(np.flatnonzero(p)[-1])
