"""The prefix cache on Spec-Bench's two-turn MT-bench questions (issue 50 part 2): turn 1, then
turn 2 as chat messages with turn 1's answer, on one export with the cache (a runtime with
`prefix_cache_mb`) and without it (a second runtime), interleaved per question (the order
alternating), greedy, 128 new tokens, the API's default drafter, after one warm-up of each.
Run from the repository root on a quiet machine:

    .venv/bin/python docs/results/2026-12-07-prefix-cache.py ../shared/data/specbench/question.jsonl \\
        --engines engines/smollm2-135m [--limit 5] [--out docs/results/2026-12-07-prefix-cache.json]

Prints per question turn 2's TTFT (the prefill, first token included: Stats.t_prefill) with and
without the cache, its cached tokens, the settle time of each turn (run after the answer,
off the next request's path: Decoder.settle) and whether both turns' tokens are identical;
then the medians, the ratio of turn 2's TTFT without / with the cache (median of the per-question
ratios, and of the summed times), identity, and the cache's bytes against its budget.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from pathlib import Path

from eagle_deploy.runtime.api import EagleRuntime


def two_turn_questions(path: Path, limit: int | None) -> list[dict]:
    """Spec-Bench's questions with two turns (MT-bench's 80), in file order."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if len(r.get("turns", ())) == 2]
    return rows[:limit] if limit else rows


def turn(rt: EagleRuntime, messages: list[dict], new: int):
    """One greedy request -> (result, seconds its settle took: 0.0 without a cache)."""
    g = rt.stream(messages, new, temperature=0.0)
    g.defer_settle()  # timed apart: it runs after the answer, not in the next request's TTFT
    for _ in g:
        pass
    return g.result, g.settle()


def conversation(rt: EagleRuntime, q: dict, new: int) -> dict:
    chat = [{"role": "user", "content": q["turns"][0]}]
    one, settle1 = turn(rt, chat, new)
    chat += [{"role": "assistant", "content": one.text}, {"role": "user", "content": q["turns"][1]}]
    two, settle2 = turn(rt, chat, new)
    return {"one": one, "two": two, "settle_s": [settle1, settle2]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("questions", type=Path, help="Spec-Bench's question.jsonl")
    ap.add_argument("--engines", type=Path, default=Path("engines/smollm2-135m"))
    ap.add_argument("--limit", type=int, default=None, help="the first N two-turn questions (default: all 80)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new", type=int, default=128, help="new tokens per turn")
    ap.add_argument("--cache-mb", type=float, default=256.0, help="the cached runtime's prefix_cache_mb")
    ap.add_argument("--out", type=Path, default=None, help="write the rows and summary as JSON")
    args = ap.parse_args()

    plain = EagleRuntime.load(args.engines, threads=args.threads)
    cached = EagleRuntime.load(args.engines, threads=args.threads, prefix_cache_mb=args.cache_mb)
    for rt in (plain, cached):
        rt.generate("Hello", 8)
    cached.prefix_cache.clear()
    rows = []
    print(f"{'q':>4} {'turn-2 prompt':>13} {'cached':>6} {'TTFT no cache ms':>16} {'cache ms':>9} {'ratio':>6} "
          f"{'settle ms (1, 2)':>17} same")
    for i, q in enumerate(two_turn_questions(args.questions, args.limit)):
        arms = [("plain", plain), ("cached", cached)]
        runs = {name: conversation(rt, q, args.new) for name, rt in (arms if i % 2 == 0 else arms[::-1])}
        p, c = runs["plain"], runs["cached"]
        row = {"id": q["question_id"], "category": q["category"],
               "prompt_tokens": c["two"].stats.prompt_tokens, "cached_tokens": c["two"].stats.cached_tokens,
               "ttft_plain_s": p["two"].stats.t_prefill, "ttft_cached_s": c["two"].stats.t_prefill,
               "ttft1_plain_s": p["one"].stats.t_prefill, "ttft1_cached_s": c["one"].stats.t_prefill,
               "settle_s": c["settle_s"], "answer_tokens": [len(c["one"].token_ids), len(c["two"].token_ids)],
               "identical": (p["one"].token_ids == c["one"].token_ids and p["two"].token_ids == c["two"].token_ids),
               "cache_bytes": cached.prefix_cache.nbytes}
        rows.append(row)
        print(f"{row['id']:>4} {row['prompt_tokens']:>13} {row['cached_tokens']:>6} {row['ttft_plain_s'] * 1e3:>16.1f} "
              f"{row['ttft_cached_s'] * 1e3:>9.1f} {row['ttft_plain_s'] / row['ttft_cached_s']:>6.2f} "
              f"{row['settle_s'][0] * 1e3:>8.1f} {row['settle_s'][1] * 1e3:>8.1f} {row['identical']}")
    ratios = [r["ttft_plain_s"] / r["ttft_cached_s"] for r in rows]
    settles = [s for r in rows for s in r["settle_s"]]
    summary = {
        "questions": len(rows), "threads": args.threads, "new_tokens": args.new, "engines": str(args.engines),
        "ttft2_plain_median_ms": statistics.median(r["ttft_plain_s"] for r in rows) * 1e3,
        "ttft2_cached_median_ms": statistics.median(r["ttft_cached_s"] for r in rows) * 1e3,
        "ttft2_ratio_median": statistics.median(ratios),
        "ttft2_ratio_of_sums": sum(r["ttft_plain_s"] for r in rows) / sum(r["ttft_cached_s"] for r in rows),
        "cached_share_median": statistics.median(r["cached_tokens"] / r["prompt_tokens"] for r in rows),
        "settle_median_ms": statistics.median(settles) * 1e3, "settle_max_ms": max(settles) * 1e3,
        "identical": sum(r["identical"] for r in rows),
        "cache_bytes_max": max(r["cache_bytes"] for r in rows), "cache_budget_bytes": cached.prefix_cache.budget,
        "cache_counters": vars(cached.prefix_cache.counters),
        "cpu": next((ln.split(":", 1)[1].strip() for ln in subprocess.run(["lscpu"], capture_output=True, text=True)
                     .stdout.splitlines() if ln.startswith("Model name")), "?"),
    }
    print(f"turn 2 TTFT median: {summary['ttft2_plain_median_ms']:.1f} ms without the cache, "
          f"{summary['ttft2_cached_median_ms']:.1f} ms with it: {summary['ttft2_ratio_median']:.2f}x lower "
          f"(median of ratios; {summary['ttft2_ratio_of_sums']:.2f}x of the sums); "
          f"{summary['cached_share_median']:.0%} of turn 2's prompt cached (median)")
    print(f"settle (after each answer): median {summary['settle_median_ms']:.1f} ms, max {summary['settle_max_ms']:.1f} ms; "
          f"identical tokens: {summary['identical']} / {len(rows)}; cache bytes at most {summary['cache_bytes_max']:,} "
          f"of {summary['cache_budget_bytes']:,}")
    if args.out is not None:
        args.out.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
