"""The 2026-12-05 A/B behind docs/decisions.md ("GroupQueryAttention without its flash kernel"):
onnxruntime's CPU GroupQueryAttention with its tiled flash kernel (the default) vs
ORT_GQA_DISABLE_FLASH_ATTENTION=1, one runtime each per export in one process (each with its own
measured device costs), planned hybrid drafter, the order alternating per prompt. Run from the
repository root: python docs/results/2026-12-05-gqa-flash-ab.py ENGINES[,ENGINES...] QUESTION_JSONL LIMIT OUT_JSON"""
import json, os, sys, time, tempfile
from collections import defaultdict
from eagle_deploy.runtime.api import EagleRuntime
from eagle_deploy.common.prompts import specbench_prompts

folders = sys.argv[1].split(",")
prompts = specbench_prompts(sys.argv[2], int(sys.argv[3]))
out = {}
for folder in folders:
    rts = {}
    for k in ("flash", "naive"):
        os.environ["EAGLE_DEPLOY_CACHE"] = tempfile.mkdtemp()
        if k == "naive":
            os.environ["ORT_GQA_DISABLE_FLASH_ATTENTION"] = "1"
        else:
            os.environ.pop("ORT_GQA_DISABLE_FLASH_ATTENTION", None)
        rts[k] = EagleRuntime.load(folder, threads=2, drafter_kind="hybrid", planned=True)
        rts[k].generate("warm up", max_new_tokens=16)
        print(k, json.dumps({p: {n: round(v, 1) for n, v in r.items()} for p, r in rts[k].costs.to_json()["verify_ms"].items()}))
    agg = defaultdict(lambda: defaultdict(lambda: [0, 0.0, 0, 0]))
    same = 0
    for i, p in enumerate(prompts):
        order = ["flash", "naive"] if i % 2 == 0 else ["naive", "flash"]
        ids = {}
        for k in order:
            t = time.perf_counter()
            r = rts[k].generate(p["prompt"], max_new_tokens=128)
            dt = time.perf_counter() - t
            ids[k] = r.token_ids
            for key in (p["category"], "all"):
                a = agg[key][k]
                a[0] += r.stats.new_tokens; a[1] += dt; a[2] += r.stats.rounds; a[3] += r.stats.round_tokens
        same += ids["flash"] == ids["naive"]
        print(i, p["category"], flush=True, end=" | ")
    print()
    print(folder, f"identical {same}/{len(prompts)}")
    res = {}
    for task, d in agg.items():
        sp = {k: d[k][0] / d[k][1] for k in ("flash", "naive")}
        ta = {k: d[k][3] / d[k][2] for k in ("flash", "naive")}
        res[task] = dict(speed=sp, tau=ta)
        print(f"{task:16s} flash {sp['flash']:7.1f} naive {sp['naive']:7.1f} ratio {sp['naive']/sp['flash']:6.3f} tau {ta['flash']:6.3f} {ta['naive']:6.3f}")
    out[folder] = dict(identical=same, n=len(prompts), tasks=res)
    del rts
json.dump(out, open(sys.argv[4], "w"), indent=1)
