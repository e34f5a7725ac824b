"""common/prompts.py: prompt sets taken across their categories."""
from __future__ import annotations

from eagle_deploy.common.prompts import across_categories


def test_across_categories_takes_the_categories_in_turn():
    rows = [{"id": i, "category": c} for i, c in enumerate("aaabbc")]
    assert [r["id"] for r in across_categories(rows, 4)] == [0, 3, 5, 1]
    assert [r["id"] for r in across_categories(rows, 5)] == [0, 3, 5, 1, 4]
    assert across_categories(rows, 0) == rows and across_categories(rows, 9) == rows
    assert [r["id"] for r in across_categories([{"id": 1}, {"id": 2}], 1)] == [1]  # no category: one queue

