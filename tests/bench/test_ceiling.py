"""bench/ceiling.py on hand-built costs and rounds: the ceiling is the best depth's expected
tau times vanilla's cost over the round's cost, exactly as the module doc writes it."""
from __future__ import annotations

import pytest

from eagle_deploy.bench.ceiling import ceiling, ceiling_lines, cost_curve
from eagle_deploy.runtime.costs import CostModel

# verify: 8 ms for one row, 10 ms for two, then linear to 16 ms at 8 rows and 22 ms at 16; draft 1 ms
COSTS = CostModel({64: {1: 0.008, 2: 0.010, 8: 0.016, 16: 0.022}}, {64: 0.001})
# rounds committing 3, 1, 2, 3 tokens from depth-3 trees: 2, 0, 1, 2 draft tokens accepted, so the
# per-depth rates are 3/4 (depth 1), 2/3 (depth 2), 0/2 (depth 3)
RUNS = [{"accepted_per_round": [3, 1], "tree_depth_per_round": [3, 3]},
        {"accepted_per_round": [2, 3], "tree_depth_per_round": [3, 3]}]


def test_the_best_depth_and_its_speed_up():
    # top_k 2, total_tokens 16: depth 1 drafts 2 nodes (3 rows), depth 2 six (7 rows), depth 3 ten (11)
    got = ceiling(RUNS, COSTS, depth=3, top_k=2, total_tokens=16, row_exact=False)
    assert got["rates"] == [0.75, 0.6667, 0.0]
    # depth 1: E = 1.75, cost 1 ms + verify(3) = 1 + 11 ms; vanilla verify(1) = 8 ms -> 1.75 * 8 / 12
    # depth 2: E = 2.25, cost 2 + 15 ms -> 1.059; depth 3: E 2.25, cost 3 + 18.25 -> 0.847
    assert got["best_depth"] == 1 and got["expected_tau"] == 1.75
    assert got["ceiling"] == pytest.approx(1.75 * 8 / 12, abs=1e-3)


def test_row_exact_vanilla_pays_two_rows():
    got = ceiling(RUNS, COSTS, depth=3, top_k=2, total_tokens=16, row_exact=True)
    assert got["best_depth"] == 1 and got["ceiling"] == pytest.approx(1.75 * 10 / 12, abs=1e-3)


def test_no_drafted_round_has_no_ceiling():
    runs = [{"accepted_per_round": [1, 1], "tree_depth_per_round": [0, 0]}]
    assert ceiling(runs, COSTS, depth=3, top_k=2, total_tokens=16, row_exact=False) is None


def test_the_cost_curve_and_summary_lines():
    curve = cost_curve(COSTS)
    assert curve["verify_ms"] == {1: 8.0, 2: 10.0, 4: 12.0, 8: 16.0, 16: 22.0}  # measured sizes only
    assert curve["draft_ms"] == 1.0
    cell = {**ceiling(RUNS, COSTS, 3, 2, 16, False), "achieved": 1.2, "of_ceiling": round(1.2 / 1.1667, 3)}
    lines = ceiling_lines({"ort": {"cost_curve": curve, "row_exact": False,
                                   "systems": {"eagle-hybrid": {"all": cell, "qa": cell}}}})
    assert lines[0].startswith("cost curve [ort]: 8.0 / 10.0 / 12.0 / 16.0 / 22.0")
    assert "ceiling eagle-hybrid [ort]: 1.17x at depth 1 (expected tau 1.75); achieved 1.20x = 103% of it" in lines[1]
    assert "qa 1.20/1.17" in lines[1]
