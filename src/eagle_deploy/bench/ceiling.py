"""The hardware's ceiling beside the achieved speed-up: how close a run is to what its own
acceptance and this device's forward costs allow.

For an EAGLE system of one engine, over the greedy runs of one category:

- the cost curve: seconds of a target forward of k rows after `past` cached rows, and of one
  draft forward, from the runtime's measured `costs.CostModel` (the costs the planner drafts
  by);
- the run's per-depth acceptance rates r_d (`acceptance.depth_rates` over its rounds: of the
  rounds whose draft reached depth d and accepted d - 1 tokens, the share that accepted d);
- for every draft depth D up to the tree's: E[tau](D) = 1 + sum_{d<=D} prod_{j<=d} r_j (the
  planner's head-only estimate, as if every round drafted the EAGLE-2 tree of depth D with
  `min(total_tokens - 1, growth_nodes(top_k, D))` nodes) and its cost
  D * draft + verify(1 + nodes), against vanilla's verify(1) (verify(2) under row-exact
  decoding where its one-token forwards run two rows: decode.Decoder.step_rows);
- the ceiling: max_D E[tau](D) * vanilla / cost(D), the speed-up over vanilla a round of that
  depth would give at the measured acceptance; beside it the speed-up achieved (tokens/s over
  the same engine's vanilla) and their ratio.

It is an estimate: the rates come from the trees the run drafted (the hybrid drafter's lookup
chains included), prefill time is left out (so a long prompt's achieved figure sits lower),
and acceptance is taken as independent of the tree's width. What it shows is how much of the
gap to a goal the hardware leaves open: on a device where a forward's cost grows fast with its
rows the ceiling is low whatever the head.
"""
from __future__ import annotations

from eagle_deploy.contract.tree_config import growth_nodes
from eagle_deploy.runtime.acceptance import depth_rates
from eagle_deploy.runtime.costs import CostModel

CURVE_ROWS = (1, 2, 4, 8, 16, 32, 64)
PAST = 64  # cached rows the cost curve is read at (the planner measures from a short past up)


def cost_curve(costs: CostModel, past: int = PAST) -> dict:
    """{"verify_ms": {rows: ms}, "draft_ms": ms, "past": past} from a CostModel (seconds), at
    the CURVE_ROWS it measured (up to its largest tree size: nothing extrapolated)."""
    largest = max(max(sizes) for sizes, _ in costs.table)
    return {"verify_ms": {k: round(costs.verify(k, past) * 1e3, 3) for k in CURVE_ROWS if k <= largest},
            "draft_ms": round(costs.draft(past) * 1e3, 3), "past": past}


def ceiling(runs: list[dict], costs: CostModel, depth: int, top_k: int, total_tokens: int,
            row_exact: bool, past: int = PAST) -> dict | None:
    """The best expected speed-up over vanilla that `runs`' own acceptance allows (module doc).

    runs: eagle-bench run records of one EAGLE system (their "accepted_per_round" and
    "tree_depth_per_round"); depth / top_k / total_tokens: the engine's tree; row_exact: its
    one-token forwards run as two rows (row-exact decoding on a graph that does not repeat
    one-row queries itself: decode.Decoder.step_rows == 2). -> {"rates", "best_depth",
    "expected_tau", "ceiling"}; None when the runs drafted nothing (no rate at depth 1)."""
    accepted = [n - 1 for r in runs for n in r.get("accepted_per_round", [])]
    depths = [d for r in runs for d in r.get("tree_depth_per_round", [])]
    rates = depth_rates(accepted, depths, depth)
    vanilla = costs.verify(2 if row_exact else 1, past)
    best, reach, expected = None, 1.0, 1.0
    for d, rate in enumerate(rates, start=1):
        if rate is None:
            break
        reach *= rate
        expected += reach
        rows = 1 + min(total_tokens - 1, growth_nodes(top_k, d))
        seconds = d * costs.draft(past) + costs.verify(max(rows, 2) if row_exact else rows, past)
        gain = expected * vanilla / seconds
        if best is None or gain > best["ceiling"]:
            best = {"best_depth": d, "expected_tau": round(expected, 3), "ceiling": round(gain, 3)}
    return None if best is None else {"rates": rates, **best}


def engine_ceilings(records: list[dict], engine) -> dict | None:
    """{"cost_curve", "row_exact", "step_rows" (decode.Decoder.step_rows), "systems": {name:
    {category: {..ceiling, "achieved", "of_ceiling"}}}} for one loaded bench engine over its
    greedy records, per category and "all"; each EAGLE system read with its own runtime's
    CostModel and tree (a system whose drafter is unplanned measured no costs and is left out;
    None when none has costs)."""
    out = None
    for system in [engine.eagle, *engine.others]:
        rt = system.rt
        if getattr(rt, "costs", None) is None:
            continue
        if out is None:
            out = {"cost_curve": cost_curve(rt.costs), "row_exact": rt.decoder.row_exact,
                   "step_rows": rt.decoder.step_rows, "systems": {}}
        by_cat: dict[str, list[tuple[dict, dict]]] = {}
        for r in records:
            if r["temperature"] != 0 or system.name not in r["runs"] or engine.vanilla.name not in r["runs"]:
                continue
            for cat in ("all", r["category"]):
                by_cat.setdefault(cat, []).append((r["runs"][system.name], r["runs"][engine.vanilla.name]))
        cells = {}
        for cat, pairs in by_cat.items():
            c = ceiling([e for e, _ in pairs], rt.costs, rt.tree.depth, rt.tree.top_k, rt.tree.total_tokens,
                        rt.decoder.step_rows == 2)
            if c is None:
                continue
            eagle_tps = sum(e["new_tokens"] for e, _ in pairs) / sum(e["seconds"] for e, _ in pairs)
            vanilla_tps = sum(v["new_tokens"] for _, v in pairs) / sum(v["seconds"] for _, v in pairs)
            cells[cat] = {**c, "achieved": round(eagle_tps / vanilla_tps, 3),
                          "of_ceiling": round(eagle_tps / vanilla_tps / c["ceiling"], 3)}
        out["systems"][system.name] = cells
    return out


def ceiling_lines(ceilings: dict) -> list[str]:
    """Summary lines: each engine's cost curve, then per system the ceiling and the achieved
    speed-up overall and per category."""
    lines = []
    for key, c in ceilings.items():
        curve = c["cost_curve"]
        rows = " / ".join(f"{ms:.1f}" for ms in curve["verify_ms"].values())
        lines.append(f"cost curve [{key}]: {rows} ms for {' / '.join(map(str, curve['verify_ms']))} rows "
                     f"after {curve['past']}, draft forward {curve['draft_ms']:.1f} ms"
                     + (" (row-exact: one-token forwards run 2 rows)" if c.get("step_rows") == 2 else ""))
        for system, cats in c["systems"].items():
            if "all" not in cats:
                continue
            a = cats["all"]
            per = ", ".join(f"{cat} {v['achieved']:.2f}/{v['ceiling']:.2f}" for cat, v in sorted(cats.items())
                            if cat != "all")
            lines.append(f"ceiling {system} [{key}]: {a['ceiling']:.2f}x at depth {a['best_depth']} "
                         f"(expected tau {a['expected_tau']:.2f}); achieved {a['achieved']:.2f}x = "
                         f"{100 * a['of_ceiling']:.0f}% of it" + (f"; per task achieved/ceiling: {per}" if per else ""))
    return lines
