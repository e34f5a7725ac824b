"""The typed hand-off from the drafter to verification: `DraftTree`.

Glossary. The *root* is the last committed token: the target has chosen it but not yet run
it, so it is node 0 of every tree and the first token of the verification forward. *Depth*
counts edges from the root. Tree settings live in `eagle_deploy.contract.tree_config`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class DraftTree:
    """A draft tree handed from the drafter to verification.

    tokens  [n] int64: node 0 is the root (last committed token), then draft tokens.
    parents [n] int64: parents[0] = -1 and parents[i] < i (parents come first).
    scores  [n] float32: cumulative draft log-probability (root 0); siblings are tried in
            descending score order during verification.
    Derived: depths [n], tree_mask [n, n] bool (row i: i's ancestors and i itself).

    Siblings must carry distinct tokens (ValueError naming the node and token otherwise): a
    second copy of a token can never be accepted (greedy verification follows the first
    match; rejection sampling gives the copy zero probability once the first is rejected), so
    it wastes a verified row, and whatever hangs below it is lost. Duplicates are refused
    rather than merged because merging renumbers nodes under a drafter that keeps per-node
    state (the EAGLE drafter's scratch KV rows); `from_paths` merges shared prefixes for
    drafters that think in token paths.
    """

    tokens: np.ndarray
    parents: np.ndarray
    scores: np.ndarray
    depths: np.ndarray = field(init=False, repr=False)
    tree_mask: np.ndarray = field(init=False, repr=False)

    def __post_init__(self):
        tokens = np.asarray(self.tokens, dtype=np.int64)
        parents = np.asarray(self.parents, dtype=np.int64)
        scores = np.asarray(self.scores, dtype=np.float32)
        n = len(tokens)
        if n < 1 or len(parents) != n or len(scores) != n:
            raise ValueError("DraftTree needs equal-length tokens, parents and scores with a root")
        if parents[0] != -1 or np.any(parents[1:] < 0) or np.any(parents[1:] >= np.arange(1, n)):
            raise ValueError("DraftTree parents must satisfy parents[0] = -1 and 0 <= parents[i] < i: "
                             f"{parents.tolist()}")
        depths = np.zeros(n, dtype=np.int64)
        mask = np.zeros((n, n), dtype=bool)
        mask[0, 0] = True
        first = {}  # (parent, token) -> the first node holding that token under that parent
        for i in range(1, n):
            j = first.setdefault((int(parents[i]), int(tokens[i])), i)
            if j != i:
                raise ValueError(f"DraftTree node {i} repeats token {int(tokens[i])} of its sibling node {j} "
                                 f"(both children of node {int(parents[i])}): siblings must carry distinct tokens")
            depths[i] = depths[parents[i]] + 1
            mask[i] = mask[parents[i]]
            mask[i, i] = True
        for name, value in (("tokens", tokens), ("parents", parents), ("scores", scores), ("depths", depths),
                            ("tree_mask", mask)):
            object.__setattr__(self, name, value)

    @classmethod
    def root_only(cls, root: int) -> "DraftTree":
        """The one-node tree: verifying it is a plain (vanilla) decoding step."""
        return cls(np.array([root]), np.array([-1]), np.zeros(1))

    @classmethod
    def from_paths(cls, root: int, paths: list[list[int]]) -> "DraftTree":
        """Build from token paths below the root (for scripted drafters and tests); earlier
        paths rank before later siblings."""
        tokens, parents, index = [root], [-1], {(): 0}
        for path in paths:
            for d in range(1, len(path) + 1):
                key = tuple(path[:d])
                if key not in index:
                    index[key] = len(tokens)
                    tokens.append(path[d - 1])
                    parents.append(index[key[:-1]])
        scores = -np.arange(len(tokens), dtype=np.float32) * 1e-3  # earlier = preferred sibling
        return cls(np.array(tokens), np.array(parents), scores)

    @property
    def size(self) -> int:
        return len(self.tokens)

    def positions(self, root_position: int) -> np.ndarray:
        """Depth-based absolute positions [n] int64."""
        return root_position + self.depths

    def attention_mask(self, past: int) -> np.ndarray:
        """The verification forward's attention_mask [1, n, past + n] bool: every one of the
        `past` cached rows visible, then the tree mask among the nodes."""
        mask = np.ones((1, self.size, past + self.size), dtype=bool)
        mask[0, :, past:] = self.tree_mask
        return mask

    def kept(self, keep) -> list[int]:
        """The root and the nodes of `keep` (indices) whose ancestors are all kept, in index
        order: the nodes of `subtree(keep)`, by their index in this tree."""
        wanted = set(int(i) for i in keep)
        order, taken = [0], {0}
        for i in range(1, self.size):  # parents come first, so one pass closes over ancestors
            if i in wanted and int(self.parents[i]) in taken:
                order.append(i)
                taken.add(i)
        return order

    def subtree(self, keep) -> "DraftTree":
        """The tree cut to `kept(keep)` (root included), as a new DraftTree; node j of it is
        node kept(keep)[j] of this one, with the same scores (so the same sibling order)."""
        order = self.kept(keep)
        where = {old: new for new, old in enumerate(order)}
        parents = [-1] + [where[int(self.parents[i])] for i in order[1:]]
        return DraftTree(self.tokens[order], np.array(parents), self.scores[order])

    def depth_first(self) -> "DraftTree":
        """The same tree with its nodes in depth-first order, best-scored child first: the top
        path then holds rows 0..d (row index == depth), as a plain causal forward of that path
        would (see decode.Decoder, row_exact)."""
        order, stack = [], [0]
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(int(k) for k in reversed(self.children(node)))
        if order == list(range(self.size)):
            return self
        where = {old: new for new, old in enumerate(order)}
        parents = [-1] + [where[int(self.parents[i])] for i in order[1:]]
        return DraftTree(self.tokens[order], np.array(parents), self.scores[order])

    def children(self, node: int) -> np.ndarray:
        """Child node indices of `node`, best draft score first."""
        if len(self.parents) == 1:  # the root-only tree of vanilla decoding
            return self.parents[:0]
        kids = np.flatnonzero(self.parents == node)
        return kids[np.argsort(-self.scores[kids], kind="stable")]

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root to `node`, inclusive."""
        path = []
        while node >= 0:
            path.append(int(node))
            node = self.parents[node]
        return path[::-1]
