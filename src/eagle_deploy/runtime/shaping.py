"""What a request changes in the target's logits before they are sampled, node by node of a
draft tree, and the log-probabilities it may ask for.

`LogitShaper` applies `logit_bias` and the repetition, frequency and presence penalties (the
OpenAI / vLLM request fields) to a row of target logits. Penalties depend on the tokens
generated so far, so inside a draft tree the row of node i is shaped with the committed
tokens *plus the draft tokens on i's own path* (`rows`): the row then is exactly the row
vanilla decoding would shape after committing that path, so verification over the shaped rows
keeps greedy EAGLE equal to greedy vanilla decoding and sampled EAGLE exact in distribution
(the rejection rule of verify.py only needs each node's own target distribution). Order, as
vLLM's sampler: logit_bias, then repetition_penalty (prompt and generated tokens: a positive
logit is divided by it, a negative one multiplied), then frequency_penalty * count and
presence_penalty (generated tokens), then temperature, min_p, top-k and top-p
(sampling.target_probs).

`TokenLogprob` is one committed token's log-probability under the target's own distribution
(the log-softmax of the unshaped logits, as vLLM's default `raw_logprobs` and OpenAI return
them) with the `top` most likely alternatives.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from .sampling import SamplingParams
from .tree import DraftTree


class LogitShaper:
    """The shaping of one request (module doc). `row(logits, path)`: one [V] row after the
    committed tokens and the draft tokens `path`; `rows(logits, tree)`: every node's row of a
    verification forward; `push(tokens)`: tokens committed."""

    def __init__(self, params: SamplingParams, prompt: Sequence[int]):
        self.params = params
        self.counts: Counter[int] = Counter()  # generated tokens committed so far
        self.prompt = set(int(t) for t in prompt)
        ids = [t for t, _ in params.logit_bias]
        self._bias_ids = np.asarray(ids, np.int64)
        self._bias = np.asarray([b for _, b in params.logit_bias], np.float64)

    @classmethod
    def of(cls, params: SamplingParams, prompt: Sequence[int]) -> "LogitShaper | None":
        """A shaper, or None when `params` changes no logit (then rows are used as they are)."""
        return cls(params, prompt) if params.shapes_logits else None

    def push(self, tokens: Sequence[int]) -> None:
        self.counts.update(int(t) for t in tokens)

    def row(self, logits: np.ndarray, path: Sequence[int] = ()) -> np.ndarray:
        """[V] logits -> [V] float64 shaped logits after the committed tokens and `path`."""
        p = self.params
        z = logits.astype(np.float64)
        if len(self._bias_ids):
            z[self._bias_ids] += self._bias
        counts = self.counts + Counter(int(t) for t in path) if path else self.counts
        if p.repetition_penalty != 1.0:
            seen = np.fromiter(self.prompt | set(counts), np.int64)
            if len(seen):
                v = z[seen]
                z[seen] = np.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        if counts and (p.frequency_penalty or p.presence_penalty):
            ids = np.fromiter(counts.keys(), np.int64, len(counts))
            n = np.fromiter(counts.values(), np.float64, len(counts))
            z[ids] -= p.frequency_penalty * n + p.presence_penalty
        return z

    def rows(self, logits: np.ndarray, tree: DraftTree) -> Callable[[int], np.ndarray]:
        """The rows of a verification forward over `tree` ([n, V] logits), shaped on demand:
        node i -> [V] float64, shaped with the draft tokens on node i's path (root excluded,
        node i included). Verification asks only for the nodes on the path it walks."""
        return lambda i: self.row(logits[i], path_tokens(tree, i))


def path_tokens(tree: DraftTree, node: int) -> list[int]:
    """The draft tokens from the root (excluded) down to `node` (included), in order."""
    path = []
    while node > 0:
        path.append(int(tree.tokens[node]))
        node = int(tree.parents[node])
    return path[::-1]


@dataclass(frozen=True)
class TokenLogprob:
    """token: the committed token id; logprob: its natural-log probability under the
    target's distribution at that position (float, <= 0); top: the `k` most likely tokens
    there as (id, logprob), most likely first (ties: lowest id)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprob(logits: np.ndarray, token: int, k: int) -> TokenLogprob:
    """The TokenLogprob of `token` from its [V] row of target logits, with the top `k` (0-20)."""
    z = logits.astype(np.float64)
    z -= z.max()
    logp = z - np.log(np.exp(z).sum())
    top = ()
    if k:
        best = np.argpartition(-logp, k - 1)[:k] if k < len(logp) else np.arange(len(logp))
        best = best[np.lexsort((best, -logp[best]))]
        top = tuple((int(t), float(logp[t])) for t in best)
    return TokenLogprob(int(token), float(logp[token]), top)
