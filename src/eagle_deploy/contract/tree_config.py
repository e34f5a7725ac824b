"""Draft-tree settings (`TreeConfig`), the static EAGLE-1 trees and the default trees by
target precision.

Glossary. The *root* is the last committed token: the target has chosen it but not yet run
it, so it is node 0 of every tree and the first token of the verification forward. *Depth*
counts edges from the root. `total_tokens` is the number of tree tokens the target verifies
in one forward, root included (as in the EAGLE-2 reference, arXiv 2406.16858 §4), so a tree
holds `total_tokens - 1` draft tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal, Optional

from annotated_types import Ge, MinLen

from .field_errors import Expect

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


# Where draft tokens come from (runtime/hybrid.py): "hybrid" = the EAGLE head's tree and
# context-lookup branches in one tree, "eagle" = the head alone, "lookup" = context lookup alone
# (no draft graph). The commands (eagle-run, eagle-serve, eagle-bench, the Triton model) default
# to DEFAULT_DRAFTER with cost-aware planning; docs/decisions.md has the measurements.
DRAFTER_KINDS = ("hybrid", "eagle", "lookup")
DEFAULT_DRAFTER = "hybrid"


class TreeConfigError(ValueError):
    """Tree settings that cannot work with this export."""


def growth_nodes(top_k: int, depth: int) -> int:
    """Draft nodes an EAGLE-2 growth of `depth` levels holds before its final cut (arXiv
    2406.16858 §4): top_k children of the root, then at each further level the top_k best nodes
    expanded by top_k children each, so top_k + (depth - 1) * top_k^2; a chain (top_k 1) holds
    `depth`. The one home of this count: the planner, eagle-bench --tune and its ceiling read it."""
    return 0 if depth <= 0 else (depth if top_k == 1 else top_k + (depth - 1) * top_k * top_k)


@dataclass(frozen=True)
class TreeConfig:
    """How the drafter grows a tree.

    kind: "dynamic" (EAGLE-2: per depth keep the `top_k` nodes of highest cumulative draft
    log-probability, expand each by `top_k` children, finally keep the best
    `total_tokens - 1` nodes) or "static" (EAGLE-1: the fixed `choices`).
    depth: draft steps per round (the deepest node's depth). top_k: children per expanded
    node. total_tokens: verification tokens per round, root included. The field types are
    what the manifest may hold (pydantic reads them); `validate` checks a tree built in Python.
    """

    __pydantic_config__ = {"extra": "forbid"}
    kind: Literal["dynamic", "static"] = "dynamic"
    total_tokens: Annotated[int, Ge(1)] = 16
    depth: Annotated[int, Ge(1)] = 4
    top_k: Annotated[int, Ge(1)] = 4
    choices: Annotated[Optional[tuple[Annotated[tuple[Annotated[int, Ge(0)], ...], MinLen(1)], ...]],
                       Expect("null or a list of paths (non-empty lists of child ranks >= 0)", whole=True)] = None

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

    def drafted_nodes(self, depth: int | None = None) -> int:
        """Draft nodes a round of this (dynamic) tree verifies when it grows `depth` levels
        (default: its own depth): the growth cut to its best total_tokens - 1."""
        return min(self.total_tokens - 1, growth_nodes(self.top_k, self.depth if depth is None else depth))

    def validate(self, graph_top_k: int) -> "TreeConfig":
        """Return self, or raise TreeConfigError naming the bad setting."""
        if self.kind not in ("dynamic", "static"):
            raise TreeConfigError(f"tree kind {self.kind!r} is not 'dynamic' or 'static'")
        for name in ("total_tokens", "depth", "top_k"):
            if getattr(self, name) < 1:
                raise TreeConfigError(f"tree {name} must be >= 1, got {getattr(self, name)}")
        if self.top_k > graph_top_k:
            raise TreeConfigError(f"tree top_k {self.top_k} exceeds the draft graph's top-k {graph_top_k} "
                                  "(re-export with --graph-top-k)")
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



# Default draft trees by target precision (and, for an fp32 target, whether the draft graph is
# quantised: `default_tree`): the trees `eagle-bench --tune` and interleaved runs chose for
# SmolLM2-135M on a 2-core x86 CPU (docs/decisions.md, 'trees tuned to this CPU' and 'the draft
# graph int8 by default'). A cheaper (int8) draft graph makes a smaller tree pay; row-exact
# decoding (quantised targets) accepts only a tree's top path, so a chain verifies as many useful
# rows as a wider tree; the fused int4 one-token forward is so cheap that a wider verification
# does not pay at the shipped head's int4 acceptance. Re-run `eagle-bench --tune` on your
# machine: it rewrites the export's tree.
DEFAULT_TREES = {
    None: TreeConfig(kind="dynamic", total_tokens=8, depth=4, top_k=2),  # unquantised target and draft
    "draft-quantised": TreeConfig(kind="dynamic", total_tokens=6, depth=3, top_k=2),  # unquantised target
    "int8": TreeConfig(kind="dynamic", total_tokens=4, depth=3, top_k=1),
    "int4": TreeConfig(kind="dynamic", total_tokens=2, depth=1, top_k=1),
}


def default_tree(quant: str | None, draft_quant: str | None = None) -> TreeConfig:
    """The default tree of an export whose target is quantised as `quant` (None | "int8" |
    "int4") and whose draft graph as `draft_quant` (DEFAULT_TREES)."""
    if quant:
        return DEFAULT_TREES[quant]
    return DEFAULT_TREES["draft-quantised" if draft_quant else None]


DEFAULT_TREE = default_tree(None, "int8")  # the default export's (fp32 target, int8 draft)
