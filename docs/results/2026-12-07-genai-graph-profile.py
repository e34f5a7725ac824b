"""onnxruntime's profiler on onnxruntime-genai's own int4 model.onnx (the eagle-bench peer build):
its op mix and kernel time per one-token forward at past 256, 2 threads, run by a plain
InferenceSession (no share-buffer KV: a per-op comparison, not its decode loop). Beside
2026-12-07-repeat-one-row-profile.py on our int4 export (docs/decisions.md, fifth session, issue 50).
Usage: python 2026-12-07-genai-graph-profile.py PEER_DIR, the eagle-bench peer build, e.g.
~/.cache/eagle-deploy/peers/SmolLM2-135M-Instruct.Q4_1-<hash>/ort-genai-0.18.0-int4"""
import collections, json, os, sys
import numpy as np, onnx, onnxruntime as ort
path = os.path.join(sys.argv[1], "model.onnx")
m = onnx.load(path, load_external_data=False)
print([ (i.name) for i in m.graph.input][:4], len(m.graph.node))
print(collections.Counter(n.op_type for n in m.graph.node).most_common(25))
for n in m.graph.node:
    if n.op_type == 'GroupQueryAttention':
        print(n.input, [ (a.name, onnx.helper.get_attribute_value(a)) for a in n.attribute]); break
for n in m.graph.node:
    if n.op_type == 'MatMulNBits':
        print(n.name, [ (a.name, onnx.helper.get_attribute_value(a)) for a in n.attribute]); break
so = ort.SessionOptions(); so.intra_op_num_threads = 2; so.enable_profiling = True; so.profile_file_prefix = "/tmp/prof_genai"
sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
dec = json.load(open(os.path.join(os.path.dirname(path), "genai_config.json")))["model"]["decoder"]
past = 256
kv = {f"past_key_values.{i}.{t}": np.zeros((1, dec["num_key_value_heads"], past, dec["head_size"]), np.float32)
      for i in range(dec["num_hidden_layers"]) for t in ("key", "value")}
feeds = dict(input_ids=np.array([[77]]), attention_mask=np.ones((1, past + 1), np.int64), **kv)
names = {i.name for i in sess.get_inputs()}
feeds = {k: v for k, v in feeds.items() if k in names}
print(sorted(names - set(feeds)))
for _ in range(60): sess.run(["logits"], feeds)
ev = json.load(open(sess.end_profiling()))
by = collections.Counter(); cnt = collections.Counter()
for e in ev:
    if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
        op = e["args"]["op_name"]; by[op] += e["dur"]; cnt[op] += 1
tot = sum(by.values()) / 60 / 1000
print("genai kernels per forward %.2f ms" % tot, {k: (round(v / 60 / 1000, 3), cnt[k] // 60) for k, v in by.most_common()})
