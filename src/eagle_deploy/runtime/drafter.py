"""Drafters: propose a `DraftTree` each round.

`EagleDrafter` runs the EAGLE draft graph: it first feeds the pairs (target feature at
position p, token at p+1) that were committed since its last call (the *extension*; these
rows of its KV are kept), then grows the tree from its own predicted features in scratch
rows past the committed ones (discarded after the round, since they came from predicted
rather than target features).

Both head kinds run the same loop. An EAGLE-3 head (arXiv 2503.01840) is fed the target's
tapped features in the extension (its graph fuses them with `fc`) and its own `next_features`
in the expansions, through the draft graph's two feature inputs (contract "EAGLE-3 exports");
an EAGLE-1/2 head gets both through `features`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

from eagle_deploy.contract.profiles import draft_kv_capacity
from eagle_deploy.contract.tree_config import TreeConfig

from .backends.base import Backend, DraftOutputs, StepInputs, feature_inputs
from .tree import DraftTree


@dataclass(frozen=True)
class DraftRequest:
    """What a drafter gets each round.

    committed: every committed token id (prompt + generated); committed[-1] is the root.
    features: [k, F] target features (EAGLE-3: tapped features) at positions
      root_position - k .. root_position - 1;
      row i pairs with the shifted token committed[-k + i] (token shift, EAGLE §3).
    root_position: the root's position (= rows in the target KV).
    max_nodes: tree size cap, root included (KV rows left); max_depth: depth cap (tokens left,
      and rows left: a node at depth d is verified at position root_position + d).
    """

    committed: Sequence[int]
    features: np.ndarray
    root_position: int
    max_nodes: int
    max_depth: int


class Drafter(Protocol):
    """Proposes a draft tree each round. `forwards`: draft-graph forwards since the last
    `reset()` (0 for a drafter without a graph); reported as Stats.draft_forwards."""

    forwards: int

    def reset(self) -> None:
        """Forget the previous request (and zero `forwards`)."""
        ...

    def propose(self, request: DraftRequest) -> DraftTree:
        """A tree rooted at request.committed[-1] with at most request.max_nodes nodes."""
        ...


def causal_mask(past: int, seq: int) -> np.ndarray:
    """[1, seq, past + seq] bool: every past row visible, causal among the new tokens."""
    mask = np.ones((1, seq, past + seq), dtype=bool)
    mask[0, :, past:] = np.tril(np.ones((seq, seq), dtype=bool))
    return mask


def expansion_mask(committed: int, past: int, ancestor_rows: Sequence[Sequence[int]]) -> np.ndarray:
    """[1, F, past + F] bool for F frontier nodes fed at rows [past, past + F) of the draft KV:
    node j sees the `committed` rows, the scratch rows of its ancestors (`ancestor_rows[j]`,
    absolute row indices in [committed, past)) and itself."""
    F = len(ancestor_rows)
    mask = np.zeros((1, F, past + F), dtype=bool)
    mask[0, :, :committed] = True
    for j, rows in enumerate(ancestor_rows):
        mask[0, j, list(rows)] = True
        mask[0, j, past + j] = True
    return mask


class _Growth:
    """Tree nodes under construction (creation order keeps parents before children)."""

    def __init__(self, root: int):
        self.tokens, self.parents, self.scores, self.depths = [root], [-1], [0.0], [0]
        self.rank: list[int] = [0]

    def add_children(self, parent: int, ids: np.ndarray, logprobs: np.ndarray, ranks: Sequence[int]) -> list[int]:
        new = []
        for r in ranks:
            new.append(len(self.tokens))
            self.tokens.append(int(ids[r]))
            self.parents.append(parent)
            self.scores.append(self.scores[parent] + float(logprobs[r]))
            self.depths.append(self.depths[parent] + 1)
            self.rank.append(int(r))
        return new

    def scratch_ancestors(self, node: int, rows: dict[int, int]) -> list[int]:
        """The draft-KV scratch rows of `node`'s ancestors below the root (`rows`: node -> row)."""
        out, a = [], self.parents[node]
        while a > 0:
            out.append(rows[a])
            a = self.parents[a]
        return out

    def best(self, nodes: Sequence[int], n: int) -> list[int]:
        """The n best nodes by cumulative score; ties keep creation order."""
        return sorted(nodes, key=lambda i: (-self.scores[i], i))[:n]

    def subtree(self, keep: Sequence[int]) -> DraftTree:
        """Root + `keep` (ancestor-closed) as a DraftTree in creation order."""
        order = [0] + sorted(set(keep) - {0})
        where = {old: new for new, old in enumerate(order)}
        return DraftTree(np.array([self.tokens[i] for i in order]),
                         np.array([-1] + [where[self.parents[i]] for i in order[1:]]),
                         np.array([self.scores[i] for i in order]))


class EagleDrafter:
    """EAGLE-2 dynamic trees (arXiv 2406.16858 §4) and EAGLE-1 static trees (2401.15077 §3.2)
    over a draft-graph backend. Draft forwards per round: 1 extension + (depth - 1) expansions.

    eagle3_widths: (head hidden, tapped width) of an EAGLE-3 draft graph, whose extension is fed
    the target's features as `tapped_features` (None: EAGLE-1/2). `for_export` reads them from
    a manifest."""

    def __init__(self, backend: Backend, tree: TreeConfig, max_length: int, graph_top_k: int,
                 eagle3_widths: tuple[int, int] | None = None):
        self.backend = backend
        self.tree = tree.validate(graph_top_k)
        self.eagle3_widths = eagle3_widths
        self.kv = backend.allocate_kv(draft_kv_capacity(max_length, tree))
        self.length = 0  # committed rows (pairs fed with target features)
        self.forwards = 0
        self._static_children = self._index_choices() if tree.kind == "static" else None

    @classmethod
    def for_export(cls, backend: Backend, tree: TreeConfig, manifest) -> "EagleDrafter":
        """The drafter for an export's draft graph (head kind and sizes from `manifest`)."""
        head = manifest.draft.head
        eagle3 = manifest.draft.head_kind == "eagle3"
        widths = (head.hidden, head.tapped_width(manifest.dims.hidden)) if eagle3 else None
        return cls(backend, tree, manifest.max_length, manifest.draft.graph_top_k, widths)

    def reset(self) -> None:
        self.length = 0
        self.forwards = 0  # per request, as Stats.draft_forwards reports it

    def _index_choices(self) -> dict[tuple, list[int]]:
        kids: dict[tuple, list[int]] = {}
        for path in self.tree.choices:
            kids.setdefault(tuple(path[:-1]), []).append(path[-1])
        return {k: sorted(v) for k, v in kids.items()}

    def _run(self, features, tokens, positions, mask, logits_at, from_target: bool = False) -> DraftOutputs:
        """One draft forward; `from_target`: `features` are the target's (else the head's own)."""
        past = mask.shape[2] - len(tokens)
        features, tapped = feature_inputs(np.ascontiguousarray(features)[None], from_target, self.eagle3_widths)
        inputs = StepInputs(np.asarray(tokens, np.int64)[None], np.asarray(positions, np.int64)[None], mask,
                            np.asarray(logits_at, np.int64)[None], features, tapped)
        self.forwards += 1
        return self.backend.run(inputs, self.kv, past)

    def propose(self, request: DraftRequest) -> DraftTree:
        k = len(request.features)
        start = request.root_position - k
        if start != self.length:
            raise RuntimeError(f"drafter holds {self.length} committed rows but the request starts at {start}")
        tokens = list(request.committed[-k:])
        out = self._run(request.features, tokens, np.arange(start, start + k), causal_mask(start, k), [k - 1],
                        from_target=True)
        self.length += k
        root_feature = out.next_features[0, -1].copy()
        ids, logprobs = out.topk_ids[0, 0].copy(), out.topk_logprobs[0, 0].copy()
        growth = _Growth(int(request.committed[-1]))
        budget = min(self.tree.total_tokens, request.max_nodes) - 1  # nodes below the root the target can verify
        # a tree of `budget` nodes is at most `budget` deep: drafting deeper would spend forwards
        # on nodes that cannot be verified, at positions past the KV capacity
        depth = min(self.tree.depth, request.max_depth, budget)
        if budget <= 0 or depth <= 0:
            return growth.subtree([])
        if self.tree.kind == "static":
            return self._grow_static(growth, root_feature, ids, logprobs, request.root_position, depth, budget)
        return self._grow_dynamic(growth, root_feature, ids, logprobs, request.root_position, depth, budget)

    def _expand(self, growth: _Growth, frontier: list[int], feats: dict, rows: dict, root_position: int, d: int):
        """Feed the frontier nodes (all at depth d) through the draft in scratch rows; returns
        (next_features [F, H], topk ids [F, K], topk logprobs [F, K])."""
        past = self.length + len(rows)
        F = len(frontier)
        mask = expansion_mask(self.length, past, [growth.scratch_ancestors(node, rows) for node in frontier])
        feats_in = np.stack([feats[growth.parents[n]] for n in frontier])
        out = self._run(feats_in, [growth.tokens[n] for n in frontier], np.full(F, root_position + d - 1), mask,
                        np.arange(F))
        for j, node in enumerate(frontier):
            rows[node] = past + j
        return out.next_features[0].copy(), out.topk_ids[0].copy(), out.topk_logprobs[0].copy()

    def _grow_dynamic(self, growth, root_feature, ids, logprobs, root_position, depth, budget) -> DraftTree:
        top_k = self.tree.top_k
        feats, rows = {0: root_feature}, {}
        layer = growth.add_children(0, ids, logprobs, range(top_k))
        for d in range(1, depth):
            frontier = growth.best(layer, top_k)
            nf, tids, tlp = self._expand(growth, frontier, feats, rows, root_position, d)
            layer = []
            for j, node in enumerate(frontier):
                feats[node] = nf[j]
                layer += growth.add_children(node, tids[j], tlp[j], range(top_k))
        return growth.subtree(growth.best(range(1, len(growth.tokens)), budget))

    def _grow_static(self, growth, root_feature, ids, logprobs, root_position, depth, budget) -> DraftTree:
        feats, rows, prefix = {0: root_feature}, {}, {0: ()}
        layer = growth.add_children(0, ids, logprobs, self._static_children.get((), []))
        for node in layer:
            prefix[node] = (growth.rank[node],)
        for d in range(1, depth):
            frontier = [n for n in layer if prefix[n] in self._static_children]
            if not frontier:
                break
            nf, tids, tlp = self._expand(growth, frontier, feats, rows, root_position, d)
            layer = []
            for j, node in enumerate(frontier):
                feats[node] = nf[j]
                for child in growth.add_children(node, tids[j], tlp[j], self._static_children[prefix[node]]):
                    prefix[child] = prefix[node] + (growth.rank[child],)
                    layer.append(child)
        return growth.subtree(range(1, min(len(growth.tokens), budget + 1)))

