"""Vanilla decoding ms per token (prefill excluded), row-exact on and off, 8 Spec-Bench prompts
(writing, qa, translation, math_reasoning; second of two passes), 2 threads, 128 new tokens.
Usage: python 2026-12-06-row-exact-ms-per-token.py EXPORT_DIR (reads ../shared/data/specbench)."""
import json, sys
from eagle_deploy.runtime.api import EagleRuntime
ENG = sys.argv[1]
qs = [json.loads(l) for l in open("/work/shared/data/specbench/question.jsonl")]
by = {}
for q in qs:
    by.setdefault(q["category"], []).append(q)
prompts = [by[c][i]["turns"][0] for c in ("writing", "qa", "translation", "math_reasoning") for i in (5, 6)]
on = EagleRuntime.load(ENG, threads=2, row_exact=True, with_draft=False, verify="off")
off = EagleRuntime.load(ENG, threads=2, row_exact=False, with_draft=False, verify="off")
res = {"on": [], "off": []}
for rep in range(2):
    for p in prompts:
        ids = on.encode(p)
        for name, rt in (("on", on), ("off", off)):
            r = rt.generate(ids, max_new_tokens=128, mode="vanilla")
            if rep:
                res[name].append((r.stats.new_tokens, r.stats.t_total - r.stats.t_prefill))
for k, v in res.items():
    n = sum(a for a, _ in v); t = sum(b for _, b in v)
    print(k, n, "tokens", round(1e3 * t / n, 2), "ms/token")
