"""Usage: python 2026-12-06-w8a8-graph.py FP32_EXPORT_DIR OUT_DIR (a copy with target.onnx rewritten).
Prototype: the fp32 export's target graph with every constant-weight MatMul (but RoPE's exact
ones) as per-token int8 activations x per-channel int8 weights (MatMulInteger, exact int32
accumulation: each row's result depends on that row only)."""
import shutil, sys
from pathlib import Path
import numpy as np, onnx
from onnx import helper, numpy_helper as nh, TensorProto as T
from eagle_deploy.exporter.quantize import constant_matmuls
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
if dst.exists():
    shutil.rmtree(dst)
shutil.copytree(src, dst, ignore=shutil.ignore_patterns("target.onnx"))
m = onnx.load(str(src / "target.onnx"), load_external_data=True)
names = set(constant_matmuls(m))
g = m.graph
inits = {t.name: t for t in g.initializer}
consts = [nh.from_array(np.array(127.0, np.float32), "w8_c127"), nh.from_array(np.array(128.0, np.float32), "w8_c128"),
          nh.from_array(np.array(1e-12, np.float32), "w8_eps"), nh.from_array(np.array(128, np.uint8), "w8_zp"),
          nh.from_array(np.array(0.0, np.float32), "w8_lo"), nh.from_array(np.array(255.0, np.float32), "w8_hi")]
new_nodes, quantised, done_w = [], {}, set()
for n in g.node:
    if n.op_type != "MatMul" or n.name not in names:
        new_nodes.append(n); continue
    a, w, y = n.input[0], n.input[1], n.output[0]
    if a not in quantised:
        p = f"w8q_{len(quantised)}"
        new_nodes += [helper.make_node("Abs", [a], [p + "_abs"]),
                      helper.make_node("ReduceMax", [p + "_abs"], [p + "_max"], axes=[-1], keepdims=1),
                      helper.make_node("Max", [p + "_max", "w8_eps"], [p + "_max2"]),
                      helper.make_node("Div", [p + "_max2", "w8_c127"], [p + "_s"]),
                      helper.make_node("Div", [a, p + "_s"], [p + "_d"]),
                      helper.make_node("Round", [p + "_d"], [p + "_r"]),
                      helper.make_node("Add", [p + "_r", "w8_c128"], [p + "_b"]),
                      helper.make_node("Clip", [p + "_b", "w8_lo", "w8_hi"], [p + "_c"]),
                      helper.make_node("Cast", [p + "_c"], [p + "_q"], to=T.UINT8)]
        quantised[a] = p
    p = quantised[a]
    if w not in done_w:
        W = nh.to_array(inits[w]).astype(np.float32)
        ws = np.maximum(np.abs(W).max(0), 1e-12) / 127.0
        g.initializer.append(nh.from_array(np.clip(np.round(W / ws), -127, 127).astype(np.int8), w + "_q8"))
        g.initializer.append(nh.from_array(ws.astype(np.float32), w + "_s8"))
        done_w.add(w)
    q = n.name.replace("/", "_") + "_w8"
    new_nodes += [helper.make_node("MatMulInteger", [p + "_q", w + "_q8", "w8_zp"], [q + "_i"]),
                  helper.make_node("Cast", [q + "_i"], [q + "_f"], to=T.FLOAT),
                  helper.make_node("Mul", [q + "_f", p + "_s"], [q + "_m"]),
                  helper.make_node("Mul", [q + "_m", w + "_s8"], [y])]
used = {i for nd in new_nodes for i in nd.input}
keep = [t for t in g.initializer if t.name in used]
del g.initializer[:]
g.initializer.extend(keep + consts)
del g.node[:]
g.node.extend(new_nodes)
onnx.save(m, str(dst / "target.onnx"), save_as_external_data=True, all_tensors_to_one_file=True, location="target.onnx.data", size_threshold=1024)
print("quantised", len(names), "matmuls,", len(quantised), "activation quantisers")
