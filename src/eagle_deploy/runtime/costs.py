"""What forwards cost on this device: the `CostModel` the planned drafter plans with (and
eagle-bench's ceiling reads), how it is measured (`measure_costs`, `fastest_of_rounds`), and
its per-machine cache (`device_costs`, `costs_cache_path`). eagle-bench --tune measures its own
curves with `fastest_of_rounds` and writes them to the manifest, which `device_costs` prefers.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import numpy as np

from eagle_deploy.common.cache import cache_root
from eagle_deploy.common.cpu import cpu_info
from eagle_deploy.contract.manifest import Manifest
from eagle_deploy.contract.onnx_io import MANIFEST_FILE
from eagle_deploy.contract.tree_config import TreeConfig
from eagle_deploy.contract.verify import sha256_file

from .backends import Backend
from .backends.base import StepInputs, feature_inputs
from .drafter import causal_mask


def _line(x, xs: list[float], ys):
    """Piecewise-linear through (xs, ys) (sorted xs) at x (a number or an array), extrapolated
    beyond the last point with the last segment's slope (never below 0); constant with one
    point. ys may hold arrays (one curve per element), then x is a number."""
    if len(xs) == 1:
        return ys[0] + 0 * np.asarray(x, dtype=float)
    last = np.maximum((np.asarray(ys[-1]) - ys[-2]) / (xs[-1] - xs[-2]), 0.0) * (np.asarray(x) - xs[-1]) + ys[-1]
    if np.ndim(ys[0]) == 0:
        return np.where(np.asarray(x) >= xs[-1], last, np.interp(x, xs, ys))
    if x >= xs[-1]:
        return last
    i = int(np.clip(np.searchsorted(xs, x, side="right") - 1, 0, len(xs) - 2))
    w = float(np.clip((x - xs[i]) / (xs[i + 1] - xs[i]), 0.0, 1.0))
    return (1 - w) * np.asarray(ys[i]) + w * np.asarray(ys[i + 1])


class CostModel:
    """Seconds of a verification forward by tree size (nodes, root included) and of one draft
    forward, each at the cached rows (past) it runs with, measured on this device
    (`measure_costs`, or the curves of the export's last `eagle-bench --tune`) and then fixed:
    plans depend only on the request's tokens, so a seeded request gives the same tokens every
    time. Attention makes a tree's rows dearer as the context grows (docs/decisions.md,
    'Device costs, measured'), hence past.

    verify_s: {past: {nodes: seconds}} (at least one past with at least one size);
    draft_s: {past: seconds per draft forward} ({} = free). Raises ValueError when verify_s is
    empty."""

    def __init__(self, verify_s: dict[int, dict[int, float]], draft_s: dict[int, float]):
        if not verify_s or not all(verify_s.values()):
            raise ValueError("CostModel needs at least one verification cost")
        self.pasts = sorted(int(p) for p in verify_s)
        self.table = [(sorted(int(n) for n in verify_s[p]), [float(verify_s[p][n]) for n in sorted(verify_s[p])])
                      for p in self.pasts]
        self.draft_pasts = sorted(int(p) for p in draft_s) or [0]
        self.draft_costs = [float(draft_s[p]) for p in self.draft_pasts] if draft_s else [0.0]

    @classmethod
    def from_tuning(cls, details) -> "CostModel | None":
        """From a TuningRecord's details ("target_ms": {S: ms}, "draft_ms": {F: ms} at "past"),
        or None when they are missing."""
        target, draft = details.get("target_ms"), details.get("draft_ms")
        if not target or not draft:
            return None
        past = int(details.get("past", 256))
        draft = {int(k): float(v) for k, v in draft.items()}
        return cls({past: {int(k): float(v) / 1e3 for k, v in target.items()}}, {past: draft[min(draft)] / 1e3})

    def to_json(self) -> dict:
        """{"verify_ms": {past: {nodes: ms}}, "draft_ms": {past: ms}}, exact (from_json reads it)."""
        verify = {str(p): {str(n): c * 1e3 for n, c in zip(*row)} for p, row in zip(self.pasts, self.table)}
        return {"verify_ms": verify, "draft_ms": {str(p): c * 1e3 for p, c in zip(self.draft_pasts, self.draft_costs)}}

    @classmethod
    def from_json(cls, data: dict) -> "CostModel":
        """The model `to_json` wrote. Raises KeyError, ValueError, TypeError or AttributeError
        on anything else."""
        return cls({int(p): {int(n): float(v) / 1e3 for n, v in row.items()} for p, row in data["verify_ms"].items()},
                   {int(p): float(v) / 1e3 for p, v in data["draft_ms"].items()})

    def verify(self, nodes, past: int = 0):
        """Seconds of a forward verifying `nodes` tree nodes (a number, or an array of sizes)
        after `past` cached rows: piecewise-linear in nodes at each measured past, then in past
        (extrapolated beyond the measured points with their last slope)."""
        at = _line(past, self.pasts, [_line(nodes, sizes, costs) for sizes, costs in self.table])
        return float(at) if np.ndim(at) == 0 else at

    def draft(self, past: int = 0) -> float:
        """Seconds of one draft forward after `past` cached rows."""
        return float(_line(past, self.draft_pasts, self.draft_costs))


_clock = time.perf_counter  # what fastest_of_rounds times with (tests replace it with a simulated clock)


def fastest_of_rounds(cells: dict, rounds: int) -> dict:
    """{key: seconds}: each of `cells` ({key: callable}) run once to warm up (onnxruntime's first
    run of a shape allocates), then timed once per round over `rounds` rounds that each visit
    every cell in turn; a cell's cost is its fastest round. Noise lasting a second or two
    (another process, a VM neighbour) then slows one round of every cell alike instead of every
    repeat of the few cells measured while it lasted, and some round of each cell misses it.
    Timed one cell after another instead (a median of repeats), the same cell's cost varied far
    more from run to run than on a quiet machine, and the planner drafted less after a noisy
    measurement (docs/decisions.md, 'Device costs, measured')."""
    for fn in cells.values():
        fn()
    best = dict.fromkeys(cells, float("inf"))
    for _ in range(rounds):
        for key, fn in cells.items():
            t0 = _clock()
            fn()
            best[key] = min(best[key], _clock() - t0)
    return best


def measure_costs(target, draft, sizes, draft_rows: int, vocab: int, feature_width: int, feature_dtype,
                  eagle3_widths: tuple[int, int] | None = None, pasts=(128,), repeats: int = 3) -> CostModel:
    """Time the target's verification forward at each tree size in `sizes` and one draft
    expansion forward of `draft_rows` rows (None `draft`: no draft cost), at each number of
    cached rows in `pasts`, in scratch KV buffers of their own (`max(pasts) + max(sizes)` rows).
    Each forward is warmed up once and then timed in `repeats` interleaved rounds, its cost
    the fastest (`fastest_of_rounds`): a few dozen forwards (about 2 s on SmolLM2-135M, 2 cores,
    at pasts 64 and 1024)."""
    sizes, pasts = sorted({int(s) for s in sizes}), sorted({int(p) for p in pasts})
    rng = np.random.default_rng(0)
    kv = target.allocate_kv(pasts[-1] + sizes[-1] + 1)  # + the row a graph repeating one-row queries writes
    dkv = draft.allocate_kv(pasts[-1] + draft_rows) if draft is not None else None
    cells = {}
    for past in pasts:
        for S in sizes:
            inputs = StepInputs(rng.integers(0, vocab, (1, S)), np.arange(past, past + S)[None],
                                causal_mask(past, S), np.arange(S)[None])
            cells["verify", past, S] = lambda inputs=inputs, past=past: target.run(inputs, kv, past)
        if draft is not None:
            feats = rng.standard_normal((1, draft_rows, feature_width)).astype(feature_dtype)
            features, tapped = feature_inputs(feats, False, eagle3_widths)
            inputs = StepInputs(rng.integers(0, vocab, (1, draft_rows)), np.full((1, draft_rows), past),
                                causal_mask(past, draft_rows), np.arange(draft_rows)[None], features, tapped)
            cells["draft", past] = lambda inputs=inputs, past=past: draft.run(inputs, dkv, past)
    seconds = fastest_of_rounds(cells, repeats)
    verify_s = {past: {S: seconds["verify", past, S] for S in sizes} for past in pasts}
    draft_s = {past: seconds["draft", past] for past in pasts} if draft is not None else {}
    return CostModel(verify_s, draft_s)


def device_costs(manifest: Manifest, tree: TreeConfig, target: Backend, draft: Backend | None,
                 folder: Path | None = None, threads: int | None = None, extra_rows: tuple[int, ...] = ()) -> CostModel:
    """The cost model a planned drafter plans with: the curves of the export's last
    `eagle-bench --tune` when the manifest has them; else the costs measured for this export,
    tree, backend, thread count and CPU once and cached (`costs_cache_path`), so every process
    on this machine plans alike (and a seed gives the same tokens); else measured now
    (measure_costs: the tree sizes the planner can choose, one draft expansion of
    top_k rows) and cached. A cache that cannot be written is skipped. extra_rows: what a
    drafter may add to the tree's rows (the hybrid drafter's lookup chain and alternates,
    hybrid.LOOKUP_ROWS); their sum sets the largest size measured, and they key the cache."""
    tuning = manifest.engines.tuning
    costs = CostModel.from_tuning(tuning.details) if tuning is not None else None
    if costs is not None:
        return costs
    path = costs_cache_path(folder, tree, target, draft, threads, extra_rows) if folder is not None else None
    if path is not None and path.is_file():
        try:
            return CostModel.from_json(json.loads(path.read_text()))
        except (ValueError, KeyError, TypeError, AttributeError, OSError):
            try:  # a damaged or older cache entry is measured again
                path.unlink(missing_ok=True)
            except OSError:
                pass
    full = tree.total_tokens + sum(extra_rows)
    sizes = [s for s in (1, 2, 4, 8, 16, 32) if s < full] + [full]
    head = manifest.draft.head
    eagle3 = manifest.draft.head_kind == "eagle3"
    widths = (head.hidden, head.tapped_width(manifest.dims.hidden)) if eagle3 else None
    room = max(0, manifest.max_length - full - 1)
    pasts = sorted({min(64, room), min(1024, room)})
    costs = measure_costs(target, draft, sizes, max(tree.top_k, 1), manifest.dims.vocab,
                          head.hidden if eagle3 else manifest.dims.hidden, np.dtype(manifest.draft.dtype), widths,
                          pasts)
    if path is not None:  # the first process to finish measuring wins; every process then plans with its costs
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(costs.to_json()))
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass
            costs = CostModel.from_json(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass  # no cache here: plan with this process's own measurement
        finally:
            tmp.unlink(missing_ok=True)
    return costs


COSTS_METHOD = "fastest-of-rounds"  # part of the cache key: costs measured another way are measured again


def costs_cache_path(folder: Path, tree: TreeConfig, target: Backend, draft: Backend | None,
                     threads: int | None, extra_rows: tuple[int, ...] = ()) -> Path:
    """<cache_root>/costs/<export>-<digest>.json, the digest over how costs are measured
    (COSTS_METHOD), the export's manifest, the tree, the backends, the thread count and the CPU
    model."""
    cpu = cpu_info()
    key = json.dumps([COSTS_METHOD, sha256_file(Path(folder) / MANIFEST_FILE), tree.to_json(),
                      *extra_rows, getattr(target, "name", "?"),
                      getattr(draft, "name", None), threads, cpu.model,
                      cpu.cores])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root() / "costs" / f"{Path(folder).resolve().name}-{digest}.json"
