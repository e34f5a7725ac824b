"""Acceptance statistics, defined once (used by `decode.Stats`, eagle-bench, its tuner and
eagle-eval).

`SpecCounts` maps a request's rounds onto vLLM's speculative-decoding counters (eagle-serve's
`/metrics` and `usage.speculative`, Triton's `stats` output: `Stats.to_json()["speculative"]`).

tau (acceptance length): tokens committed per verification forward, the bonus token
included, so tau >= 1 (vanilla decoding: exactly 1). Over several requests the rounds are
pooled: total tokens / total rounds.
Per-depth acceptance rate at depth d: P(the draft token at depth d is accepted | the path
reached depth d - 1 and the tree had a node at depth d); it shows where a head loses.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol, Sequence


class Rounds(Protocol):
    """A request's per-round record, as `decode.Stats` keeps it (this module never imports
    `decode`, which imports it)."""

    accepted_per_round: Sequence[int]  # tokens committed per verification round
    tree_depth_per_round: Sequence[int]  # deepest draft node per round


def tau(tokens_per_round: Iterable[int]) -> float | None:
    """Mean tokens committed per verification round (accepted + bonus); None with no rounds."""
    tokens = list(tokens_per_round)
    return sum(tokens) / len(tokens) if tokens else None


def depth_rates(accepted: Sequence[int], depths: Sequence[int], max_depth: int) -> list[float | None]:
    """Per-depth acceptance rates [max_depth] (None where no round tried that depth), rounded
    to 4 places. accepted: draft tokens accepted per round; depths: the tree's depth per round."""
    rates = []
    for d in range(1, max_depth + 1):
        tried = [a for a, t in zip(accepted, depths) if t >= d and a >= d - 1]
        rates.append(round(sum(a >= d for a in tried) / len(tried), 4) if tried else None)
    return rates


def pooled_tau(many: Iterable[Rounds]) -> float | None:
    """tau over every round of several requests (their `Stats`); None with no rounds."""
    return tau(n for s in many for n in s.accepted_per_round)


def pooled_depth_rates(many: Iterable[Rounds], max_depth: int) -> list[float | None]:
    """Per-depth acceptance rates over every round of several requests (their `Stats`): a
    round that committed n tokens accepted n - 1 draft tokens."""
    many = list(many)
    accepted = [n - 1 for s in many for n in s.accepted_per_round]
    depths = [d for s in many for d in s.tree_depth_per_round]
    return depth_rates(accepted, depths, max_depth)


@dataclass(frozen=True)
class SpecCounts:
    """One request's speculative figures, vLLM's definitions mapped onto EAGLE trees:
    rounds: verification forwards; drafts: rounds whose tree had depth >= 1 (a root-only tree
    proposed nothing); draft_tokens: the tree depth summed over those rounds (a tree of depth d
    proposes d positions along any path, whatever its width: vLLM's num_speculative_tokens per
    draft); accepted_tokens: tokens committed per round minus the bonus token, summed;
    accepted_per_pos[p]: rounds that accepted at least p + 1 draft tokens; mean_accept_len:
    tau, tokens committed per round, bonus included (1 + accepted / rounds)."""

    rounds: int
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    accepted_per_pos: tuple[int, ...]
    mean_accept_len: float

    @classmethod
    def from_stats(cls, stats) -> "SpecCounts":
        accepted = [max(n - 1, 0) for n in stats.accepted_per_round]
        depths = [d for d in stats.tree_depth_per_round if d >= 1]
        per_pos = tuple(sum(a > p for a in accepted) for p in range(max(depths, default=0)))
        return cls(len(accepted), len(depths), sum(depths), sum(accepted), per_pos, round(stats.mean_accept_len, 4))

    def usage(self) -> dict:
        """The `usage.speculative` field of a response."""
        return {"rounds": self.rounds, "drafts": self.drafts, "draft_tokens": self.draft_tokens,
                "accepted_tokens": self.accepted_tokens, "accepted_per_pos": list(self.accepted_per_pos),
                "mean_accept_len": self.mean_accept_len}
