"""The 2026-12-06 prefill measurements behind docs/decisions.md ("chunked prefill in the Decoder"),
three scripts run from the repository root with the repository's .venv:
  python docs/results/2026-12-06-prefill-chunk.py time ENGINES 740     # whole-graph prefill by chunk size (ms)
  python docs/results/2026-12-06-prefill-chunk.py bits ENGINES         # chunked == one forward, bit for bit
  python docs/results/2026-12-06-prefill-chunk.py gqa 740 [plain]      # one GroupQueryAttention node by chunk
"""
import os
import sys


def timing():
    import sys, numpy as np
    from pathlib import Path
    from eagle_deploy.contract.manifest import Manifest
    from eagle_deploy.runtime.backends import load_backend
    from eagle_deploy.runtime.backends.base import StepInputs
    from eagle_deploy.runtime.drafter import causal_mask
    from eagle_deploy.runtime.planner import fastest_of_rounds
    eng = Path(sys.argv[2]); m = Manifest.load(eng)
    P = int(sys.argv[3])
    rng = np.random.default_rng(0)
    t = load_backend('ort', eng, m, 'target', 2)
    kv = t.allocate_kv(P + 8)
    ids = rng.integers(0, m.dims.vocab, (1, P))
    def pre(chunk):
        steps = []
        for p in range(0, P, chunk):
            S = min(chunk, P - p)
            steps.append((StepInputs(ids[:, p:p + S], np.arange(p, p + S)[None], causal_mask(p, S), np.array([[S - 1]])), p))
        return lambda: [t.run(i, kv, p) for i, p in steps]
    cells = {c: pre(c) for c in (P, 512, 384, 256, 192, 128)}
    s = fastest_of_rounds(cells, 3)
    print(eng.name, P, {c: round(v * 1e3) for c, v in s.items()})


def bits():
    import sys, numpy as np
    from pathlib import Path
    from eagle_deploy.contract.manifest import Manifest
    from eagle_deploy.runtime.backends import load_backend
    from eagle_deploy.runtime.backends.base import StepInputs
    from eagle_deploy.runtime.drafter import causal_mask
    eng = Path(sys.argv[2]); m = Manifest.load(eng); P = 740
    t = load_backend('ort', eng, m, 'target', 2)
    ids = np.random.default_rng(0).integers(0, m.dims.vocab, (1, P))
    res = {}
    for chunk in (P, 256):
        kv = t.allocate_kv(P + 8)
        feats = []
        for p in range(0, P, chunk):
            S = min(chunk, P - p)
            out = t.run(StepInputs(ids[:, p:p + S], np.arange(p, p + S)[None], causal_mask(p, S), np.array([[S - 1]])), kv, p)
            feats.append(out.draft_features[0].copy())
        res[chunk] = (out.logits[0, 0].copy(), np.concatenate(feats), [a[:, :, :P].copy() for a in kv.arrays[:4]])
    a, b = res[P], res[256]
    print(eng.name, 'logits max diff', float(np.abs(a[0] - b[0]).max()), 'features', float(np.abs(a[1] - b[1]).max()), 'kv', max(float(np.abs(x - y).max()) for x, y in zip(a[2], b[2])))


def gqa():
    import numpy as np, onnxruntime as ort, time, sys, os
    from onnx import helper, TensorProto as T
    nh, kvh, hd, C = 9, 3, 64, 2048
    def model():
        ins = [helper.make_tensor_value_info('q', T.FLOAT, [1, None, (nh + 2 * kvh) * hd]),
               helper.make_tensor_value_info('pk', T.FLOAT, [1, kvh, C, hd]), helper.make_tensor_value_info('pv', T.FLOAT, [1, kvh, C, hd]),
               helper.make_tensor_value_info('sl', T.INT32, [1]), helper.make_tensor_value_info('tot', T.INT32, []),
               helper.make_tensor_value_info('cos', T.FLOAT, [4096, hd // 2]), helper.make_tensor_value_info('sin', T.FLOAT, [4096, hd // 2]),
               helper.make_tensor_value_info('pos', T.INT64, [1, None]), helper.make_tensor_value_info('bias', T.FLOAT, [1, 1, None, None]),
               helper.make_tensor_value_info('ql', T.INT32, [1])]
        names = ['q', '', '', 'pk', 'pv', 'sl', 'tot', 'cos', 'sin', 'pos', 'bias', '', '', '', '', '', 'ql']
        node = helper.make_node('GroupQueryAttention', names, ['o', 'pko', 'pvo'], domain='com.microsoft', num_heads=nh, kv_num_heads=kvh, do_rotary=1)
        g = helper.make_graph([node], 'g', ins, [helper.make_tensor_value_info('o', T.FLOAT, [1, None, nh * hd])])
        return helper.make_model(g, opset_imports=[helper.make_opsetid('', 17), helper.make_opsetid('com.microsoft', 1)])
    rng = np.random.default_rng(0)
    so = ort.SessionOptions(); so.intra_op_num_threads = 2; so.log_severity_level = 3
    s = ort.InferenceSession(model().SerializeToString(), so, providers=['CPUExecutionProvider'])
    cos = rng.standard_normal((4096, hd // 2)).astype(np.float32); sin = cos.copy()
    pk = np.zeros((1, kvh, C, hd), np.float32); pv = pk.copy()
    def call(S, past):
        f = {'q': rng.standard_normal((1, S, (nh + 2 * kvh) * hd)).astype(np.float32), 'pk': pk, 'pv': pv, 'sl': np.array([past + S - 1], np.int32),
             'tot': np.array(past + S, np.int32), 'cos': cos, 'sin': sin, 'pos': np.arange(past, past + S)[None], 'bias': np.zeros((1, 1, S, past + S), np.float32), 'ql': np.array([S], np.int32)}
        return lambda: s.run(['o'], f)
    for chunk in (740, 370, 185, 128, 64):
        calls = [call(min(chunk, 740 - p), p) for p in range(0, 740, chunk)]
        for c in calls: c()
        ts = []
        for _ in range(5):
            a = time.perf_counter()
            for c in calls: c()
            ts.append(time.perf_counter() - a)
        print(os.environ.get('ORT_GQA_DISABLE_FLASH_ATTENTION', 'flash'), 'chunk', chunk, round(sorted(ts)[2] * 1e3, 2), 'ms per layer')


if __name__ == "__main__":
    if sys.argv[1] == "gqa" and sys.argv[-1] == "plain":
        os.environ["ORT_GQA_DISABLE_FLASH_ATTENTION"] = "1"  # read when the session is created
    {"time": timing, "bits": bits, "gqa": gqa}[sys.argv[1]]()
