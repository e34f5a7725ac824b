"""Verification: which draft tokens the target accepts, and the bonus token.

Glossary (as in vLLM's speculative decoding docs): *accepted* tokens are draft tokens the
target agrees with along one root-to-node path; the *bonus* token is the target's own next
token after the accepted path (sampled from the residual distribution after rejections, a
*recovered* token in vLLM's terms). Each round commits accepted + bonus, so the acceptance
length tau of a round is `len(Verification.tokens)` >= 1.

Lossless rules (SpecInfer, arXiv 2305.09781 §4; EAGLE-2, arXiv 2406.16858 §4): drafts are
deterministic top-k picks, so at each node the children are tried best-first; child x is
accepted with the current residual target probability p(x); on rejection p(x) is set to 0
and p renormalised; if every child is rejected the bonus token is drawn from the residual.
This samples exactly from the target distribution; greedy is the temperature-0 case.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from .sampling import SamplingParams, greedy_token, sample, target_probs
from .tree import DraftTree

Row = Callable[[int], np.ndarray]  # node index -> that node's [V] row of target logits


@dataclass(frozen=True)
class Verification:
    """path: tree node indices from the root (0) to the last accepted node, [k + 1].
    tokens: the k accepted draft tokens followed by the bonus token, [k + 1]."""

    path: list[int]
    tokens: list[int]

    @property
    def accepted(self) -> int:
        return len(self.path) - 1

    @property
    def bonus(self) -> int:
        return self.tokens[-1]


def contiguous(v: Verification) -> Verification:
    """`v` cut at its first accepted node whose tree index is not its depth (a row of the
    verification forward whose attention row skips masked siblings): that node's token stays,
    as the bonus token (it is what the target chose at its parent's row), and nothing after it
    is kept. On a depth-first tree (DraftTree.depth_first) only the top path is contiguous.
    Ending a round after any accepted token keeps greedy and sampled output exact (the next
    round starts from the committed tokens)."""
    cut = next((j for j in range(1, len(v.path)) if v.path[j] != j), None)
    return v if cut is None else Verification(v.path[:cut], v.tokens[:cut])


def _finish(tree: DraftTree, path: list[int], bonus: int) -> Verification:
    return Verification(path, [int(tree.tokens[i]) for i in path[1:]] + [int(bonus)])


def _rows(logits: np.ndarray | None, row: Row | None) -> Row:
    return row if row is not None else (lambda node: logits[node])


def verify_greedy(tree: DraftTree, logits: np.ndarray | None = None, *,
                  argmax: np.ndarray | None = None, row: Row | None = None) -> Verification:
    """logits [n, V] float32 (row i: target logits after node i), or instead argmax [n] int
    (the target's greedy token after each node, e.g. recorded earlier) -> the longest path
    whose tokens equal the target's argmax, plus the argmax after it as the bonus token.
    row(node): node's [V] row instead of logits[node] (a request's shaping or grammar, read
    only along the walked path: the root, then each accepted node, a child of the one before).
    Raises ValueError unless exactly one of logits / argmax is given."""
    if (logits is None) == (argmax is None):
        raise ValueError("verify_greedy takes logits or argmax, not both or neither")
    rows = _rows(logits, row)
    node, path = 0, [0]
    while True:
        best = greedy_token(rows(node)) if argmax is None else int(argmax[node])
        match = next((int(c) for c in tree.children(node) if tree.tokens[c] == best), None)
        if match is None:
            return _finish(tree, path, best)
        node = match
        path.append(node)


def _rejection_step(tree: DraftTree, node: int, p: np.ndarray,
                    rng: np.random.Generator) -> tuple[int | None, np.ndarray]:
    """Try `node`'s children best-first against [V] probabilities p (modified in place into
    the residual). Returns (accepted child or None, residual p)."""
    for child in tree.children(node):
        x = int(tree.tokens[child])
        if rng.random() < p[x]:
            return int(child), p
        p[x] = 0.0
        total = p.sum()
        if total <= 0.0:  # rounding left no mass outside the rejected tokens: nothing to renormalise
            return None, p
        p /= total
    return None, p


def verify_sampling(tree: DraftTree, logits: np.ndarray, params: SamplingParams,
                    rng: np.random.Generator, row: Row | None = None) -> Verification:
    """Recursive rejection sampling over each node's children (lossless; see module doc).
    logits [n, V] float32; row: as for verify_greedy; greedy params reduce to
    `verify_greedy`."""
    if params.greedy:
        return verify_greedy(tree, logits, row=row)
    rows = _rows(logits, row)
    node, path = 0, [0]
    while True:
        target = rows(node)
        child, p = _rejection_step(tree, node, target_probs(target, params), rng)
        if child is None:
            if p.sum() <= 0.0:
                p = target_probs(target, params)
            return _finish(tree, path, sample(p, rng))
        node = child
        path.append(node)


def verify_threshold(tree: DraftTree, logits: np.ndarray, params: SamplingParams, rng: np.random.Generator,
                     threshold: float, row: Row | None = None) -> Verification:
    """NOT LOSSLESS. Accept a child whenever the target's probability of its token is at least
    `threshold` (a posterior-threshold rule, as in Medusa's typical acceptance, TensorRT-LLM's
    threshold mode and the "EAGLEY" proposal); otherwise apply the lossless rule at that node.
    The probability tested is the processed target distribution when sampling, and the plain
    softmax (temperature 1) when decoding greedily. Output no longer follows the target
    distribution exactly."""
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"threshold must be in (0, 1], got {threshold}")
    test_params = params if not params.greedy else SamplingParams(temperature=1.0)
    rows = _rows(logits, row)
    node, path = 0, [0]
    while True:
        target = rows(node)
        q = target_probs(target, test_params)
        hit = next((int(c) for c in tree.children(node) if q[int(tree.tokens[c])] >= threshold), None)
        if hit is None:
            if params.greedy:
                best = greedy_token(target)
                hit = next((int(c) for c in tree.children(node) if tree.tokens[c] == best), None)
                if hit is None:
                    return _finish(tree, path, best)
            else:
                hit, p = _rejection_step(tree, node, target_probs(target, params), rng)
                if hit is None:
                    return _finish(tree, path, sample(p if p.sum() > 0 else target_probs(target, params), rng))
        node = hit
        path.append(node)
