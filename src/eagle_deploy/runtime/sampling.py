"""Sampling settings and the processed target distribution they define.

Temperature, min-p, top-k and top-p apply to the *target* distribution (in that order, as
vLLM's sampler applies them; min-p and top-k keep the same set in either order); verification
then samples exactly from it (see verify.py). logit_bias and the penalties change the logits
before that, node by node of a draft tree (shaping.LogitShaper).
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
    """temperature 0 = greedy (argmax, lowest token id on ties). top_k 0 = off; top_p 1 = off;
    min_p 0 = off (else tokens less likely than min_p times the most likely one are dropped).
    seed: None draws a fresh seed; an int makes sampled runs reproducible.
    logit_bias: ((token id, bias), ...) added to those logits, each bias in [-100, 100] (OpenAI's
    range; -100 bans a token); repetition_penalty > 0 (1 = off; vLLM's extension) over the
    prompt's and the generated tokens; frequency_penalty and presence_penalty in [-2, 2] (0 =
    off) over the generated tokens (shaping.LogitShaper). A bad value raises SettingError
    naming the field."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self):
        if finite_number(self.temperature, "temperature") < 0:
            raise SettingError("temperature", f"must be >= 0, got {self.temperature!r}")
        if not (0.0 < finite_number(self.top_p, "top_p") <= 1.0):
            raise SettingError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        object.__setattr__(self, "top_k", whole_number(self.top_k, "top_k", 0))
        if self.seed is not None:
            object.__setattr__(self, "seed", whole_number(self.seed, "seed", 0))
        if not 0.0 <= finite_number(self.min_p, "min_p") <= 1.0:
            raise SettingError("min_p", f"must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= finite_number(getattr(self, name), name) <= 2.0:
                raise SettingError(name, f"must be in [-2, 2], got {getattr(self, name)!r}")
        if not finite_number(self.repetition_penalty, "repetition_penalty") > 0.0:
            raise SettingError("repetition_penalty", f"must be > 0, got {self.repetition_penalty!r}")
        object.__setattr__(self, "logit_bias", check_logit_bias(self.logit_bias))

    @property
    def shapes_logits(self) -> bool:
        """Whether logit_bias or a penalty changes the logits (shaping.LogitShaper)."""
        return bool(self.logit_bias) or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 \
            or self.repetition_penalty != 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def rng(self) -> np.random.Generator:
        return np.random.default_rng(self.seed)


def check_logit_bias(bias) -> tuple[tuple[int, float], ...]:
    """A {token id: bias} mapping (ids as ints or, as JSON sends them, digit strings) or pairs ->
    ((id, bias), ...) sorted by id; SettingError naming "logit_bias" (or "logit_bias[ID]") for
    an id that is not a whole number >= 0 or a bias outside [-100, 100]. The id's bound is the
    export's vocabulary (EagleRuntime checks it)."""
    items = bias.items() if isinstance(bias, dict) else bias
    try:
        items = list(items or ())
    except TypeError:
        raise SettingError("logit_bias", f"must be a mapping of token ids to numbers, got {bias!r}") from None
    out = {}
    for item in items:
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise SettingError("logit_bias", f"must be a mapping of token ids to numbers, got {bias!r}")
        key, value = item
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 12 else key
        if isinstance(token, bool) or not isinstance(token, numbers.Integral) or token < 0:
            raise SettingError("logit_bias", f"keys must be token ids (whole numbers >= 0), got {key!r}")
        if not -100.0 <= finite_number(value, f"logit_bias[{key}]") <= 100.0:
            raise SettingError(f"logit_bias[{key}]", f"must be in [-100, 100], got {value!r}")
        out[int(token)] = float(value)
    return tuple(sorted(out.items()))


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
    if params.min_p > 0.0:  # z's maximum is 0: keep p >= min_p * p_max
        z = np.where(z >= np.log(params.min_p), z, -np.inf)
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
