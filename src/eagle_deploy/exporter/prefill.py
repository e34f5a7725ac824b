"""The int8 prefill graph of an int4 export (`eagle-export --quant int4 --prefill-weights int8`).

    prefill_graph_wanted   ExportOptions' --prefill-weights checked against --quant
    build_prefill_graph    the fp32 target.onnx of an export folder -> prefill.onnx beside it
                           (GraphEntry), written one weight at a time
    per_token_streamed     the graph rewrite itself: every constant-weight MatMul -> int8 x int8
    prefill_weights        the weights it multiplies with, read back (eagle-validate's reference)

On a CPU an int4 graph (MatMulNBits) runs a prompt's forward at fp32 speed, while int8 weights
times int8 activations (MatMulInteger) run it about twice as fast (docs/decisions.md,
'2026-12-06: an int8 prefill graph for int4 exports'). The prefill graph is the target graph with
every constant-weight MatMul but RoPE's exact ones (quantize.exact_matmuls) computed as

    a_scale = max(|x| over the row, 1e-12) / 127             one scale per token (row)
    x_q     = clip(round(x / a_scale) + 128, 0, 255)         uint8, zero point 128
    y       = float(MatMulInteger(x_q, w_q, 128)) * a_scale * w_scale

with w_q = clip(round(W / w_scale), -127, 127) int8 and w_scale = max(|W| over the column) / 127
(one scale per output column). Every step is per row or exact (int32 accumulation), so a row's
result depends on that row alone: a prompt run in chunks gives the same bits as one forward,
which the runtime's chunked prefill and prefix cache need (tests/exporter/test_prefill_graph.py).
Per-tensor activation scales (onnxruntime's DynamicQuantizeMatMul) would be faster but make each
row depend on the others. The LM head is quantised too (the graph computes logits for the rows
`logits_indices` names: one row in a prefill). Inputs, outputs, the fused attention and the norms
are the target graph's (contract onnx_io, "Prefill graph"); share.py then points its token
embedding at shared.data, so the folder holds it once.

Imports onnx and numpy inside functions (eagle-export --help loads neither).
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Sequence

from eagle_deploy.contract.manifest import GraphEntry, QuantRecord
from eagle_deploy.contract.onnx_io import PREFILL_FILE

from .external_data import TensorFile, data_file_of, place_graph

PREFILL_WEIGHTS = ("none", "int8")  # eagle-export --prefill-weights
PER_TOKEN = "per_token"  # QuantRecord.method of the prefill graph: MatMulInteger, per-token int8 activations
_P = "prefill_int8/"  # prefix of every tensor and node name the rewrite adds
_CONSTANTS = {"c127": 127.0, "c128": 128.0, "eps": 1e-12, "lo": 0.0, "hi": 255.0}


def prefill_graph_wanted(prefill_weights: str, quant: str | None) -> bool:
    """Whether the export gets a prefill graph: `prefill_weights` "int8" (True) or "none"
    (False). ValueError for another value, or for "int8" without `quant` "int4": the graph is a
    second, int8 copy of the target's weights that pays only beside an int4 target graph (an
    fp32 or int8 target prefills from weights as precise, or more)."""
    if prefill_weights not in PREFILL_WEIGHTS:
        raise ValueError(f"--prefill-weights {prefill_weights} is not one of {', '.join(PREFILL_WEIGHTS)}")
    if prefill_weights == "int8" and quant != "int4":
        given = f"--quant {quant}" if quant else "no --quant"
        raise ValueError(f"--prefill-weights int8 needs --quant int4 (found {given}): it adds an int8 copy of the "
                         "target's weights for prompt forwards, which pays only beside an int4 target graph")
    return prefill_weights == "int8"


def _quantised_weight(weight):
    """(int8 weights [K, N], float32 scales [N]) of a float32 MatMul weight [K, N]: one
    symmetric scale per output column, round to nearest, clamped to [-127, 127]."""
    import numpy as np

    w = np.asarray(weight, np.float32)
    scale = np.maximum(np.abs(w).max(axis=0), np.float32(1e-12)) / np.float32(127.0)
    q = np.clip(np.round(w / scale), -127, 127).astype(np.int8)
    return q, scale.astype(np.float32)


def _row_quantiser(x: str, p: str) -> list:
    """Nodes quantising activation `x` [..., K] per row: outputs `p`q (uint8, zero point 128)
    and `p`scale ([..., 1] float32)."""
    from onnx import TensorProto, helper

    c = {k: _P + k for k in _CONSTANTS}
    steps = [("Abs", [x], "abs", {}), ("ReduceMax", [p + "abs"], "max", {"axes": [-1], "keepdims": 1}),
             ("Max", [p + "max", c["eps"]], "max_eps", {}), ("Div", [p + "max_eps", c["c127"]], "scale", {}),
             ("Div", [x, p + "scale"], "scaled", {}), ("Round", [p + "scaled"], "rounded", {}),
             ("Add", [p + "rounded", c["c128"]], "shifted", {}),
             ("Clip", [p + "shifted", c["lo"], c["hi"]], "clipped", {}),
             ("Cast", [p + "clipped"], "q", {"to": TensorProto.UINT8})]
    return [helper.make_node(op, inputs, [p + out], name=p + out, **attrs) for op, inputs, out, attrs in steps]


def per_token_streamed(model, folder: Path, out, exclude: Sequence[str]) -> int:
    """Rewrite `model` (its tensors not loaded; external data in `folder`) in place: every
    MatMul with a constant 2-D weight except `exclude` becomes per-token int8 activations x
    per-column int8 weights (module doc), its int8 weights and scales written to `out`
    (external_data.TensorFile) one weight at a time; every other initializer the graph still
    reads is copied there. One quantiser per activation tensor (the q / k / v and gate / up
    projections of a layer share theirs). Returns the MatMuls rewritten. Raises ValueError for a
    constant weight that is not 2-D."""
    import numpy as np
    from onnx import TensorProto, helper

    from .external_data import array_of
    from .quantize import replace_nodes

    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    skip = set(exclude)
    nodes, new_inits, quantisers, weights, n = [], [], {}, {}, 0
    for node in graph.node:
        if node.op_type != "MatMul" or node.input[1] not in inits or node.name in skip:
            nodes.append(node)
            continue
        x, w, y = node.input[0], node.input[1], node.output[0]
        if len(inits[w].dims) != 2:
            raise ValueError(f"MatMul {node.name}: weight {w} has shape {list(inits[w].dims)}, expected [K, N]")
        if x not in quantisers:
            quantisers[x] = f"{_P}x{len(quantisers)}/"
            nodes += _row_quantiser(x, quantisers[x])
        if w not in weights:
            q, scale = _quantised_weight(array_of(inits[w], folder))
            weights[w] = (f"{_P}w{len(weights)}/q", f"{_P}w{len(weights)}/scale")
            new_inits.append(out.tensor(weights[w][0], q.tobytes(), TensorProto.INT8, q.shape))
            new_inits.append(out.tensor(weights[w][1], scale.tobytes(), TensorProto.FLOAT, scale.shape))
            del q, scale
        p, (wq, ws) = f"{_P}mm{n}/", weights[w]
        nodes += [helper.make_node("MatMulInteger", [quantisers[x] + "q", wq, _P + "zero_point"], [p + "int32"],
                                   name=p + "MatMulInteger"),
                  helper.make_node("Cast", [p + "int32"], [p + "float"], name=p + "Cast", to=TensorProto.FLOAT),
                  helper.make_node("Mul", [p + "float", quantisers[x] + "scale"], [p + "row"], name=p + "row"),
                  helper.make_node("Mul", [p + "row", ws], [y], name=p + "column")]
        n += 1
    consts = [out.tensor(_P + k, np.float32(v).tobytes(), TensorProto.FLOAT, ()) for k, v in _CONSTANTS.items()]
    consts.append(out.tensor(_P + "zero_point", np.uint8(128).tobytes(), TensorProto.UINT8, ()))
    replace_nodes(graph, nodes, new_inits + consts, set(weights), out, folder)
    return n


def build_prefill_graph(folder: Path, target: GraphEntry, external_data: str = "auto") -> GraphEntry:
    """Write `folder`/prefill.onnx (+ its .data as `external_data` decides) from the fp32,
    not yet quantised target graph `target` of that export folder (module doc); target.onnx is
    left as it is. Returns the prefill graph's GraphEntry: the target's, with path, quant "int8"
    and a QuantRecord (method PER_TOKEN) set, sha256 None (the manifest's file records hash it).
    Raises ValueError when `target` is quantised already or not fp32."""
    import onnx

    from .quantize import exact_matmuls

    if target.quant or target.dtype != "float32":
        raise ValueError(f"the prefill graph is built from the fp32 target graph before quantisation; {target.path} "
                         f"is {target.quant or target.dtype}")
    folder = Path(folder)
    model = onnx.load(str(folder / target.path), load_external_data=False)  # weights read one at a time
    exact = exact_matmuls(model, folder)
    path = folder / PREFILL_FILE
    with tempfile.TemporaryDirectory(dir=folder) as scratch:
        with TensorFile(Path(scratch) / data_file_of(path)) as out:
            n = per_token_streamed(model, folder, out, exact)
        place_graph(model, path, Path(scratch), external_data)
    info = QuantRecord(kind="int8", method=PER_TOKEN, tool="eagle_deploy.exporter.prefill", quantised_matmuls=n,
                       batch_invariant=False, weights="int8 per output column, symmetric",
                       activations="int8 per token (row), zero point 128")
    return target.replace(path=PREFILL_FILE, quant="int8", quant_info=info, sha256=None)


def prefill_weights(model, folder: Path | None = None) -> list[tuple]:
    """[(node name, W [N, K] float32, step [N, K] float32)] for every MatMulInteger the rewrite
    made (per_token_streamed), as quantize.dequantised_weights gives them for MatMulNBits: the
    weight the node multiplies with, w_q * w_scale transposed (the node computes x @ W.T), and
    its quantisation step (the column's scale). `model` may be loaded without its external
    data (read from `folder`). ValueError for a MatMulInteger this module did not write."""
    import numpy as np

    from .external_data import array_of

    inits = {t.name: t for t in model.graph.initializer}
    column = {n.name: n for n in model.graph.node if n.op_type == "Mul" and n.name.startswith(_P)}
    out = []
    for node in model.graph.node:
        if node.op_type != "MatMulInteger":
            continue
        scale_node = column.get(node.name.removesuffix("MatMulInteger") + "column")
        if not node.name.startswith(_P) or scale_node is None:
            raise ValueError(f"MatMulInteger {node.name} is not the prefill graph's (exporter/prefill.py)")
        q = array_of(inits[node.input[1]], folder).astype(np.float32)
        scale = array_of(inits[scale_node.input[1]], folder).astype(np.float32)
        out.append((node.name, np.ascontiguousarray((q * scale).T), np.repeat(scale[:, None], q.shape[0], axis=1)))
    return out
