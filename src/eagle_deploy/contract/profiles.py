"""TensorRT optimization-profile arithmetic, pure (imports neither TensorRT nor torch).

Which input shapes a round with a given tree produces (`tree_calls`, `step_shapes`), whether a
call fits a profile (`profile_violation`, `select_profile`) and whether a whole tree does
(`check_tree_fits`). Used by the engine build (`eagle_deploy.exporter.trt_build`) and by the
TensorRT backend (`eagle_deploy.runtime.backends.trt`) so both agree on every bound.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Sequence

from annotated_types import Ge, MinLen

from . import onnx_io as c
from .field_errors import Expect
from .tree_config import TreeConfig, TreeConfigError

Shape = tuple[int, ...]
Bounds = dict[str, tuple[Shape, Shape, Shape]]  # input name -> (min, opt, max)
NamedBounds = Sequence[tuple[str, Bounds]]  # one (profile name, bounds) per profile, in engine order


_Size = Annotated[int, Ge(0)]
_MinOptMax = Annotated[tuple[tuple[_Size, ...], tuple[_Size, ...], tuple[_Size, ...]],
                       Expect("[min, opt, max] shapes (lists of integers >= 0)", whole=True)]


@dataclass(frozen=True)
class ProfileSpec:
    """One optimization profile: a name and {input name: (min, opt, max) shapes}. The field
    types are what the manifest may hold (pydantic reads them; other keys are ignored)."""

    name: Annotated[str, MinLen(1)]
    shapes: dict[str, _MinOptMax] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"name": self.name, "shapes": {n: [list(s) for s in mom] for n, mom in self.shapes.items()}}

    @classmethod
    def from_json(cls, data: dict) -> "ProfileSpec":
        return cls(data["name"], {n: tuple(tuple(int(d) for d in s) for s in mom) for n, mom in data["shapes"].items()})


@dataclass(frozen=True)
class KVDims:
    """The model sizes a forward's input shapes need (`Dims` from the manifest has them too)."""

    hidden: int
    num_kv_heads: int
    head_dim: int
    tapped: int = 0  # an EAGLE-3 draft graph's `tapped_features` width (0: EAGLE-1/2)


def draft_kv_capacity(max_length: int, tree: TreeConfig) -> int:
    """Rows of the draft head's KV buffer: one per committed position (`max_length`) plus
    scratch rows for the frontier nodes a round of `tree` feeds through the draft
    (`TreeConfig.max_draft_inputs`). The one formula the drafter, the TensorRT backend and
    the TensorRT build use."""
    return max_length + tree.max_draft_inputs()


class ProfileShapeError(ValueError):
    """A call (or a configuration) is outside the engine's optimization profiles."""


class TreeProfileError(ProfileShapeError, TreeConfigError):
    """A tree configuration the engine's profiles cannot run (raised at start-up)."""


# ---------------------------------------------------------------------------------------------
# Pure checks


def profile_violation(shapes: dict[str, Shape], bounds: Bounds) -> str | None:
    """None if every input shape lies within `bounds`, else a sentence naming the first input
    outside them with its size and the profile's bounds."""
    for name, shape in shapes.items():
        if name not in bounds:
            continue
        lo, _, hi = bounds[name]
        shape = tuple(int(s) for s in shape)
        if len(shape) != len(lo):
            return f"input {name!r} has rank {len(shape)} {shape}, the engine expects rank {len(lo)}"
        for axis, (s, a, b) in enumerate(zip(shape, lo, hi)):
            if not a <= s <= b:
                return (f"input {name!r} has shape {shape}: dimension {axis} is {s}, outside [{a}, {b}] "
                        f"(profile bounds min {tuple(lo)} max {tuple(hi)})")
    return None


def profile_order(profiles: NamedBounds) -> list[int]:
    """Profile indices, tightest first (smallest max sequence length), so a decode step uses
    the decode profile and a tree the verification profile."""
    def max_seq(i: int) -> int:
        hi = profiles[i][1].get(c.INPUT_IDS, ((), (), (0, 0)))[2]
        return int(hi[1]) if len(hi) > 1 else 0
    return sorted(range(len(profiles)), key=lambda i: (max_seq(i), i))


def select_profile(shapes: dict[str, Shape], profiles: NamedBounds, order: Sequence[int] | None = None,
                   label: str = "engine") -> int:
    """Index of the first profile (in `order`) accepting every shape, else ProfileShapeError
    listing, per profile, which input is out of bounds."""
    problems = []
    for i in order if order is not None else range(len(profiles)):
        why = profile_violation(shapes, profiles[i][1])
        if why is None:
            return i
        problems.append(f"profile {i} ({profiles[i][0]}): {why}")
    seq = shapes.get(c.INPUT_IDS, (0, "?"))[1]
    past = next((s[0] for n, s in shapes.items() if n.startswith("past_key_values.")), "?")
    raise ProfileShapeError(
        f"{label}: no TensorRT optimization profile accepts this call (seq={seq}, past={past}); nothing was "
        f"enqueued.\n  " + "\n  ".join(problems) + "\nUse a smaller tree or shorter input, or rebuild the engines with "
        "larger bounds (python -m eagle_deploy.exporter.trt_build FOLDER --max-tree-tokens N / --max-prompt N).")


def step_shapes(seq: int, past: int, num_logits: int, dims: KVDims, kv_names: Sequence[tuple[str, str]],
                draft: bool, from_target: bool = True) -> dict[str, Shape]:
    """Input shapes (batch 1) of one forward with `seq` new tokens over `past` cached rows.
    `dims`: a manifest `Dims` or a `KVDims` (anything with hidden, num_kv_heads, head_dim; an
    EAGLE-3 draft's `tapped` width, whose rows are all `tapped_features` when `from_target`
    (an extension) and all own `features` otherwise (an expansion))."""
    shapes = {c.INPUT_IDS: (1, seq), c.POSITION_IDS: (1, seq), c.ATTENTION_MASK: (1, seq, past + seq),
              c.LOGITS_INDICES: (1, num_logits)}
    tapped = getattr(dims, "tapped", 0)
    if draft and tapped:
        shapes[c.TAPPED_FEATURES] = (1, seq if from_target else 0, tapped)
        shapes[c.FEATURES] = (1, 0 if from_target else seq, dims.hidden)
    elif draft:
        shapes[c.FEATURES] = (1, seq, dims.hidden)
    for p, _ in kv_names:
        shapes[p] = (past, 1, dims.num_kv_heads, dims.head_dim)
    return shapes


def _frontier_sizes(tree: TreeConfig) -> list[int]:
    """Nodes fed through the draft per expansion step (all depths)."""
    if tree.depth <= 1:
        return []
    if tree.kind == "static":
        by_depth: dict[int, set] = {}
        for path in tree.choices:
            if len(path) > 1:
                by_depth.setdefault(len(path) - 1, set()).add(path[:-1])
        return sorted({len(v) for v in by_depth.values()})
    return [tree.top_k]


def tree_calls(which: str, tree: TreeConfig, max_length: int,
               draft_capacity: int | None = None) -> list[tuple[str, int, int, int]]:
    """(what, seq, past, num_logits) of the forwards a round with `tree` makes, at the largest
    past each can have (and at past 0). Prompt-sized prefills are excluded (checked per call)."""
    calls = []
    if which == "target":
        for n in range(1, min(tree.total_tokens, max_length - 1) + 1):
            calls += [("verify", n, max_length - n, n), ("verify", n, 0, n)]
        return calls
    cap = draft_capacity or draft_kv_capacity(max_length, tree)
    for k in range(1, min(tree.depth + 1, max_length - 1) + 1):  # extension: accepted path + bonus
        calls.append(("draft extension", k, max_length - k, 1))
    for F in _frontier_sizes(tree):
        calls.append(("draft expansion", F, cap - F, F))
    return calls


def check_tree_fits(profiles: NamedBounds, which: str, tree: TreeConfig, max_length: int, dims: KVDims | None = None,
                    kv_names: Sequence[tuple[str, str]] | None = None, draft_capacity: int | None = None,
                    label: str = "engine") -> None:
    """Raise TreeProfileError (a TreeConfigError) if some forward of a round with `tree`
    falls outside every profile. `dims`/`kv_names` default to what the bounds imply."""
    dims = dims or _dims_from_bounds(profiles)
    kv_names = kv_names or [(n, n.replace("past_key_values", "present"))
                            for n in profiles[0][1] if n.startswith("past_key_values.")]
    order = profile_order(profiles)
    for what, seq, past, n in tree_calls(which, tree, max_length, draft_capacity):
        shapes = step_shapes(seq, past, n, dims, kv_names, draft=(which == "draft"),
                             from_target=not what.endswith("expansion"))
        try:
            select_profile(shapes, profiles, order, label)
        except ProfileShapeError as err:
            raise TreeProfileError(
                f"tree {tree.to_json()} does not fit {label}: its {what} with seq={seq} at past={past} is outside "
                f"every optimization profile.\n{err}") from None


def _dims_from_bounds(profiles: NamedBounds) -> KVDims:
    b = profiles[0][1]
    kv = next(v for n, v in b.items() if n.startswith("past_key_values."))[0]
    hidden = b[c.FEATURES][0][2] if c.FEATURES in b else 0
    tapped = b[c.TAPPED_FEATURES][0][2] if c.TAPPED_FEATURES in b else 0
    return KVDims(hidden=hidden, num_kv_heads=kv[2], head_dim=kv[3], tapped=tapped)
