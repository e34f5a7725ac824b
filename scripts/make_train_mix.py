"""Write a category-weighted subset of a prompt file (development tool, not shipped).

    python scripts/make_train_mix.py ../shared/data/train_prompts.jsonl OUT.jsonl --weight code=0.4

Every category keeps its records in file order; the weighted categories get the named share of
the output (all their records when that is fewer), the rest share what is left in proportion to
their sizes. Deterministic: the same input and weights give the same file. eagle-train shuffles
the prompts with --seed, so every 1,024-prompt part of its data stage carries the same mix.
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("source")
    p.add_argument("out")
    p.add_argument("--weight", action="append", default=[], metavar="CATEGORY=SHARE")
    a = p.parse_args()
    rows = [json.loads(line) for line in open(a.source, encoding="utf-8") if line.strip()]
    by = defaultdict(list)
    for r in rows:
        by[r.get("category", "default")].append(r)
    shares = {k: float(v) for k, v in (w.split("=", 1) for w in a.weight)}
    if sum(shares.values()) >= 1.0 or any(k not in by for k in shares):
        raise SystemExit(f"--weight: shares must name categories of {sorted(by)} and sum below 1")
    # the weighted categories are taken whole; the total follows from the largest of them
    total = min(len(by[k]) / s for k, s in shares.items())
    rest = {k: len(v) for k, v in by.items() if k not in shares}
    left = total * (1.0 - sum(shares.values()))
    take = {k: round(total * s) for k, s in shares.items()}
    take.update({k: min(n, round(left * n / sum(rest.values()))) for k, n in rest.items()})
    with open(a.out, "w", encoding="utf-8") as f:
        for k in sorted(by):
            step = len(by[k]) / max(take[k], 1)
            for i in range(take[k]):
                f.write(json.dumps(by[k][int(i * step)], ensure_ascii=False) + "\n")
    print(json.dumps({k: take[k] for k in sorted(take)}), sum(take.values()))


if __name__ == "__main__":
    main()
