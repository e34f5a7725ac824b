"""Distribution checks for the sampling tests: the reference processed distribution
(transformers' own temperature / top-k / top-p warpers, independent of runtime.sampling),
chi-square with small expected cells merged, total variation, and its sampling noise."""
from __future__ import annotations

import numpy as np
import torch
from scipy.stats import chisquare


def ref_probs(logits, temperature: float, top_p: float = 1.0, top_k: int = 0) -> np.ndarray:
    """[..., V] logits -> processed target probabilities (float64) with transformers'
    TemperatureLogitsWarper, TopKLogitsWarper and TopPLogitsWarper, in generate()'s order.
    temperature 0 or top_k 1: one-hot on the argmax (lowest id on ties)."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    x = torch.as_tensor(np.asarray(logits), dtype=torch.float64)
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    if temperature == 0 or top_k == 1:
        out = torch.zeros_like(x)
        out[torch.arange(len(x)), torch.argmax(x, -1)] = 1.0
        return out.reshape(shape).numpy()
    x = TemperatureLogitsWarper(temperature)(None, x)
    if top_k:
        x = TopKLogitsWarper(top_k)(None, x)
    if top_p < 1.0:
        x = TopPLogitsWarper(top_p)(None, x)
    return torch.softmax(x, -1).reshape(shape).numpy()


def counts_of(samples, n_cells: int) -> np.ndarray:
    return np.bincount(np.asarray(samples, dtype=np.int64), minlength=n_cells).astype(np.float64)


def chi2_pvalue(counts, probs, min_expected: float = 5.0) -> float:
    """Chi-square goodness of fit of `counts` to `probs`. Cells with expected count below
    `min_expected` are pooled (the pool joins the smallest kept cell if it is still too
    small). Any count in a zero-probability cell gives p = 0."""
    counts, probs = np.asarray(counts, np.float64).ravel(), np.asarray(probs, np.float64).ravel()
    n = counts.sum()
    if counts[probs <= 0].sum() > 0:
        return 0.0
    live = probs > 0
    counts, exp = counts[live], probs[live] / probs[live].sum() * n
    small = exp < min_expected
    obs_k, exp_k = list(counts[~small]), list(exp[~small])
    if small.any():
        o, e = counts[small].sum(), exp[small].sum()
        if e >= min_expected or not exp_k:
            obs_k.append(o)
            exp_k.append(e)
        else:
            i = int(np.argmin(exp_k))
            obs_k[i] += o
            exp_k[i] += e
    if len(obs_k) < 2:
        return 1.0
    return float(chisquare(obs_k, exp_k).pvalue)


def total_variation(counts, probs) -> float:
    counts, probs = np.asarray(counts, np.float64).ravel(), np.asarray(probs, np.float64).ravel()
    return 0.5 * float(np.abs(counts / counts.sum() - probs / probs.sum()).sum())


def tv_noise(probs, n: int, q: float = 0.999, trials: int = 400, seed: int = 0) -> float:
    """The q-quantile of the total variation between `probs` and the empirical distribution
    of n exact draws from it (what an exact sampler scores)."""
    probs = np.asarray(probs, np.float64).ravel()
    probs = probs / probs.sum()
    rng = np.random.default_rng(seed)
    draws = rng.multinomial(n, probs, size=trials)
    return float(np.quantile(0.5 * np.abs(draws / n - probs).sum(1), q))
