"""The product's drafter: the EAGLE head's tree and context-lookup branches in one draft tree,
each round sized by the cost-aware planner (`planner.DraftPlanner`), down to a vanilla step.

kinds: "hybrid" (head + lookup), "eagle" (head only), "lookup" (lookup only, no draft graph).
planned=False drafts the configured tree (and the longest lookup chain) every round.

Merging (one tree, verified in one target forward): the lookup chain is walked from the root
down the head's tree; where its next token is already a child it shares that node, otherwise
it continues as a new branch. Then up to `alternates` other continuations the context offers
(other earlier occurrences followed by another token, `ContextLookup.propose_all`), each cut
to `alternate_len` tokens, are merged the same way while the request's node budget lasts
(they raise lookup-alone τ most on summarization and rag: docs/decisions.md, 'alternative
lookup continuations and 16-token chains').
Siblings stay distinct (DraftTree's rule). Lookup nodes are scored with the log of their
estimated acceptance (an alternate's lowered by log(1 + its rank)), head nodes with their
cumulative draft log-probability; siblings are tried best-first, and a row-exact depth-first
layout puts the best-scored branch on top. Acceptance along an alternate is recorded as the
lookup's (the planner keeps one set of lookup rates per match length).

Losslessness: every proposal is a deterministic function of the committed context, so each
sibling is a draft-probability-1 candidate in verify.verify_sampling's recursive rejection
(SpecInfer, arXiv 2305.09781 §4): rejection sets the target's probability of a rejected sibling
to zero and renormalises, whatever drafter proposed it. Greedy output is the target's own.

When a round skips the head, the target features committed in it are kept and fed to the head
with the next round that runs it (its extension), so the head's KV never misses a position.
"""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from eagle_deploy.contract.tree_config import DEFAULT_DRAFTER, DRAFTER_KINDS, TreeConfig  # noqa: F401  (re-exported)

from .costs import CostModel
from .drafter import DraftRequest
from .lookup import ContextLookup
from .planner import DraftPlanner, Plan
from .tree import DraftTree

MAX_LOOKUP = 16  # longest context-lookup chain per round
ALTERNATES = 2  # other lookup continuations drafted beside the main chain
ALTERNATE_LEN = 4  # longest alternate continuation
LOOKUP_ROWS = (MAX_LOOKUP, ALTERNATES * ALTERNATE_LEN)  # rows a round may add to the head's tree (costs.device_costs)


def uses_draft_graph(kind: str) -> bool:
    """Whether drafter `kind` runs the export's draft graph ("lookup" never opens it)."""
    return kind != "lookup"


def check_drafter_kind(kind: str) -> str:
    """`kind`, or ValueError naming the choices."""
    if kind not in DRAFTER_KINDS:
        raise ValueError(f"drafter must be one of {', '.join(DRAFTER_KINDS)}; got {kind!r}")
    return kind


class HybridDrafter:
    """A `Drafter` over an optional EAGLE head drafter (`head`: an EagleDrafter, or a wrapper of
    one exposing `.tree`, `.propose`, `.reset`, `.forwards`) and an optional context lookup.

    tree: the head's configured tree (the largest plan); planned: choose each round's plan
    (DraftPlanner; needs `costs`, the device's CostModel) or always draft everything; one_path:
    the decoder is row-exact (DraftPlanner's one_path); step_rows: the rows a vanilla step runs
    (DraftPlanner's; None: 2 with one_path); max_lookup: the longest lookup chain;
    alternates / alternate_len: how many other lookup continuations (the lookup keeps that
    many more per n-gram: build it with `candidates >= 1 + alternates`) and how long each;
    a planned drafter drafts them only in rounds where the planner expects them to pay.
    Raises ValueError with neither source, or planned without costs."""

    def __init__(self, head, lookup: ContextLookup | None, tree: TreeConfig | None, planned: bool = True,
                 costs: CostModel | None = None, max_lookup: int = MAX_LOOKUP, one_path: bool = False,
                 alternates: int = 0, alternate_len: int = ALTERNATE_LEN, step_rows: int | None = None):
        if head is None and lookup is None:
            raise ValueError("HybridDrafter needs a head, a lookup, or both")
        if planned and costs is None:
            raise ValueError("a planned HybridDrafter needs the device's CostModel (costs.measure_costs)")
        self.head, self.lookup, self.planned = head, lookup, planned
        self.alternates = alternates if lookup is not None else 0
        depth, total, top_k = (0, 1, 1) if head is None else (tree.depth, tree.total_tokens, tree.top_k)
        self.planner = DraftPlanner(depth, total, top_k, max_lookup if lookup is not None else 0, costs,
                                    one_path=one_path, ngrams=lookup.max_ngram if lookup is not None else 1,
                                    alternate_len=alternate_len, step_rows=step_rows)
        self.static = head is not None and tree.kind == "static"
        self.reset()

    @property
    def forwards(self) -> int:
        return self.head.forwards if self.head is not None else 0

    @property
    def backend(self):
        """The head's draft-graph backend (None for a lookup-only drafter)."""
        return None if self.head is None else self.head.backend

    def reset(self) -> None:
        if self.head is not None:
            self.head.reset()
        if self.lookup is not None:
            self.lookup.reset()
        self.planner.reset()
        self._pending: list[np.ndarray] = []  # target features of rounds that skipped the head
        self._last: tuple[Plan, DraftTree, np.ndarray, int, int] | None = None  # plan, tree, origin, committed, ngram
        self.plans: list[Plan] = []  # this request's plans, one per round

    # ---------------------------------------------------------------- feedback from the last round

    def _learn(self, request: DraftRequest) -> None:
        """Update the planner from the previous round: how deep the committed tokens ran
        through the head's and the lookup chain's nodes of the tree it proposed, and how far
        the best alternative continuation matched them (drafted or not: see planner)."""
        if self._last is None:
            return
        plan, tree, origin, before, ngram, others = self._last
        self._last = None
        new = [int(t) for t in request.committed[before:]]
        node, head_depth, look_depth, on_head, on_look = 0, 0, 0, True, True
        for token in new[:-1]:  # the last committed token is the bonus
            kids = [int(c) for c in np.flatnonzero(tree.parents == node) if tree.tokens[c] == token]
            if not kids:
                break
            node = kids[0]
            on_head, on_look = on_head and bool(origin[node] & 1), on_look and bool(origin[node] & 2)
            head_depth += on_head
            look_depth += on_look
        alternate = None
        if others:  # (depths known, depth matched) of the best alternative: see DraftPlanner.record
            matched = max(_common_prefix(chain, new) for chain in others)
            longest = max(len(chain) for chain in others)
            alternate = (min(longest, len(new), matched + 1), matched)
        self.planner.record(plan, head_depth, look_depth, ngram, alternate=alternate)

    # ---------------------------------------------------------------- proposing

    def propose(self, request: DraftRequest) -> DraftTree:
        self._learn(request)
        root = int(request.committed[-1])
        matches = []
        if self.lookup is not None:
            matches = self.lookup.propose_all(request.committed, min(self.planner.max_lookup, request.max_depth),
                                              1 + self.alternates)
        match = matches[0] if matches else None
        available = len(match.tokens) if match else 0
        ngram = match.ngram if match else 1
        others = [m.tokens[:self.planner.alternate_len] for m in matches[1:]]
        if self.static:  # a static EAGLE-1 tree is drafted whole or not at all
            plan = self.planner.full(available)
        else:
            plan = (self.planner.choose(available, ngram, request.root_position, len(others)) if self.planned
                    else self.planner.full(available, len(others)))
        lookup_len = min(plan.lookup, available, request.max_depth, request.max_nodes - 1)
        tree, origin = DraftTree.root_only(root), np.ones(1, np.int64) * 3
        if plan.head_depth > 0 and self.head is not None:
            head_room = request.max_nodes - lookup_len
            tree = self._run_head(request, plan, head_room)
            origin = np.ones(tree.size, np.int64)
        elif self.head is not None:
            self._pending.append(request.features)
        alternates = 0
        if lookup_len > 0:
            tree, origin = merge_chain(tree, origin, match.tokens[:lookup_len], self._lookup_scores(lookup_len, ngram))
            for rank, other in enumerate(matches[1:1 + plan.alternates], 1):
                chain = other.tokens[:min(lookup_len, self.planner.alternate_len, request.max_nodes - tree.size)]
                if not chain:
                    break
                scores = self._lookup_scores(len(chain), other.ngram) - np.float32(math.log(1 + rank))
                tree, origin = merge_chain(tree, origin, chain, scores, flag=4)
                alternates = rank
        plan = replace(plan, lookup=lookup_len, alternates=alternates)
        self.plans.append(plan)
        self._last = (plan, tree, origin, len(request.committed), ngram, others)
        return tree

    def _run_head(self, request: DraftRequest, plan: Plan, max_nodes: int) -> DraftTree:
        features = request.features
        if self._pending:
            features = np.concatenate(self._pending + [features], axis=0)
            self._pending = []
        capped = DraftRequest(request.committed, features, request.root_position,
                              max(1, min(max_nodes, 1 + plan.head_nodes)), min(request.max_depth, plan.head_depth))
        return self.head.propose(capped)

    def _lookup_scores(self, length: int, ngram: int) -> np.ndarray:
        reach = self.planner.lookup_rates(ngram).reach(length)[1:]
        return np.log(np.maximum(reach, 1e-6)).astype(np.float32)


def merge_chain(tree: DraftTree, origin: np.ndarray, chain: list[int], scores: np.ndarray, flag: int = 2
                ) -> tuple[DraftTree, np.ndarray]:
    """`tree` with the token path `chain` below its root: shared where a node with the next
    token already hangs below the current one, new nodes after that. origin [n] int64 bit
    flags (1: head, 2: lookup chain, 4: alternative lookup continuation; `flag` marks this
    chain's nodes) follow the nodes; scores [len(chain)]: the chain's cumulative log-scores
    (a shared node keeps the higher of its two)."""
    tokens, parents = list(tree.tokens), list(tree.parents)
    node_scores, origin = list(tree.scores), list(origin)
    node = 0
    for depth, token in enumerate(chain):
        kids = [i for i in range(len(tokens)) if parents[i] == node and tokens[i] == token]
        if kids:
            node = kids[0]
            origin[node] |= flag
            node_scores[node] = max(node_scores[node], float(scores[depth]))
            continue
        tokens.append(int(token))
        parents.append(node)
        node_scores.append(float(scores[depth]) if math.isfinite(scores[depth]) else -1e6)
        origin.append(flag)
        node = len(tokens) - 1
    return DraftTree(np.array(tokens), np.array(parents), np.array(node_scores)), np.array(origin, np.int64)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def make_drafter(kind: str, head, tree: TreeConfig, planned: bool = True, costs: CostModel | None = None,
                 one_path: bool = False, step_rows: int | None = None):
    """The drafter of `kind` ("hybrid", "eagle", "lookup") over `head` (an EagleDrafter or a
    wrapper of one; None for "lookup"). "eagle" with planned=False is `head` itself (the
    configured tree every round). Raises ValueError on an unknown kind, or a head-based kind
    without a head. one_path: the decoder is row-exact (HybridDrafter; no alternative lookup
    continuations then, as they cannot be accepted past their first token); step_rows: the
    rows its vanilla step runs (decode.Decoder.step_rows; None: 2 with one_path, else 1)."""
    check_drafter_kind(kind)
    if kind == "eagle" and not planned:
        return head
    if kind == "lookup":
        head = None
    elif head is None:
        raise ValueError(f"the {kind!r} drafter needs the draft graph")
    alternates = 0 if one_path else ALTERNATES  # row-exact rounds end at an accepted node off the top path
    lookup = ContextLookup(candidates=1 + alternates) if kind != "eagle" else None
    return HybridDrafter(head, lookup, tree, planned, costs, one_path=one_path, alternates=alternates,
                         step_rows=step_rows)


def head_of(drafter):
    """The EAGLE head drafter inside `drafter` (a HybridDrafter's head, or `drafter`)."""
    return drafter.head if isinstance(drafter, HybridDrafter) else drafter
