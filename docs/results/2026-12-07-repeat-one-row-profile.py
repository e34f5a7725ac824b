"""onnxruntime's profiler on two SmolLM2 int4 exports (NEW repeats one-row queries, OLD does not):
kernel time per op type of one-token forwards at past 256, 2 threads: NEW one row, OLD two
rows, OLD one row (issue 50 part 1, docs/decisions.md 2026-12-07).
Usage: python 2026-12-07-repeat-one-row-profile.py NEW OLD"""
import json, sys, collections, numpy as np, onnxruntime as ort, glob, os
from eagle_deploy.runtime.backends.ort import session_options, shared_initializers
from eagle_deploy.contract.manifest import Manifest
from eagle_deploy.runtime.drafter import causal_mask
def prof(folder, S, past=256, n=60, threads=2):
    m = Manifest.load(folder)
    so = session_options(threads, True); so.enable_profiling = True; so.profile_file_prefix = f"/tmp/prof_{os.path.basename(folder)}_{S}"
    keep, inits = shared_initializers(folder, m.shared_weights, "target")
    for k, v in inits.items(): so.add_initializer(k, v)
    sess = ort.InferenceSession(f"{folder}/target.onnx", so, providers=["CPUExecutionProvider"])
    d = m.dims; cap = past + 4
    kv = {f"past_key_values.{i}.{t}": np.zeros((1, d.num_kv_heads, cap, d.head_dim), np.float32) for i in range(d.num_layers) for t in ("key", "value")}
    ids = np.random.default_rng(0).integers(3, d.vocab, (1, past))
    feeds = dict(input_ids=ids, position_ids=np.arange(past)[None], attention_mask=causal_mask(0, past), logits_indices=np.array([[past - 1]]), **kv)
    sess.run(None, feeds)
    tok = 77
    f1 = dict(kv, input_ids=np.array([[tok] * S]), position_ids=np.arange(past, past + S)[None], attention_mask=causal_mask(past, S), logits_indices=np.array([[0]]))
    for _ in range(n): sess.run(["logits"], f1)
    path = sess.end_profiling()
    ev = json.load(open(path))
    by = collections.Counter(); cnt = collections.Counter()
    runs_ev = sorted((e["ts"], e["ts"] + e["dur"]) for e in ev if e.get("cat") == "Session" and e["name"] == "model_run")
    start = runs_ev[1][0]  # skip the prefill
    for e in ev:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= start:
            by[e["args"]["op_name"]] += e["dur"]; cnt[e["args"]["op_name"]] += 1
    runs = n
    tot = sum(by.values()) / runs / 1e3
    return tot, {k: (round(v / runs / 1e3, 3), cnt[k] // runs) for k, v in by.most_common()}
for folder, S in ((sys.argv[1], 1), (sys.argv[2], 2), (sys.argv[2], 1)):
    tot, ops = prof(folder, S)
    print(os.path.basename(folder), S, f"kernels {tot:.2f} ms", ops)
