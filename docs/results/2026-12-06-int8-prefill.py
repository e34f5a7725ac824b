"""Usage: python 2026-12-06-int8-prefill.py INT4_EXPORT W8A8_DIR FP32_EXPORT ORT_GENAI_DIR QUESTIONS LIMIT OUT
(W8A8_DIR: `python docs/results/2026-12-06-w8a8-graph.py FP32_EXPORT W8A8_DIR`; ORT_GENAI_DIR: the
model-builder folder eagle-bench's ort-genai-int4 peer converts, under ~/.cache/eagle-deploy/peers/.)
Prototype, not the product: the int4 export's planned hybrid drafter with its prompt forwards
(prefill chunks) run by another graph, W8A8_DIR/target.onnx (per-token int8 activations x
per-channel int8 weights, `2026-12-06-w8a8-graph.py` of the fp32 export), decode and verification
unchanged (int4 MatMulNBits, row-exact). Per Spec-Bench question, interleaved, rotating order:
int4 hybrid (int4 prefill), int4 hybrid (int8 prefill), int4 vanilla (int8 prefill, the
identity check), onnxruntime-genai int4, fp32 vanilla (the quality reference)."""
import json, sys, time, collections, contextlib
from pathlib import Path
import numpy as np
from eagle_deploy.runtime.api import EagleRuntime
from eagle_deploy.contract.manifest import Manifest
from eagle_deploy.runtime.backends import load_backend
from eagle_deploy.bench.peers import OrtGenaiSystem

int4, w8dir, fp32, ogdir, qpath, limit, out = sys.argv[1:8]
limit, threads, N = int(limit), 2, 128
from eagle_deploy.common.prompts import specbench_prompts
cats = ["mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"]
picked = [(q["category"], q) for q in specbench_prompts(Path(qpath), limit)]  # eagle-bench's questions

a = EagleRuntime.load(int4, threads=threads, drafter_kind="hybrid", planned=True)
b = EagleRuntime.load(int4, threads=threads, drafter_kind="hybrid", planned=True)
w8 = load_backend("ort", w8dir, Manifest.load(w8dir), "target", threads)
dec = b.decoder
plain_prefill = dec.prefill
def int8_prefill(*args, **kw):
    target = dec.target
    dec.target = w8
    try:
        return plain_prefill(*args, **kw)
    finally:
        dec.target = target
dec.prefill = int8_prefill
ref = EagleRuntime.load(fp32, threads=threads, with_draft=False)
og = OrtGenaiSystem(Path(ogdir), list(a.manifest.eos_token_ids), threads, "ort-genai-int4")

def ours(rt, ids, mode):
    r = rt.generate(list(ids), max_new_tokens=N, mode=mode)
    s = r.stats
    return {"tokens": list(r.token_ids), "seconds": s.t_total, "ttft_ms": s.t_prefill * 1e3, "tau": s.mean_accept_len}
def peer(ids):
    r = og.run(list(ids), N)
    return {"tokens": r.token_ids, "seconds": r.seconds, "ttft_ms": r.ttft_ms}
systems = {"hybrid-int4-prefill": lambda ids: ours(a, ids, "eagle"),
           "hybrid-int8-prefill": lambda ids: ours(b, ids, "eagle"),
           "vanilla-int8-prefill": lambda ids: ours(b, ids, "vanilla"),
           "ort-genai-int4": peer,
           "fp32-vanilla": lambda ids: ours(ref, ids, "vanilla")}
ids0 = a.prompt_ids(picked[0][1]["prompt"])
for f in systems.values():  # warm-up
    f(ids0[:64])
rows = []
for i, (cat, q) in enumerate(picked):
    ids = a.prompt_ids(q["prompt"])
    names = list(systems)
    names = names[i % len(names):] + names[:i % len(names)]
    row = {"category": cat, "id": q["id"], "prompt_tokens": len(ids)}
    for n in names:
        row[n] = systems[n](ids)
    rows.append(row)
    print(cat, len(ids), {n: round(len(row[n]["tokens"]) / row[n]["seconds"], 1) for n in systems}, flush=True)

def common(x, y):
    k = 0
    while k < min(len(x), len(y)) and x[k] == y[k]:
        k += 1
    return k
summary = {}
for c in cats + ["all"]:
    sel = [r for r in rows if c == "all" or r["category"] == c]
    if not sel:
        continue
    tps = {n: sum(len(r[n]["tokens"]) for r in sel) / sum(r[n]["seconds"] for r in sel) for n in systems}
    summary[c] = {"tokens_per_s": {n: round(v, 2) for n, v in tps.items()},
                  "ttft_ms_mean": {n: round(float(np.mean([r[n]["ttft_ms"] for r in sel])), 1) for n in systems},
                  "int4_prefill_vs_ort_genai": round(tps["hybrid-int4-prefill"] / tps["ort-genai-int4"], 3),
                  "int8_prefill_vs_ort_genai": round(tps["hybrid-int8-prefill"] / tps["ort-genai-int4"], 3),
                  "tau": {n: round(float(np.mean([r[n]["tau"] for r in sel])), 3) for n in ("hybrid-int4-prefill", "hybrid-int8-prefill")},
                  "greedy_identical_int8_prefill": sum(r["hybrid-int8-prefill"]["tokens"] == r["vanilla-int8-prefill"]["tokens"] for r in sel),
                  "prompts": len(sel),
                  "common_prefix_with_fp32": {n: round(float(np.mean([common(r[n]["tokens"], r["fp32-vanilla"]["tokens"]) for r in sel])), 1)
                                              for n in ("hybrid-int4-prefill", "hybrid-int8-prefill", "ort-genai-int4")}}
    print(c, json.dumps(summary[c]))
import platform, onnxruntime
Path(out).write_text(json.dumps({"argv": sys.argv, "summary": summary, "rows": rows, "threads": threads, "max_new_tokens": N,
                                 "onnxruntime": onnxruntime.__version__, "date": time.strftime("%Y-%m-%dT%H:%M:%S")}, indent=1))
