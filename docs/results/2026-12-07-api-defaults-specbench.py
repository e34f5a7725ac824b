"""Spec-Bench through the Python API with its defaults (issue 49): `EagleRuntime.load(folder)`
and `rt.generate(prompt, 128)` against `mode="vanilla"` on the same runtime and against the
API's defaults before this change (`drafter_kind="eagle", planned=False`, a second runtime),
interleaved per prompt (the order alternating), greedy, after one warm-up of each. Run on a quiet machine:

    .venv/bin/python docs/results/2026-12-07-api-defaults-specbench.py engines/smollm2-135m \\
        ../shared/data/specbench/question.jsonl 4 docs/results/2026-12-07-api-defaults-specbench.json

Prints tokens/s per task (new tokens over request time, prefill included, as eagle-bench counts
them), the speed-up, τ, the drafter the runtime chose and whether EAGLE's tokens equal vanilla's.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from eagle_deploy.common.prompts import specbench_prompts
from eagle_deploy.runtime.api import EagleRuntime


def main() -> None:
    folder, questions, per_task, out = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    rt = EagleRuntime.load(folder, threads=2)  # the API's defaults, nothing else
    old = EagleRuntime.load(folder, threads=2, drafter_kind="eagle", planned=False)  # the API's defaults before
    prompts = specbench_prompts(questions, per_task)
    for r in (rt, old):
        r.generate("Hello", 8)
    rt.generate("Hello", 8, mode="vanilla")
    rows = []
    for i, p in enumerate(prompts):
        arms = [("eagle", rt, "eagle"), ("vanilla", rt, "vanilla"), ("old", old, "eagle")]
        runs = {name: r.generate(p["prompt"], 128, mode=m) for name, r, m in (arms if i % 2 == 0 else arms[::-1])}
        e, v, o = runs["eagle"], runs["vanilla"], runs["old"]
        rows.append({"id": p["id"], "task": p["category"], "eagle_tps": e.stats.tokens_per_s,
                     "vanilla_tps": v.stats.tokens_per_s, "tau": e.stats.mean_accept_len,
                     "eagle_s": e.stats.t_total, "vanilla_s": v.stats.t_total, "old_s": o.stats.t_total,
                     "old_tau": o.stats.mean_accept_len, "tokens": len(e.token_ids),
                     "identical": e.token_ids == v.token_ids == o.token_ids, "drafter": e.stats.drafter})
    tasks = sorted({r["task"] for r in rows})
    cpu = next((ln.split(":", 1)[1].strip() for ln in subprocess.run(["lscpu"], capture_output=True, text=True)
                .stdout.splitlines() if ln.startswith("Model name")), "?")
    print(f"cpu: {cpu}; options: {rt.options}")
    print(f"{'task':15} {'n':>3} {'vanilla t/s':>12} {'EAGLE t/s':>10} {'speed-up':>9} {'tau':>5} "
          f"{'before: speed-up':>17} {'tau':>5} same")
    summary = {}
    for task in tasks + ["all"]:
        rs = [r for r in rows if task in ("all", r["task"])]
        toks = sum(r["tokens"] for r in rs)
        e_tps = toks / sum(r["eagle_s"] for r in rs)
        v_tps = sum(r["tokens"] for r in rs) / sum(r["vanilla_s"] for r in rs)
        tau = sum(r["tau"] for r in rs) / len(rs)
        same = sum(r["identical"] for r in rs)
        o_tps = toks / sum(r["old_s"] for r in rs)
        o_tau = sum(r["old_tau"] for r in rs) / len(rs)
        summary[task] = {"n": len(rs), "vanilla_tps": round(v_tps, 1), "eagle_tps": round(e_tps, 1),
                         "speedup": round(e_tps / v_tps, 3), "tau": round(tau, 2), "identical": same,
                         "before_tps": round(o_tps, 1), "before_speedup": round(o_tps / v_tps, 3),
                         "before_tau": round(o_tau, 2)}
        print(f"{task:15} {len(rs):3d} {v_tps:12.1f} {e_tps:10.1f} {e_tps / v_tps:8.2f}x {tau:5.2f} "
              f"{o_tps / v_tps:16.2f}x {o_tau:5.2f} {same}/{len(rs)}")
    out.write_text(json.dumps({"cpu": cpu, "options": str(rt.options), "summary": summary, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
