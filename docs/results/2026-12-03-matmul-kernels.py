import numpy as np, onnx, onnxruntime as ort, time, sys
from onnx import helper, TensorProto, numpy_helper
K, N = 576, 3072
rng = np.random.default_rng(0)
W = rng.standard_normal((K, N)).astype(np.float32) * 0.05

def sess(model):
    so = ort.SessionOptions(); so.intra_op_num_threads = 2
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])

def fp32():
    g = helper.make_graph([helper.make_node("MatMul", ["A", "W"], ["Y"])], "g",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", K])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", N])], [numpy_helper.from_array(W, "W")])
    return sess(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))

def dqmm():
    s = np.abs(W).max(0) / 127.0
    q = np.clip(np.round(W / s), -127, 127).astype(np.int8)
    g = helper.make_graph([helper.make_node("DynamicQuantizeMatMul", ["A", "Wq", "S", "", ""], ["Y"], domain="com.microsoft")], "g",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", K])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", N])],
        [numpy_helper.from_array(q, "Wq"), numpy_helper.from_array(s.astype(np.float32), "S")])
    return sess(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]))

def nbits(bits=4, block=32, acc=4):
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer, DefaultWeightOnlyQuantConfig
    g = helper.make_graph([helper.make_node("MatMul", ["A", "W"], ["Y"])], "g",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", K])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", N])], [numpy_helper.from_array(W, "W")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    cfg = DefaultWeightOnlyQuantConfig(block_size=block, is_symmetric=True, accuracy_level=acc, bits=bits)
    qz = MatMulNBitsQuantizer(m, algo_config=cfg); qz.process()
    return sess(qz.model.model)

def bench(s, M, reps=200):
    A = rng.standard_normal((M, K)).astype(np.float32)
    for _ in range(20): s.run(None, {"A": A})
    ts = []
    for _ in range(reps):
        t = time.perf_counter(); s.run(None, {"A": A}); ts.append(time.perf_counter() - t)
    return np.median(ts) * 1e6

ss = {"fp32": fp32(), "int8-dqmm": dqmm(), "nbits4-acc4": nbits(4), "nbits8-acc4": nbits(8)}
Ms = [1, 2, 4, 8, 16, 32, 256]
print("us", Ms)
for name, s in ss.items():
    print(name, [round(bench(s, M, 100 if M < 100 else 20)) for M in Ms])
