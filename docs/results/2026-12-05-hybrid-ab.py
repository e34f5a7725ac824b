"""The 2026-12-05 A/B behind docs/decisions.md ("the alternates cost speed until the planner
decides them"): the planned hybrid drafter with an 8-token lookup chain (the old default), a
16-token chain, and a 16-token chain with 2 alternates, on one runtime per export, the
configuration swapped per request and the order rotating per prompt. Run from the repository
root: python docs/results/2026-12-05-hybrid-ab.py ENGINES[,ENGINES...] QUESTION_JSONL LIMIT OUT_JSON"""
import json, sys, time
from collections import defaultdict
from eagle_deploy.runtime.api import EagleRuntime
from eagle_deploy.runtime.hybrid import HybridDrafter, head_of
from eagle_deploy.runtime.lookup import ContextLookup
from eagle_deploy.common.prompts import specbench_prompts

folders = sys.argv[1].split(",")
limit = int(sys.argv[3])
prompts = specbench_prompts(sys.argv[2], limit)
configs = {"old": (8, 0), "16/0": (16, 0), "new": (16, 2)}
out = {}
for folder in folders:
    rt = EagleRuntime.load(folder, threads=2, drafter_kind="hybrid", planned=True)
    head = head_of(rt.decoder.drafter)
    drafters = {k: HybridDrafter(head, ContextLookup(candidates=1 + a), rt.tree, True, rt.costs, max_lookup=L,
                                 one_path=rt.decoder.row_exact, alternates=a) for k, (L, a) in configs.items()}
    rt.generate("warm up", max_new_tokens=16)
    agg = defaultdict(lambda: defaultdict(lambda: [0, 0.0, 0, 0]))  # task -> cfg -> [tokens, secs, rounds, round_tokens]
    same = 0
    for i, p in enumerate(prompts):
        order = list(configs)[i % 3:] + list(configs)[:i % 3]
        order = order if i % 2 == 0 else order[::-1]
        ids = {}
        for k in order:
            rt.decoder.drafter = drafters[k]
            t = time.perf_counter()
            r = rt.generate(p["prompt"], max_new_tokens=128)
            dt = time.perf_counter() - t
            ids[k] = r.token_ids
            for key in (p["category"], "all"):
                a = agg[key][k]
                a[0] += r.stats.new_tokens; a[1] += dt; a[2] += r.stats.rounds; a[3] += r.stats.round_tokens
        same += ids["old"] == ids["new"] == ids["16/0"]
        print(i, p["category"], flush=True, end=" | ")
    print()
    print(folder, f"identical {same}/{len(prompts)}")
    print(f"{'task':16s} {'old':>7s} {'16/0':>7s} {'new':>7s} {'16/0 r':>6s} {'new r':>6s} {'tau old':>7s} {'16/0':>6s} {'new':>6s}")
    res = {}
    for task, d in agg.items():
        sp = {k: d[k][0] / d[k][1] for k in configs}
        ta = {k: d[k][3] / d[k][2] for k in configs}
        res[task] = dict(speed=sp, tau=ta)
        print(f"{task:16s} {sp['old']:7.1f} {sp['16/0']:7.1f} {sp['new']:7.1f} {sp['16/0']/sp['old']:6.3f} {sp['new']/sp['old']:6.3f} {ta['old']:7.3f} {ta['16/0']:6.3f} {ta['new']:6.3f}")
    out[folder] = dict(identical=same, n=len(prompts), tasks=res)
json.dump(out, open(sys.argv[4], "w"), indent=1)
