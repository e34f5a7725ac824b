"""The int8 prefill graph as built (issue 50 part 4), end to end on Spec-Bench first turns.

    eagle-export --model smollm2-135m --quant int4 --prefill-weights int8 --out engines-int8p
    python docs/results/2026-12-07-int8-prefill-product.py engines-int8p/smollm2-135m \\
        /work/shared/data/specbench/question.jsonl 10 docs/results/2026-12-07-int8-prefill-product.json

One export, two runtimes over it: the default RuntimeOptions (prefill_graph "auto": prompt forwards
on prefill.onnx) and the same with prefill_graph "target" (the int4 target graph prefills, as
exports without a prefill graph do). Per Spec-Bench question (the first PER_TASK of each task,
eagle-bench's selection: common.prompts.specbench_prompts), greedy, NEW_TOKENS new tokens,
THREADS intra-op threads, four systems interleaved in rotating order:

    eagle-int8-prefill    EAGLE (the default planned hybrid drafter), int8 prefill graph
    eagle-int4-prefill    EAGLE, the int4 target graph prefills
    vanilla-int8-prefill  vanilla decoding after the int8 prefill (the greedy identity check)
    vanilla-int4-prefill  vanilla decoding after the int4 prefill

Prints per task and overall: tokens/s (generated tokens / wall seconds of the request, prefill
included), mean TTFT, mean tau of the EAGLE systems, the ratios int8 / int4 prefill (tokens/s,
TTFT), the ratio "answers held fixed" (each eagle-int4-prefill request's seconds less the TTFT the
int8 prefill saved on the same prompt, against the int4 run: what the faster prefill alone buys,
whatever it does to the answers), and the greedy identity counts (EAGLE == vanilla under each
prefill; int8 == int4 prefill answers). Writes every run to OUT (JSON). A timed benchmark: run it
on a quiet machine (a check that it runs: PER_TASK 1)."""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np

from eagle_deploy.common.cpu import cpu_info
from eagle_deploy.common.prompts import specbench_prompts
from eagle_deploy.contract.errors import SettingError
from eagle_deploy.runtime.api import EagleRuntime
from eagle_deploy.runtime.memory import rss_mb

TASKS = ["mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"]
SYSTEMS = ["eagle-int8-prefill", "eagle-int4-prefill", "vanilla-int8-prefill", "vanilla-int4-prefill"]


def common_prefix(x: list[int], y: list[int]) -> int:
    k = 0
    while k < min(len(x), len(y)) and x[k] == y[k]:
        k += 1
    return k


def run(rt: EagleRuntime, ids: list[int], mode: str, new_tokens: int) -> dict:
    r = rt.generate(list(ids), max_new_tokens=new_tokens, mode=mode)
    s = r.stats
    return {"tokens": list(r.token_ids), "seconds": s.t_total, "ttft_ms": s.t_prefill * 1e3,
            "tau": s.mean_accept_len if mode == "eagle" else None, "prefill_forwards": s.prefill_forwards,
            "finish_reason": r.finish_reason}


def summarise(rows: list[dict]) -> dict:
    tps = {n: sum(len(r[n]["tokens"]) for r in rows) / sum(r[n]["seconds"] for r in rows) for n in SYSTEMS}
    ttft = {n: float(np.mean([r[n]["ttft_ms"] for r in rows])) for n in SYSTEMS}
    # the int4-prefill EAGLE run had it prefilled as fast as the int8 graph does: same answers, less time
    a, b = "eagle-int4-prefill", "eagle-int8-prefill"
    held = sum(len(r[a]["tokens"]) for r in rows) / sum(
        r[a]["seconds"] - (r[a]["ttft_ms"] - r[b]["ttft_ms"]) / 1e3 for r in rows)
    return {
        "prompts": len(rows),
        "tokens_per_s": {n: round(v, 2) for n, v in tps.items()},
        "ttft_ms_mean": {n: round(v, 1) for n, v in ttft.items()},
        "tau": {n: round(float(np.mean([r[n]["tau"] for r in rows])), 3) for n in SYSTEMS if n.startswith("eagle")},
        "eagle_int8_vs_int4_prefill_tokens_per_s": round(tps["eagle-int8-prefill"] / tps["eagle-int4-prefill"], 3),
        "eagle_answers_held_fixed_vs_int4_prefill": round(held / tps["eagle-int4-prefill"], 3),
        "vanilla_int8_vs_int4_prefill_tokens_per_s": round(tps["vanilla-int8-prefill"] / tps["vanilla-int4-prefill"],
                                                           3),
        "ttft_int8_vs_int4_prefill": round(ttft["eagle-int8-prefill"] / ttft["eagle-int4-prefill"], 3),
        "eagle_vs_vanilla_int8_prefill": round(tps["eagle-int8-prefill"] / tps["vanilla-int8-prefill"], 3),
        "greedy_identical_int8_prefill": sum(r["eagle-int8-prefill"]["tokens"] == r["vanilla-int8-prefill"]["tokens"]
                                             for r in rows),
        "greedy_identical_int4_prefill": sum(r["eagle-int4-prefill"]["tokens"] == r["vanilla-int4-prefill"]["tokens"]
                                             for r in rows),
        "same_answer_int8_and_int4_prefill": sum(r["eagle-int8-prefill"]["tokens"] == r["eagle-int4-prefill"]["tokens"]
                                                 for r in rows),
        "common_prefix_int8_int4_prefill_mean": round(float(np.mean(
            [common_prefix(r["eagle-int8-prefill"]["tokens"], r["eagle-int4-prefill"]["tokens"]) for r in rows])), 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("export", type=Path, help="an export made with --quant int4 --prefill-weights int8")
    p.add_argument("questions", type=Path, help="Spec-Bench's question.jsonl")
    p.add_argument("per_task", type=int, help="questions per task (the first ones, as eagle-bench picks them)")
    p.add_argument("out", type=Path, help="JSON written here")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=128)
    args = p.parse_args()

    rss = {"start": rss_mb()}
    int4 = EagleRuntime.load(args.export, threads=args.threads, prefill_graph="target")
    rss["after_int4_prefill_runtime"] = rss_mb()
    int8 = EagleRuntime.load(args.export, threads=args.threads)  # the defaults: prefill_graph "auto"
    rss["after_int8_prefill_runtime"] = rss_mb()  # the shared embedding mapped once for both runtimes
    if int8.decoder.prefill_target is None or int4.decoder.prefill_target is not None:
        raise SystemExit(f"{args.export} has no prefill graph: export it with --quant int4 --prefill-weights int8")
    systems = {"eagle-int8-prefill": (int8, "eagle"), "eagle-int4-prefill": (int4, "eagle"),
               "vanilla-int8-prefill": (int8, "vanilla"), "vanilla-int4-prefill": (int4, "vanilla")}
    picked, skipped = [], []
    for q in specbench_prompts(args.questions, args.per_task):
        try:
            picked.append((q, int8.prompt_ids(q["prompt"])))
        except SettingError as err:  # longer than the export's max_length
            skipped.append({"id": q["id"], "why": str(err)})
    warm = picked[0][1][:64]
    for rt, mode in systems.values():  # sessions' first runs, planner state
        run(rt, warm, mode, 16)

    rows = []
    for i, (q, ids) in enumerate(picked):
        order = SYSTEMS[i % len(SYSTEMS):] + SYSTEMS[:i % len(SYSTEMS)]
        row = {"category": q["category"], "id": q["id"], "prompt_tokens": len(ids), "order": order}
        for name in order:
            rt, mode = systems[name]
            row[name] = run(rt, ids, mode, args.new_tokens)
        rows.append(row)
        print(f"{q['category']:15s} {q['id']:15s} {len(ids):5d} prompt tokens  "
              + "  ".join(f"{n} {len(row[n]['tokens']) / row[n]['seconds']:6.1f} tok/s" for n in SYSTEMS), flush=True)

    summary = {}
    for task in TASKS + ["all"]:
        sel = [r for r in rows if task == "all" or r["category"] == task]
        if sel:
            summary[task] = summarise(sel)
    print()
    head = ["tokens/s"] + [t for t in summary]
    print(" | ".join(head))
    for n in SYSTEMS:
        print(" | ".join([n] + [f"{summary[t]['tokens_per_s'][n]:.1f}" for t in summary]))
    for n in SYSTEMS:
        print(" | ".join([f"TTFT ms {n}"] + [f"{summary[t]['ttft_ms_mean'][n]:.0f}" for t in summary]))
    for n in ("eagle-int8-prefill", "eagle-int4-prefill"):
        print(" | ".join([f"tau {n}"] + [f"{summary[t]['tau'][n]:.2f}" for t in summary]))
    for key in ("eagle_int8_vs_int4_prefill_tokens_per_s", "eagle_answers_held_fixed_vs_int4_prefill",
                "vanilla_int8_vs_int4_prefill_tokens_per_s", "ttft_int8_vs_int4_prefill",
                "eagle_vs_vanilla_int8_prefill"):
        print(" | ".join([key] + [f"{summary[t][key]:.3f}" for t in summary]))
    for key in ("greedy_identical_int8_prefill", "greedy_identical_int4_prefill", "same_answer_int8_and_int4_prefill"):
        print(" | ".join([key] + [f"{summary[t][key]}/{summary[t]['prompts']}" for t in summary]))
    if skipped:
        print(f"skipped {len(skipped)} question(s) longer than the export's max_length")

    import onnxruntime

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "export": str(args.export), "questions": str(args.questions), "per_task": args.per_task,
        "threads": args.threads, "max_new_tokens": args.new_tokens, "summary": summary, "rows": rows,
        "skipped": skipped, "rss_mb": rss, "cpu": cpu_info().to_json(),
        "onnxruntime": onnxruntime.__version__, "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S")}, indent=1, default=str) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
