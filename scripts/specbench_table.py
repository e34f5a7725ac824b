"""Print the Spec-Bench tables of an eagle-bench result JSON (Markdown): tokens/s per task and
overall for every system, τ per task for ours, and the ratios the README quotes.

    python scripts/specbench_table.py docs/results/2026-12-01-specbench-run1.json
"""
from __future__ import annotations

import json
import sys

from eagle_deploy.bench.report import vanilla_of

TASKS = ["mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"]


def main(path: str) -> None:
    res = json.load(open(path))
    agg = res["aggregate"]["0"]
    systems = list(agg["all"]["systems"])
    cols = [t for t in TASKS if t in agg] + ["all"]
    print("| tokens/s | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for s in systems:
        print(f"| {s} | " + " | ".join(f"{agg[c]['systems'][s]['tokens_per_s']:.1f}" if s in agg[c]["systems"]
                                       else "-" for c in cols) + " |")
    print()
    print("| τ | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for s in systems:
        if not s.startswith("eagle"):
            continue
        print(f"| {s} | " + " | ".join(f"{agg[c]['systems'][s]['tau']:.2f}" for c in cols) + " |")
    print()
    pairs = [(s, vanilla_of(s)) for s in systems if s.startswith("eagle")]
    pairs += [(s, p) for s in systems if s.startswith("eagle") and s.endswith("int4")
              for p in systems if p.startswith("ort-genai-int4")]
    print("| ratio | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for a, b in pairs:
        print(f"| {a} / {b} | " + " | ".join(
            f"{agg[c]['systems'][a]['tokens_per_s'] / agg[c]['systems'][b]['tokens_per_s']:.2f}x" for c in cols) + " |")
    gi = res["greedy_identity"]
    same = [(r["id"], n) for r in res["prompts"] for n, run in r["runs"].items()
            if run.get("identical_to_vanilla") is False]
    print()
    print("greedy identity:", {k: f"{v['identical']}/{v['prompts']}" for k, v in gi.items()},
          "hybrid runs differing from their vanilla:", same or "none")


if __name__ == "__main__":
    main(sys.argv[1])
