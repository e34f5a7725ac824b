"""Our int4 vanilla decoding with and without the row-exact recipe (one-token forwards as two
rows) beside onnxruntime-genai int4, same prompts, interleaved per prompt, 2 threads.
Usage: python 2026-12-03-row-exact-vanilla.py INT4_EXPORT_DIR QUESTION_JSONL HF_DIR
(HF_DIR: the Hugging Face folder eagle-bench converts the GGUF to, ~/.cache/eagle-deploy/gguf/...;
onnxruntime-genai's model is built from it as eagle-bench does)."""
import json, sys
from pathlib import Path
import numpy as np
from eagle_deploy.runtime.api import EagleRuntime
from eagle_deploy.bench.peers import make_peer

ENG, QUESTIONS, HF_DIR = sys.argv[1:4]
qs = [json.loads(l) for l in open(QUESTIONS)]
by = {}
for q in qs:
    by.setdefault(q["category"], []).append(q)
prompts = [by[c][i]["turns"][0] for c in ("writing", "qa", "translation", "math_reasoning") for i in (5, 6)]
on = EagleRuntime.load(ENG, threads=2, row_exact=True, with_draft=False)
off = EagleRuntime.load(ENG, threads=2, row_exact=False, with_draft=False)
peer = make_peer("ort-genai-int4", Path(HF_DIR), list(on.eos_ids), 2)
res = {"on": [], "off": [], "ort-genai": []}
for rep in range(2):
    for p in prompts:
        ids = on.encode(p)
        for name, rt in (("on", on), ("off", off)):
            r = rt.generate(ids, max_new_tokens=128, mode="vanilla")
            res[name].append((r.stats.new_tokens, r.stats.t_total))
        run = peer.run(ids, 128)
        res["ort-genai"].append((len(run.token_ids), run.seconds))
for k, v in res.items():
    n, s = np.sum(v, axis=0)
    print(k, f"{n / s:.1f} tok/s", int(n))
