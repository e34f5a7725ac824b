"""`eagle-bench --tune`: choose an export's default draft tree on this machine by measurement.

1. Cost curves at a realistic past (~256 rows): the target's forward ms for S tree tokens
   (S in 1..64) and the draft graph's forward ms for F rows (frontier sizes), each the fastest
   of interleaved rounds.
2. Acceptance: for each top_k, a greedy calibration generation whose trees keep the whole
   dynamic growth up to a depth (nothing pruned) records every round's tree (tokens,
   parents, draft scores) and the target's argmax at every node. Because a dynamic tree
   with `total_tokens` T and `depth` D is the best T-1 nodes (by score) of that growth cut at
   depth D, and tree attention gives each node the same logits in any subtree, the
   greedy accept length of every (T, D) at that top_k is recomputed offline, exactly, on
   the same rounds: E[tau(T, D, top_k)].
3. Predicted tokens/s = E[tau] / (verify(T) + extension(tau) + (D-1) expand(top_k) +
   overhead): the overhead (tree building, acceptance, commit: each round's time outside the
   backends' forwards, timed in the calibration runs) fitted linearly in the growth's nodes.
4. The best predicted trees and the manifest's current one are then measured on the
   calibration prompts; the fastest becomes `manifest.tree`, and the curves, acceptance,
   candidates and measurements go to `manifest.engines.tuning`.
Greedy acceptance only: sampled acceptance is not modelled.
"""
from __future__ import annotations

import datetime as _dt
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from eagle_deploy.common.cpu import machine_record
from eagle_deploy.contract.tree_config import growth_nodes
from eagle_deploy.runtime.acceptance import depth_rates, tau
from eagle_deploy.runtime.backends.base import StepInputs, StepOutputs
from eagle_deploy.runtime.costs import fastest_of_rounds
from eagle_deploy.runtime.decode import Stats
from eagle_deploy.runtime.drafter import causal_mask
from eagle_deploy.runtime.tree import DraftTree
from eagle_deploy.runtime.verify import verify_greedy

SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)


@dataclass
class TuneConfig:
    engines: Path
    prompts: list[dict]  # [{"id", "category", "prompt"}]; `calib` of them are used, spread out
    calib: int = 4
    max_new_tokens: int = 48
    repeats: int = 5
    threads: int | None = None
    backend: str = "ort"
    save: bool = True
    past: int = 256
    sizes: tuple[int, ...] = SIZES
    top_ks: tuple[int, ...] = (1, 2, 4, 8)
    max_depth: int = 8
    node_budget: int = 140  # largest calibration growth (verification tokens) per round
    verify_top: int = 3  # best predicted trees measured at the end (plus the current one)
    extra: dict = field(default_factory=dict)


def calib_depth(top_k: int, budget: int, cap: int) -> int:
    return max([d for d in range(1, cap + 1) if growth_nodes(top_k, d) <= budget] or [1])


def target_curve(backend, sizes, past: int, repeats: int, vocab: int) -> dict[int, float]:
    """{S: ms} of one target forward over S tree tokens with `past` rows of KV, each the fastest
    of `repeats` interleaved rounds (costs.fastest_of_rounds, as the planner's own costs)."""
    kv = backend.allocate_kv(past + max(sizes) + 1)  # + the row a graph repeating one-row queries writes
    rng = np.random.default_rng(0)
    cells = {}
    for S in sizes:
        inputs = StepInputs(rng.integers(3, vocab, (1, S)), np.arange(past, past + S)[None], causal_mask(past, S),
                            np.arange(S)[None])
        cells[int(S)] = lambda inputs=inputs: backend.run(inputs, kv, past)
    return {S: round(s * 1e3, 3) for S, s in fastest_of_rounds(cells, repeats).items()}


def draft_curve(backend, sizes, past: int, repeats: int, vocab: int, hidden: int, dtype) -> dict[int, float]:
    """{F: ms} of one draft forward over F rows (top-k at every row) with `past` rows, measured
    as target_curve."""
    kv = backend.allocate_kv(past + max(sizes))
    rng = np.random.default_rng(1)
    cells = {}
    for F in sizes:
        inputs = StepInputs(rng.integers(3, vocab, (1, F)), np.full((1, F), past), causal_mask(past, F),
                            np.arange(F)[None], rng.standard_normal((1, F, hidden)).astype(dtype))
        cells[int(F)] = lambda inputs=inputs: backend.run(inputs, kv, past)
    return {F: round(s * 1e3, 3) for F, s in fastest_of_rounds(cells, repeats).items()}


def interp(curve: dict, x: float) -> float:
    xs = sorted(curve)
    return float(np.interp(x, xs, [curve[k] for k in xs]))


@dataclass(frozen=True)
class Round:
    """One verification round: its tree (the whole calibration growth) and the target's argmax
    after every node, argmax [n] int64."""

    tree: DraftTree
    argmax: np.ndarray


def accept_walk(rnd: Round, total_tokens: int, depth: int) -> list[int]:
    """Greedy verification (`verify_greedy`) of the dynamic tree (total_tokens, depth) cut
    from `rnd`'s growth: the best total_tokens - 1 nodes by score at depth <= `depth`. Returns
    the accepted nodes' sibling ranks, root excluded (len + 1 = the round's tau)."""
    tree = rnd.tree
    eligible = [i for i in range(1, tree.size) if tree.depths[i] <= depth]
    order = tree.kept(sorted(eligible, key=lambda i: (-tree.scores[i], i))[: total_tokens - 1])
    cut = tree.subtree(order)
    path = verify_greedy(cut, argmax=rnd.argmax[order]).path
    return [int(np.flatnonzero(cut.children(parent) == node)[0]) for parent, node in zip(path, path[1:])]


def expected_tau(rounds: list[Round], total_tokens: int, depth: int) -> float:
    """E[tau] of the dynamic tree (total_tokens, depth) over the recorded rounds (1.0 without)."""
    return tau(len(accept_walk(r, total_tokens, depth)) + 1 for r in rounds) or 1.0


def acceptance_profile(rounds: list[Round], depth: int) -> dict:
    """Full-growth acceptance: the per-depth acceptance rates (`acceptance.depth_rates`) and
    the accepted sibling ranks."""
    walks = [accept_walk(r, r.tree.size, depth) for r in rounds]
    depths = [min(int(r.tree.depths.max()), depth) for r in rounds]
    ranks = np.bincount([r for w in walks for r in w], minlength=1).tolist() if any(walks) else []
    return {"accept_rate_by_depth": depth_rates([len(w) for w in walks], depths, depth),
            "accepted_sibling_rank_counts": ranks}


class _TimedBackend:
    """A Backend that forwards to another and, while its recorder records, adds up its
    decode-phase forward time."""

    def __init__(self, inner, recorder: "_Recorder"):
        self.inner, self.recorder = inner, recorder
        self.name, self.kv_names = inner.name, inner.kv_names

    def allocate_kv(self, capacity):
        return self.inner.allocate_kv(capacity)

    def run(self, inputs, kv, past) -> StepOutputs:
        if not self.recorder.active:
            return self.inner.run(inputs, kv, past)
        t0 = time.perf_counter()
        out = self.inner.run(inputs, kv, past)
        if past > 0 or inputs.features is not None:  # a target forward at past 0 is the prefill
            self.recorder.forward_s += time.perf_counter() - t0
        return out


class _Recorder:
    """Given to EagleRuntime.load as its backend wrapper (`wrap`) and round observer
    (`observe`). While `recording()`, keeps every round's tree and target argmax and times the
    target's (decode-phase) and the drafter's backend forwards; otherwise it only passes
    calls through."""

    def __init__(self):
        self.active = False
        self.rounds: list[Round] = []
        self.forward_s = 0.0  # backend forward seconds inside decode rounds (prefill excluded)

    def wrap(self, backend) -> _TimedBackend:
        return _TimedBackend(backend, self)

    def observe(self, tree: DraftTree, logits: np.ndarray, verification) -> None:
        if self.active:
            self.rounds.append(Round(tree, np.asarray(logits).argmax(-1)))

    @contextmanager
    def recording(self) -> Iterator["_Recorder"]:
        """Record from a clean slate until the block ends."""
        self.active, self.rounds, self.forward_s = True, [], 0.0
        try:
            yield self
        finally:
            self.active = False


def use_tree(rt, tree) -> None:
    """Point a loaded EagleRuntime at another tree (a fresh drafter over the same draft backend)."""
    rt.set_tree(tree)


class _Tally:
    """Decode tokens/s (prefill excluded), tau and ms per round over several generations."""

    def __init__(self):
        self.new = 0
        self.tokens_per_round: list[int] = []
        self.seconds = 0.0

    def add(self, stats: Stats) -> None:
        self.new += stats.new_tokens - 1
        self.tokens_per_round += stats.accepted_per_round
        self.seconds += stats.decode_seconds

    def to_json(self) -> dict:
        rounds = len(self.tokens_per_round)
        return {"tokens_per_s": round(self.new / max(self.seconds, 1e-9), 2),
                "tau": round(tau(self.tokens_per_round) or 0.0, 3),
                "round_ms": round(self.seconds * 1e3 / max(rounds, 1), 3), "rounds": rounds}


def generate_all(rt, prompts: list[list[int]], max_new_tokens: int) -> dict:
    """Greedy EAGLE over `prompts` with the runtime's current tree (a _Tally's json)."""
    tally = _Tally()
    for ids in prompts:
        tally.add(rt.generate(ids, max_new_tokens=max_new_tokens).stats)
    return tally.to_json()


def measure_trees(rt, trees: list, prompts: list[list[int]], max_new_tokens: int) -> list[dict]:
    """Greedy tokens/s of each tree (None = vanilla decoding), interleaved prompt by prompt
    in alternating order so that drifting machine load hits every tree alike."""
    tallies = [_Tally() for _ in trees]
    for i, ids in enumerate(prompts):
        order = list(range(len(trees))) if i % 2 == 0 else list(range(len(trees)))[::-1]
        for j in order:
            if trees[j] is not None:
                use_tree(rt, trees[j])
            mode = "vanilla" if trees[j] is None else "eagle"
            tallies[j].add(rt.generate(ids, max_new_tokens=max_new_tokens, mode=mode).stats)
    return [t.to_json() for t in tallies]


def fit_overhead(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(ms per round, ms per growth node) >= 0 from (growth nodes, residual ms) points."""
    if not points:
        return 0.0, 0.0
    x, y = np.array([p[0] for p in points], float), np.array([p[1] for p in points], float)
    if len(set(x)) < 2:
        return max(float(y.mean()), 0.0), 0.0
    b, a = np.polyfit(x, y, 1)
    if b < 0:
        return max(float(y.mean()), 0.0), 0.0
    if a < 0:
        return 0.0, max(float((y / x).mean()), 0.0)
    return float(a), float(b)


def predict(cands, tau_of, tcurve, dcurve, overhead) -> list[dict]:
    out = []
    for T, D, K in cands:
        tau = tau_of(T, D, K)
        ms = (interp(tcurve, T) + interp(dcurve, tau) + (D - 1) * interp(dcurve, K)
              + overhead[0] + overhead[1] * growth_nodes(K, D))
        out.append({"total_tokens": T, "depth": D, "top_k": K, "tau": round(tau, 3), "round_ms": round(ms, 3),
                    "predicted_tokens_per_s": round(tau / ms * 1e3, 2)})
    return sorted(out, key=lambda c: -c["predicted_tokens_per_s"])


def distinct(ranked: list[dict]) -> list[dict]:
    """Drop candidates that repeat a better one's (total_tokens, depth, tau): the same tree
    grown with a larger top_k (e.g. depth 1 keeps the best children whatever top_k is)."""
    seen, out = set(), []
    for c in sorted(ranked, key=lambda c: (-c["predicted_tokens_per_s"], c["top_k"])):
        key = (c["total_tokens"], c["depth"], c["tau"])
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def pick_calibration(prompts: list[dict], n: int) -> list[dict]:
    """n prompts taken in turn from each set (or category), evenly spread within it."""
    groups: dict[str, list[dict]] = {}
    for p in prompts:
        groups.setdefault(p.get("set") or p.get("category") or "", []).append(p)
    per = -(-n // max(len(groups), 1))
    spread = [[g[i] for i in np.unique(np.linspace(0, len(g) - 1, num=min(per, len(g))).round().astype(int))]
              for g in groups.values()]
    return [p for k in range(per) for g in spread if k < len(g) for p in [g[k]]][:n]


def _calibration_prompts(rt, cfg: TuneConfig, room: int) -> list[list[int]]:
    ids = [rt.encode(p["prompt"]) for p in pick_calibration(cfg.prompts, cfg.calib)]
    ids = [x for x in ids if len(x) <= room]
    if not ids:
        raise ValueError(f"no calibration prompt fits in {room} tokens")
    return ids


def tune(cfg: TuneConfig, log: Callable = print) -> dict:
    """Measure, choose, verify and (cfg.save) record the tree; returns the tuning record."""
    from eagle_deploy.contract.manifest import Manifest, TuningRecord
    from eagle_deploy.contract.tree_config import TreeConfig
    from eagle_deploy.runtime.api import EagleRuntime

    recorder = _Recorder()
    rt = EagleRuntime.load(cfg.engines, backend=cfg.backend, threads=cfg.threads, wrap_backend=recorder.wrap,
                           round_observers=[recorder.observe], drafter_kind="eagle", planned=False)  # the head's tree
    m, previous = rt.manifest, rt.tree
    top_ks = [k for k in cfg.top_ks if k <= m.draft.graph_top_k]
    depths = {K: calib_depth(K, cfg.node_budget, cfg.max_depth) for K in top_ks}
    full = {K: growth_nodes(K, depths[K]) + 1 for K in top_ks}
    sizes = sorted({s for s in cfg.sizes if s < m.max_length // 2}
                   | {t for t in full.values() if t < m.max_length // 2})
    past = max(0, min(cfg.past, m.max_length - max(sizes) - 1))
    log(f"cost curves at past {past}: target S in {sizes}, draft F in {sorted(set(top_ks) | {1, 2, 4})}")
    tcurve = target_curve(rt.decoder.target, sizes, past, cfg.repeats, m.dims.vocab)
    dcurve = draft_curve(rt.decoder.drafter.backend, sorted(set(top_ks) | {1, 2, 4, max(top_ks)}), past, cfg.repeats,
                         m.dims.vocab, m.dims.hidden, np.dtype(m.draft.dtype))
    room = m.max_length - cfg.max_new_tokens - max(full.values()) - 1
    prompts = _calibration_prompts(rt, cfg, room)
    rounds, calib, residuals = {}, [], []
    for K in top_ks:
        use_tree(rt, TreeConfig("dynamic", full[K], depths[K], K))
        with recorder.recording() as rec:
            meas = generate_all(rt, prompts, cfg.max_new_tokens)
        rounds[K] = rec.rounds
        overhead_ms = meas["round_ms"] - rec.forward_s * 1e3 / max(meas["rounds"], 1)  # tree building, accept, commit
        residuals.append((full[K] - 1, overhead_ms))
        meas["overhead_ms_per_round"] = round(overhead_ms, 3)
        calib.append({"top_k": K, "depth": depths[K], "total_tokens": full[K], **meas,
                      **acceptance_profile(rec.rounds, depths[K])})
        log(f"calibration top_k={K} depth={depths[K]} ({full[K]} tokens): tau {meas['tau']:.2f}, "
            f"{meas['round_ms']:.1f} ms/round")
    overhead = fit_overhead(residuals)
    cands = [(T, D, K) for K in top_ks for D in range(1, depths[K] + 1) for T in sizes
             if 2 <= T <= growth_nodes(K, D) + 1 and T in cfg.sizes and D <= T - 1  # deeper: same tree, more drafts
             and not (D == 1 and any(T - 1 <= k < K for k in top_ks))]  # depth 1: the same tree for every top_k >= T-1
    ranked = distinct(predict(cands, lambda T, D, K: expected_tau(rounds[K], T, D), tcurve, dcurve, overhead))
    trees = [TreeConfig("dynamic", c["total_tokens"], c["depth"], c["top_k"]) for c in ranked[: cfg.verify_top]]
    if previous not in trees:
        trees.append(previous)
    *results, vanilla = measure_trees(rt, trees + [None], prompts, cfg.max_new_tokens)
    measured = [{"tree": tree.to_json(), **meas} for tree, meas in zip(trees, results)]
    for tree, meas in zip(trees, results):
        log(f"measured {tree.kind} T={tree.total_tokens} D={tree.depth} K={tree.top_k}: "
            f"{meas['tokens_per_s']:.1f} tokens/s, tau {meas['tau']:.2f}")
    log(f"measured vanilla decoding: {vanilla['tokens_per_s']:.1f} tokens/s")
    best = max(measured, key=lambda r: r["tokens_per_s"])
    record = {"date": _dt.datetime.now().isoformat(timespec="seconds"), "backend": cfg.backend,
              "machine": machine_record(cfg.threads),
              "past": past, "repeats": cfg.repeats, "target_ms": tcurve, "draft_ms": dcurve,
              "overhead_ms": {"per_round": round(overhead[0], 3), "per_growth_node": round(overhead[1], 4)},
              "calibration": {"prompts": len(prompts), "max_new_tokens": cfg.max_new_tokens, "runs": calib},
              "candidates": ranked[:10], "measured": measured, "previous": previous.to_json(), "chosen": best["tree"],
              "chosen_measured_tokens_per_s": best["tokens_per_s"], "vanilla_tokens_per_s": vanilla["tokens_per_s"],
              "speedup_vs_vanilla": round(best["tokens_per_s"] / max(vanilla["tokens_per_s"], 1e-9), 3)}
    if cfg.save:
        manifest = Manifest.load(cfg.engines)
        tuning = TuningRecord.from_json(_json_keys(record))
        manifest.replace(tree=tuning.chosen, engines=manifest.engines.replace(tuning=tuning)).save(cfg.engines)
    return _json_keys(record)


def _json_keys(obj):
    """int dict keys -> str (JSON object keys), recursively."""
    if isinstance(obj, dict):
        return {str(k): _json_keys(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_json_keys(v) for v in obj]
    return obj
