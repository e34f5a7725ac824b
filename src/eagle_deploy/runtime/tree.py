"""The typed hand-off from the drafter to verification: `DraftTree`.

Glossary. The *root* is the last committed token: the target has chosen it but not yet run
it, so it is node 0 of every tree and the first token of the verification forward. *Depth*
counts edges from the root. Tree settings live in `eagle_deploy.contract.tree_config`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from eagle_deploy.contract.tree_config import STATIC_TREES, TreeConfig, TreeConfigError  # noqa: F401  (re-exported)


@dataclass(frozen=True)
class DraftTree:
    """A draft tree handed from the drafter to verification.

    tokens  [n] int64: node 0 is the root (last committed token), then draft tokens.
    parents [n] int64: parents[0] = -1 and parents[i] < i (parents come first).
    scores  [n] float32: cumulative draft log-probability (root 0); siblings are tried in
            descending score order during verification.
    Derived: depths [n], tree_mask [n, n] bool (row i: i's ancestors and i itself).
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
            raise ValueError(f"DraftTree parents must satisfy parents[0] = -1 and 0 <= parents[i] < i: {parents.tolist()}")
        depths = np.zeros(n, dtype=np.int64)
        mask = np.zeros((n, n), dtype=bool)
        mask[0, 0] = True
        for i in range(1, n):
            depths[i] = depths[parents[i]] + 1
            mask[i] = mask[parents[i]]
            mask[i, i] = True
        for name, value in (("tokens", tokens), ("parents", parents), ("scores", scores), ("depths", depths), ("tree_mask", mask)):
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

    def children(self, node: int) -> np.ndarray:
        """Child node indices of `node`, best draft score first."""
        kids = np.flatnonzero(self.parents == node)
        return kids[np.argsort(-self.scores[kids], kind="stable")]

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root to `node`, inclusive."""
        path = []
        while node >= 0:
            path.append(int(node))
            node = self.parents[node]
        return path[::-1]
