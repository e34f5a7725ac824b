"""Draft trees: the settings that shape them (`TreeConfig`) and the typed hand-off from the
drafter to verification (`DraftTree`).

Glossary. The *root* is the last committed token: the target has chosen it but not yet run
it, so it is node 0 of every tree and the first token of the verification forward. *Depth*
counts edges from the root. `total_tokens` is the number of tree tokens the target verifies
in one forward, root included (as in the EAGLE-2 reference, arXiv 2406.16858 §4), so a tree
holds `total_tokens - 1` draft tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# A static EAGLE-1-style tree (arXiv 2401.15077 §3.2): 25 draft nodes, depth 5, 4/8/8/3/2
# nodes per depth; each path lists child ranks in the head's top-k, root excluded.
STATIC_TREES: dict[str, list[tuple[int, ...]]] = {
    "eagle1": [
        (0,), (1,), (2,), (3,),
        (0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (2, 0), (3, 0),
        (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 0), (0, 2, 0), (1, 0, 0), (1, 1, 0), (2, 0, 0),
        (0, 0, 0, 0), (0, 0, 0, 1), (0, 1, 0, 0),
        (0, 0, 0, 0, 0), (0, 0, 0, 1, 0),
    ],
}


class TreeConfigError(ValueError):
    """Tree settings that cannot work with this export."""


@dataclass(frozen=True)
class TreeConfig:
    """How the drafter grows a tree.

    kind: "dynamic" (EAGLE-2: per depth keep the `top_k` nodes of highest cumulative draft
    log-probability, expand each by `top_k` children, finally keep the best
    `total_tokens - 1` nodes) or "static" (EAGLE-1: the fixed `choices`).
    depth: draft steps per round (the deepest node's depth). top_k: children per expanded
    node. total_tokens: verification tokens per round, root included.
    """

    kind: str = "dynamic"
    total_tokens: int = 16
    depth: int = 4
    top_k: int = 4
    choices: tuple[tuple[int, ...], ...] | None = None

    @classmethod
    def static(cls, name_or_choices) -> "TreeConfig":
        choices = STATIC_TREES[name_or_choices] if isinstance(name_or_choices, str) else name_or_choices
        choices = tuple(tuple(int(r) for r in c) for c in choices)
        return cls("static", total_tokens=len(choices) + 1, depth=max(len(c) for c in choices),
                   top_k=1 + max(max(c) for c in choices), choices=choices)

    @classmethod
    def from_json(cls, data: dict) -> "TreeConfig":
        data = dict(data)
        if data.get("choices") is not None:
            data["choices"] = tuple(tuple(c) for c in data["choices"])
        return cls(**data)

    def to_json(self) -> dict:
        return {"kind": self.kind, "total_tokens": self.total_tokens, "depth": self.depth, "top_k": self.top_k,
                "choices": [list(c) for c in self.choices] if self.choices else None}

    def validate(self, graph_top_k: int) -> "TreeConfig":
        """Return self, or raise TreeConfigError naming the bad setting."""
        if self.kind not in ("dynamic", "static"):
            raise TreeConfigError(f"tree kind {self.kind!r} is not 'dynamic' or 'static'")
        for name in ("total_tokens", "depth", "top_k"):
            if getattr(self, name) < 1:
                raise TreeConfigError(f"tree {name} must be >= 1, got {getattr(self, name)}")
        if self.top_k > graph_top_k:
            raise TreeConfigError(f"tree top_k {self.top_k} exceeds the draft graph's top-k {graph_top_k} (re-export with --graph-top-k)")
        if self.kind == "static":
            if not self.choices:
                raise TreeConfigError("a static tree needs choices")
            known = {()}
            for c in sorted(self.choices, key=len):
                if c[:-1] not in known:
                    raise TreeConfigError(f"static tree path {list(c)} has no parent path {list(c[:-1])}")
                known.add(c)
        return self

    def max_draft_inputs(self) -> int:
        """Upper bound on tree nodes fed through the draft per round (sizes its KV scratch)."""
        if self.kind == "static":
            return len({c[:-1] for c in self.choices if len(c) > 1})
        return self.top_k * max(self.depth - 1, 0)


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
