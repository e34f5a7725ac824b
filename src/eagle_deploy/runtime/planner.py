"""Cost-aware drafting: each round, the draft that maximises expected committed tokens per
second, down to no draft at all (a vanilla step).

Expected tokens of a plan (head depth D, lookup length L), with P_h(d) / P_l(d) the request's
running probability that the head's tree / the lookup chain is accepted to depth d or deeper
(products of per-depth conditional acceptance rates, decayed so the estimate follows the
request), counting the two sources as independent:

    E[tau](D, L) = 1 + sum_{d=1}^{max(D, L)} 1 - (1 - P_h(d) [d <= D]) (1 - P_l(d) [d <= L])

(with row-exact decoding, which accepts along one path only, max(P_h(d), P_l(d)) instead).

The lookup's alternative continuations (other earlier occurrences followed by another token:
`alternates` chains of at most `alternate_len` tokens beside the main chain, a plan has all or
none of them) are a third source, with P_a(d) the running probability that one of them runs
to depth d. It is learnt every round a match had alternatives, drafted or not (a lookup is
deterministic, so what an undrafted chain would have matched is known from the committed
tokens; a chain that matched everything committed counts as accepted that deep). Their first
tokens differ from the main chain's, so the two are exclusive: the lookup term becomes
min(1, P_l(d) + P_a(d)) for d <= min(L, alternate_len). Row-exact decoding ends a round at
the first accepted node off the top path, so alternates never pay there and are not planned.

Cost of a plan: D draft forwards (one extension + D - 1 expansions) at the measured seconds
per draft forward, plus the measured seconds of a round that verifies the plan's tree size
(alternates' rows included) (`CostModel`: measured once per runtime, interpolated between
sizes). The plan
maximising E[tau] / cost wins; with no head and no lookup it is a vanilla step (E = 1).
A source that is not used for a while is re-probed (its full size, once every `probe_every`
rounds, the interval doubling up to `probe_max` while probes lose), so a request that becomes
predictable gets its trees back. The choice only changes what is proposed: verification, and so
the output, is unchanged (lossless).

Same idea as EAGLE-2's confidence-based tree (arXiv 2406.16858 §4) and the cost models of
SpecDec++ / "Dynamic depth" decoding, with costs measured on this device rather than assumed.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from eagle_deploy.contract.tree_config import growth_nodes

from .costs import CostModel


@dataclass(frozen=True)
class Plan:
    """One round's draft: head_depth / head_nodes (0: no head forward this round), lookup
    (context-lookup tokens), alternates (other lookup continuations beside the chain),
    expected (E[tau]), seconds (predicted round cost; 0.0 unknown)."""

    head_depth: int
    head_nodes: int
    lookup: int
    expected: float = 1.0
    seconds: float = 0.0
    probe: bool = False  # a re-probe of a source the plan had left out
    alternates: int = 0  # alternative lookup continuations drafted beside the chain

    @property
    def drafts(self) -> bool:
        return self.head_depth > 0 or self.lookup > 0


class _DepthRates:
    """Per-depth conditional acceptance counts: hit[d] / tried[d] estimates P(depth d accepted
    | depth d - 1 reached and proposed). Each depth's prior, worth `weight` rounds, is the
    estimate one depth up (`prior` at depth 1): a depth never tried is expected to do as well
    as the one above it. `fade()` (once a round) decays every count, so evidence left
    unrenewed while a source is unused fades back towards the prior."""

    def __init__(self, depth: int, prior: float, weight: float, decay: float):
        self.prior, self.weight, self.decay = prior, weight, decay
        self.tried = np.zeros(depth + 1)
        self.hit = np.zeros(depth + 1)

    def fade(self) -> None:
        self.tried *= self.decay
        self.hit *= self.decay

    def update(self, proposed: int, accepted: int) -> None:
        for d in range(1, min(proposed, len(self.tried) - 1) + 1):
            if accepted >= d - 1:
                self.tried[d] += 1
                self.hit[d] += accepted >= d

    def reach(self, depth: int) -> np.ndarray:
        """[depth + 1] P(accepted to depth >= d), d = 0..depth (entry 0 is 1)."""
        out = np.zeros(depth + 1)
        out[0], prior = 1.0, self.prior
        for d in range(1, min(depth, len(self.tried) - 1) + 1):
            prior = (self.hit[d] + self.weight * prior) / (self.tried[d] + self.weight)
            out[d] = out[d - 1] * prior
        return out


def _by_plan(reach: np.ndarray, plans: int, width: int) -> np.ndarray:
    """[plans, width]: row p is `reach` (P(accepted to depth >= d), d = 0..) cut after depth p,
    0 deeper: what a plan drafting p tokens of that source can be accepted to."""
    out = np.zeros((plans, width))
    for d, r in enumerate(reach):
        out[d:, d] = r
    return out


class DraftPlanner:
    """Chooses each round's `Plan` (module doc).

    max_depth / total_tokens / top_k: the configured head tree (its largest plan; 0 depth: no
    head); max_lookup: longest lookup chain. costs: the device's CostModel. one_path: the
    decoder accepts only along one path past depth 1 (row-exact decoding, decode.Decoder), so
    two sources do not add up: E counts the likelier of the two at each depth; and it runs a
    one-token forward as two rows, so a vanilla step costs what verifying one draft token does
    (a single draft token is then free). step_rows: the rows a vanilla step costs (None: 2
    with one_path, else 1; 1 for a graph that repeats one-row queries itself, whose measured
    one-token cost already holds its attention's second row: decode.Decoder.step_rows). ngrams: the
    longest suffix the lookup matches (its acceptance is tracked per match length).
    alternate_len: the longest alternative lookup continuation drafted beside the main chain
    (`choose(alternates=...)` weighs their rows against their learnt acceptance, prior
    `alternate_prior` per depth). Per-request acceptance state is reset by `reset()`."""

    def __init__(self, max_depth: int, total_tokens: int, top_k: int, max_lookup: int, costs: CostModel | None,
                 prior: float = 0.6, weight: float = 2.0, decay: float = 0.95, probe_every: int = 4,
                 probe_max: int = 64, one_path: bool = False, ngrams: int = 3, alternate_len: int = 0,
                 alternate_prior: float = 0.2, step_rows: int | None = None):
        self.max_depth, self.total_tokens, self.top_k, self.max_lookup = max_depth, total_tokens, top_k, max_lookup
        self.one_path, self.ngrams, self.alternate_len = one_path, ngrams, alternate_len
        self.step_rows = (2 if one_path else 1) if step_rows is None else step_rows
        self.costs = costs
        self.prior, self.weight, self.decay, self.alternate_prior = prior, weight, decay, alternate_prior
        self.probe_every, self.probe_max = probe_every, probe_max
        self.reset()

    def reset(self) -> None:
        self.head = _DepthRates(self.max_depth, self.prior, self.weight, self.decay)
        self.lookup = {n: _DepthRates(self.max_lookup, self.prior, self.weight, self.decay)
                       for n in range(1, self.ngrams + 1)}
        self.alternate = _DepthRates(self.alternate_len, self.alternate_prior, self.weight, self.decay)
        self._idle = {"head": 0, "lookup": 0}  # rounds since each source was last proposed
        self._interval = {"head": self.probe_every, "lookup": self.probe_every}

    def head_nodes(self, depth: int) -> int:
        return min(self.total_tokens - 1, growth_nodes(self.top_k, depth))

    def full(self, lookup: int, alternates: int = 0) -> Plan:
        """Everything: the configured head tree, `lookup` chain tokens and `alternates`."""
        return Plan(self.max_depth, self.head_nodes(self.max_depth), lookup, alternates=alternates if lookup else 0)

    def alternate_rows(self, lookup: int, alternates: int) -> int:
        """Rows the lookup's `alternates` alternative continuations add beside a main chain of
        `lookup` tokens (none without one)."""
        return alternates * min(lookup, self.alternate_len) if lookup > 0 else 0

    def choose(self, lookup_available: int, ngram: int = 1, past: int = 0, alternates: int = 0) -> Plan:
        """The plan for this round, given a lookup match of `lookup_available` tokens (0: none)
        found with an `ngram`-token suffix and `alternates` other continuations, with `past`
        rows already in the target's KV."""
        lookup_available = min(lookup_available, self.max_lookup)
        for rates in (self.head, self.alternate, *self.lookup.values()):
            rates.fade()
        draft_s = self.costs.draft(past) if self.max_depth else 0.0
        D, L = self.max_depth, lookup_available
        width = max(D, L) + 1
        h = _by_plan(self.head.reach(D), D + 1, width)[:, None, 1:]  # [D + 1, 1, depths]
        look = _by_plan(self.lookup_rates(ngram).reach(L), L + 1, width)
        head_nodes = np.array([self.head_nodes(d) for d in range(D + 1)])
        options = [0] + ([alternates] if alternates and L and self.alternate_len and not self.one_path else [])
        best = None
        for a in options:
            lookup = look
            if a:  # row k: the chain's reach plus the alternates' (exclusive first tokens) up to min(k, alternate_len)
                alt = _by_plan(self.alternate.reach(min(L, self.alternate_len)), L + 1, width)
                lookup = np.minimum(1.0, look + alt)
            lk = lookup[None, :, 1:]  # [1, L + 1, depths]
            if self.one_path:  # row-exact decoding accepts past depth 1 only along the top path
                expected = 1.0 + np.maximum(h, lk).sum(-1)
            else:
                expected = 1.0 + (1.0 - (1.0 - h) * (1.0 - lk)).sum(-1)
            lookup_rows = np.array([k + self.alternate_rows(k, a) for k in range(L + 1)])
            rows = 1 + head_nodes[:, None] + lookup_rows[None, :]
            rows = np.maximum(rows, self.step_rows)  # row-exact: a one-token forward may run as two rows
            seconds = (np.arange(D + 1) * draft_s)[:, None] + self.costs.verify(rows, past)
            d, k = np.unravel_index(int(np.argmax(expected / seconds)), expected.shape)  # the first best: smallest
            plan = Plan(int(d), int(head_nodes[d]), int(k), float(expected[d, k]), float(seconds[d, k]),
                        alternates=a if k else 0)
            if best is None or plan.expected / plan.seconds > best.expected / best.seconds:
                best = plan
        return self._probed(best, lookup_available)

    def lookup_rates(self, ngram: int) -> _DepthRates:
        """The lookup's acceptance estimates for matches of an `ngram`-token suffix (a longer
        match is usually a surer continuation, so each length keeps its own)."""
        return self.lookup[min(max(ngram, 1), self.ngrams)]

    def _probed(self, plan: Plan, lookup_available: int) -> Plan:
        """Re-probe a source left unused for its interval (doubling while probes lose)."""
        for source, used in (("head", plan.head_depth > 0 or not self.max_depth),
                             ("lookup", plan.lookup > 0 or not lookup_available)):
            if used:
                self._idle[source], self._interval[source] = 0, self.probe_every
                continue
            self._idle[source] += 1
            if self._idle[source] >= self._interval[source]:
                self._idle[source] = 0
                self._interval[source] = min(2 * self._interval[source], self.probe_max)
                if source == "head":
                    plan = replace(plan, head_depth=self.max_depth, head_nodes=self.head_nodes(self.max_depth),
                                   probe=True)
                else:
                    plan = Plan(plan.head_depth, plan.head_nodes, lookup_available, probe=True)
        return plan

    def record(self, plan: Plan, head_accepted: int, lookup_accepted: int, ngram: int,
               alternate: tuple[int, int] | None = None) -> None:
        """Update the request's acceptance estimates after a round drafted `plan`: how deep the
        accepted path ran through the head's nodes and through the lookup chain's; alternate:
        (tokens known, depth matched) of the round's best alternative continuation, drafted or
        not (None: the match had no alternatives)."""
        if plan.head_depth:
            self.head.update(plan.head_depth, head_accepted)
        if plan.lookup:
            self.lookup_rates(ngram).update(plan.lookup, lookup_accepted)
        if alternate is not None:
            self.alternate.update(*alternate)
        if plan.probe:  # a probe that was accepted at all: probe again soon
            for source, accepted in (("head", head_accepted), ("lookup", lookup_accepted)):
                if accepted:
                    self._interval[source] = self.probe_every
