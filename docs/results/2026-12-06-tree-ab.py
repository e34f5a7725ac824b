"""The 2026-12-06 A/B behind docs/decisions.md ("what summarization / rag tau >= 2.5 would
take"): the planned hybrid drafter with the export's tree (6 / 3 / 2) against the smaller
trees `eagle-bench --tune --specbench` chose on this machine for the head alone (4 / 2 / 4,
4 / 2 / 2), on one runtime, the drafter swapped per request and the order rotating per prompt
(greedy, 128 new tokens). Run from the repository root:
python docs/results/2026-12-06-tree-ab.py ENGINES QUESTION_JSONL LIMIT OUT_JSON"""
import json
import sys
import time
from collections import defaultdict

from eagle_deploy.common.prompts import specbench_prompts
from eagle_deploy.contract.tree_config import TreeConfig
from eagle_deploy.runtime.api import EagleRuntime

prompts = specbench_prompts(sys.argv[2], int(sys.argv[3]))
rt = EagleRuntime.load(sys.argv[1], threads=2, drafter_kind="hybrid", planned=True)
configs = {"6/3/2": (6, 3, 2), "4/2/4": (4, 2, 4), "4/2/2": (4, 2, 2)}
drafters = {}
for name, (total, depth, top_k) in configs.items():
    rt.set_tree(TreeConfig("dynamic", total, depth, top_k))
    drafters[name] = rt.decoder.drafter
rt.generate("warm up", max_new_tokens=16)
agg = defaultdict(lambda: defaultdict(lambda: [0, 0.0, 0]))  # task -> config -> [tokens, seconds, rounds]
same = 0
for i, p in enumerate(prompts):
    order = list(configs)[i % 3:] + list(configs)[:i % 3]
    order = order if i % 2 == 0 else order[::-1]
    ids = {}
    for name in order:
        rt.decoder.drafter = drafters[name]
        t = time.perf_counter()
        r = rt.generate(p["prompt"], max_new_tokens=128)
        dt = time.perf_counter() - t
        ids[name] = r.token_ids
        for key in (p["category"], "all"):
            a = agg[key][name]
            a[0] += r.stats.new_tokens
            a[1] += dt
            a[2] += r.stats.rounds
    same += len({tuple(v) for v in ids.values()}) == 1
    print(i, p["category"], flush=True, end=" | ")
print(f"\nidentical {same}/{len(prompts)}")
table = {}
for task, d in agg.items():
    table[task] = {n: dict(tokens_per_s=round(v[0] / v[1], 2), tau=round(v[0] / v[2], 3)) for n, v in d.items()}
    base = table[task]["6/3/2"]["tokens_per_s"]
    print(f"{task:14s}", " | ".join(f"{n}: {x['tokens_per_s']:.1f} tok/s ({x['tokens_per_s'] / base:.3f}x), "
                                    f"tau {x['tau']:.2f}" for n, x in table[task].items()))
json.dump(dict(engines=sys.argv[1], identical=same, n=len(prompts), tasks=table), open(sys.argv[4], "w"), indent=1)
