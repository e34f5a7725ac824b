"""Weight quantisation of an exported graph for CPU, with onnxruntime's own tools.

    nbits_model_from_onnx          fp32 ModelProto -> MatMulNBits (4- or 8-bit, blockwise)
    nbits_streamed                 the same, one weight at a time (what quantize_graph runs:
                                   memory is one weight, not the graph)
    dynamic_int8_model_from_file   fp32 graph file -> dynamic int8 (MatMulInteger)
    quantize_graph                 export folder + GraphEntry -> that graph quantised in place,
                                   a copy of the entry with quant and quant_info filled in

Only MatMuls with a constant weight are quantised: every linear layer and the LM head (a
MatMul on the transposed, constant-folded embedding when embeddings are tied). Attention
matmuls (activation x activation), norms and the embedding Gather stay fp32.

Defaults: int4 and int8 both MatMulNBits, block 32, symmetric, accuracy_level 4 (int8
activations inside the kernel). Larger blocks were a little faster and agreed less with fp32;
accuracy_level 0 (fp32 activations) is far slower beyond a few rows; quantize_dynamic int8
(method="dynamic") has the flattest cost curve but agrees least, because it scales the
activations of all rows of a forward together.

Batch invariance (issue 10; tests/exporter/test_batch_invariance.py). The default MatMulNBits
(block 32, accuracy_level 4) gives a row the same bits alone and inside any batch (threads 1
and 2, every SmolLM2 shape, LM head included); accuracy_level 0 and block 128 do not for a
single row, though any two or more rows agree. The fused graph's fp32 part is not invariant in
two places: GroupQueryAttention at S = 1 (its probs x V is a one-row sgemm, which MLAS runs
through a separate M = 1 kernel without FMA) and a tree row with masked siblings inside its
attention row (another softmax summation order); both are last-bit differences. fp32 graphs
keep them that small, but int8 activation rounding in every later matmul turns them into
different logits, so greedy EAGLE and vanilla output part on quantised graphs. Quantising
differently (fp32 activations, weights dequantised at load) restores identity at a large cost
in speed, so the defaults stay: they are the row-exact settings, and the exact fix is in the
runtime (tests/runtime/test_exact_greedy_recipe.py): run one-token target forwards as two
rows, and lay verification rows out depth-first with acceptance ending at the first node not
at row index == depth. Quantised weights are unchanged by this, so top-1 agreement with fp32
is too. Every figure: docs/decisions.md, 'Quantisation defaults and batch invariance, measured'.
"""
from __future__ import annotations

import contextlib
import logging
import tempfile
from pathlib import Path
from typing import Sequence

from eagle_deploy.contract.manifest import QUANT_KINDS, GraphEntry, QuantRecord

from .external_data import TensorFile, data_file_of, place_graph

MAX_HEAD_DIM = 1024  # exact_matmuls looks only at square constants up to this size
NBITS_OPTIONS = {"block_size": 32, "accuracy_level": 4, "symmetric": True}
DYNAMIC_OPTIONS = {"per_channel": True, "reduce_range": False}
DEFAULTS = {
    "int4": {"method": "nbits", **NBITS_OPTIONS},
    "int8": {"method": "nbits", **NBITS_OPTIONS},
}
QUANT_OPS = ("MatMulNBits", "MatMulInteger", "DynamicQuantizeMatMul", "MatMulIntegerToFloat")


def constant_matmuls(model, exact: Sequence[str] | None = None) -> list[str]:
    """Names of the MatMul nodes whose second input is an initializer (the quantisable ones),
    except the exact ones (`exact`, default exact_matmuls(model))."""
    inits = {t.name for t in model.graph.initializer}
    skip = set(exact_matmuls(model) if exact is None else exact)
    return [n.name for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in inits and n.name not in skip]


def exact_matmuls(model, folder: Path | None = None) -> list[str]:
    """MatMul nodes whose constant second input is a signed permutation matrix (entries 0 and
    +-1, one non-zero per row and column: RoPE's rotate-half). They are exact in fp32 and must
    stay so; quantising them would perturb every position's rotation. `folder`: where the
    graph's external data is, when its tensors are not loaded."""
    import numpy as np

    from .external_data import array_of

    consts = {t.name: t for t in model.graph.initializer}
    consts.update({n.output[0]: a.t for n in model.graph.node if n.op_type == "Constant"
                   for a in n.attribute if a.name == "value"})
    names = []
    for n in model.graph.node:
        t = consts.get(n.input[1]) if n.op_type == "MatMul" and len(n.input) > 1 else None
        # a head-dim-sized square; weight matrices of large models are square too, and reading
        # them all would cost seconds per layer
        if t is None or len(t.dims) != 2 or t.dims[0] != t.dims[1] or t.dims[0] > MAX_HEAD_DIM:
            continue
        w = array_of(t, folder)
        if np.isin(w, (-1, 0, 1)).all() and (np.abs(w).sum(0) == 1).all() and (np.abs(w).sum(1) == 1).all():
            names.append(n.name)
    return names


def quantised_nodes(model) -> list:
    """The quantised matmul nodes of a graph."""
    return [n for n in model.graph.node if n.op_type in QUANT_OPS]


def nbits_model_from_onnx(model, bits: int = 4, block_size: int = 32, accuracy_level: int = 4, symmetric: bool = True,
                          exclude: Sequence[str] | None = None):
    """Every constant-weight MatMul except `exclude` (default exact_matmuls(model)) ->
    MatMulNBits (`bits`-bit weights, one scale per `block_size` rows along K;
    accuracy_level 4 = int8 activations in the kernel, 0 = fp32)."""
    try:
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    except ModuleNotFoundError as err:  # it imports onnx_ir, which onnxruntime does not declare
        raise ImportError(f"--quant needs onnxruntime's quantisation tools and their dependency {err.name}: "
                          f"pip install onnx-ir ml_dtypes") from err

    quant = MatMulNBitsQuantizer(model, bits=bits, block_size=block_size, is_symmetric=symmetric,
                                 accuracy_level=accuracy_level, op_types_to_quantize=("MatMul",),
                                 nodes_to_exclude=list(exact_matmuls(model) if exclude is None else exclude))
    quant.process()
    return quant.model.model


def dynamic_int8_model_from_file(path: Path, per_channel: bool = True, reduce_range: bool = False,
                                 exclude: Sequence[str] | None = None):
    """Dynamic int8 quantisation (weights int8, activations quantised per call) of every
    constant-weight MatMul of the graph at `path` except `exclude` (default: exact_matmuls of
    the graph, which then is read once more)."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    path = Path(path)
    external = (path.parent / (path.name + ".data")).exists()
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        out = Path(scratch) / path.name
        quantize_dynamic(path, out, op_types_to_quantize=["MatMul"], per_channel=per_channel,
                         nodes_to_exclude=list(exact_matmuls(onnx.load(str(path), load_external_data=True))
                                               if exclude is None else exclude),
                         reduce_range=reduce_range, weight_type=QuantType.QInt8, use_external_data_format=external,
                         extra_options={"MatMulConstBOnly": True})
        return onnx.load(str(out), load_external_data=True)


@contextlib.contextmanager
def quiet_logging(level: int = logging.ERROR):
    """onnxruntime's quantisers log every node they skip (root logger and their own)."""
    loggers = [logging.getLogger(), logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")]
    old = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(max(lg.level, level))
    try:
        yield
    finally:
        for lg, lvl in zip(loggers, old):
            lg.setLevel(lvl)


def batch_invariant(method: str, settings: dict) -> bool:
    """Whether a token's logits are independent, to fp32 rounding, of how its forward is
    batched (alone, or a row of a tree), on the current runtime; recorded in the manifest
    (quant_info.batch_invariant) and driving export's near-tie note. As the module docstring
    says: the fused graph's attention rounds a one-token forward and a tree row with masked
    siblings differently in the last bits; fp32 activations (accuracy_level 0) keep that at
    fp32 rounding (EAGLE greedy == vanilla), while int8 activations (accuracy_level 4, and
    dynamic int8, which also scales all rows together) re-round it in every layer into
    different logits (docs/decisions.md, 'greedy identity of quantised exports; row-exact
    decoding'). The MatMulNBits kernels themselves are row-exact at the defaults (block 32,
    accuracy_level 4: same bits alone and in any batch), and at every setting measured (blocks
    32 / 128, accuracy_level 0 / 4) any two or more rows agree: that makes the runtime recipe
    in tests/runtime/test_exact_greedy_recipe.py exact for them, and once the runtime runs it,
    this flag can become `method == "nbits"`."""
    return method == "nbits" and settings["accuracy_level"] == 0


def save_graph_in_place(model, path: Path, external_data: str = "auto") -> None:
    """Write `model` (its tensors loaded) over `path` through a temporary file (external data
    `<file>.data` as `external_data.use_external_data` decides), then rename into place."""
    from .external_data import save_graph

    save_graph(model, path, Path(path).parent, external_data)


def nbits_streamed(model, folder: Path, out, bits: int, exclude: Sequence[str], **settings) -> int:
    """`nbits_model_from_onnx` one weight at a time: every constant-weight MatMul of `model`
    (its tensors not loaded; external data in `folder`) except `exclude` becomes the node(s)
    and tensors onnxruntime's quantiser makes for it alone (the same bytes: it quantises each
    weight on its own), written to `out` (external_data.TensorFile) as they come; every other
    initializer is copied there. `model` is changed in place; returns the nodes quantised."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from .external_data import array_of, tensor_bytes

    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    skip = set(exclude)
    nodes, new_inits, done, n = [], [], set(), 0
    domains = {o.domain for o in model.opset_import}
    for node in graph.node:
        if node.op_type != "MatMul" or node.input[1] not in inits or node.name in skip:
            nodes.append(node)
            continue
        if node.input[1] in done:
            raise ValueError(f"weight {node.input[1]} feeds two MatMuls; quantise the graph as a whole")
        weight = array_of(inits[node.input[1]], folder)
        one = helper.make_model(helper.make_graph(
            [node], "one", [helper.make_tensor_value_info(node.input[0], TensorProto.FLOAT, None)],
            [helper.make_tensor_value_info(node.output[0], TensorProto.FLOAT, None)],
            initializer=[numpy_helper.from_array(weight, node.input[1])]), opset_imports=model.opset_import)
        del weight
        quantised = nbits_model_from_onnx(one, bits=bits, exclude=[], **settings)
        for q in quantised.graph.node:  # copies: a reference into `quantised` would keep all of it alive
            kept = onnx.NodeProto()
            kept.CopyFrom(q)
            nodes.append(kept)
        for t in quantised.graph.initializer:
            new_inits.append(out.tensor(t.name, tensor_bytes(t, folder), t.data_type, t.dims))
        for o in quantised.opset_import:
            if o.domain not in domains:
                model.opset_import.append(o)
                domains.add(o.domain)
        done.add(node.input[1])
        n += 1
        del quantised, one
    replace_nodes(graph, nodes, new_inits, done, out, folder)
    return n


def replace_nodes(graph, nodes: list, new_inits: list, dropped: set, out, folder: Path) -> None:
    """Give `graph` the nodes `nodes` and, as initializers, the old ones they still read (but
    those named in `dropped`, written again by `out`) followed by `new_inits`."""
    from .external_data import tensor_bytes

    read = {i for node in nodes for i in node.input}
    kept = [out.tensor(t.name, tensor_bytes(t, folder), t.data_type, t.dims)
            for t in graph.initializer if t.name not in dropped and t.name in read]
    del graph.node[:]
    graph.node.extend(nodes)
    del graph.initializer[:]
    graph.initializer.extend(kept + new_inits)


def quantize_graph(folder: Path, entry: GraphEntry, kind: str, external_data: str = "auto", **options) -> GraphEntry:
    """Quantise graph `entry` of export `folder` in place as `kind` ("int4" | "int8").

    options override DEFAULTS[kind]: method "nbits" (MatMulNBits: block_size, accuracy_level,
    symmetric) or, for int8 only, "dynamic" (quantize_dynamic: per_channel, reduce_range).
    Returns a copy of `entry` with quant and quant_info (a QuantRecord) set; the caller
    recomputes its sha256 after. Raises ValueError on an unknown kind or option or a graph
    already quantised, ImportError without onnxruntime's quantisation dependencies, and
    RuntimeError when the LM head (or any constant-weight MatMul) was left unquantised."""
    import onnx

    if kind not in QUANT_KINDS:
        raise ValueError(f"--quant {kind} is not one of {', '.join(QUANT_KINDS)}")
    method = options.pop("method", DEFAULTS[kind]["method"])
    if method not in ("nbits", "dynamic") or (kind, method) == ("int4", "dynamic"):
        raise ValueError(f"{kind}: unknown quantisation method {method!r}")
    allowed = NBITS_OPTIONS if method == "nbits" else DYNAMIC_OPTIONS
    unknown = set(options) - set(allowed)
    if unknown:
        raise ValueError(f"unknown {kind}/{method} option(s): {', '.join(sorted(unknown))}")
    if entry.dtype != "float32":
        raise ValueError(f"--quant needs an fp32 export (this graph is {entry.dtype})")
    if entry.quant:
        raise ValueError(f"{entry.path} is already quantised ({entry.quant})")
    settings = {**allowed, **options}
    folder = Path(folder)
    path = folder / entry.path
    model = onnx.load(str(path), load_external_data=False)  # weights are read one at a time
    exact = exact_matmuls(model, folder)
    todo = constant_matmuls(model, exact)
    with quiet_logging():
        if method == "nbits":  # one weight at a time: memory is one weight, whatever the model
            with tempfile.TemporaryDirectory(dir=folder) as scratch:
                with TensorFile(Path(scratch) / data_file_of(path)) as out:
                    nbits_streamed(model, folder, out, int(kind[3:]), exact, **settings)
                place_graph(model, path, Path(scratch), external_data)
            quantised = model
        else:  # quantize_dynamic works on the whole graph (not the default: small graphs)
            del model
            quantised = dynamic_int8_model_from_file(path, exclude=exact, **settings)
            save_graph_in_place(quantised, path, external_data)
    left = set(todo) & set(constant_matmuls(quantised, exact))
    if left:
        raise RuntimeError(f"{entry.path}: {len(left)} weight MatMul(s) were not quantised, e.g. {sorted(left)[:3]}")
    n_quant = len(quantised_nodes(quantised))
    info = QuantRecord(kind=kind, method=method, tool="onnxruntime.quantization", quantised_matmuls=n_quant,
                       batch_invariant=batch_invariant(method, settings), **settings)
    return entry.replace(quant=kind, quant_info=info)


def dequantised_weights(model, folder: Path | None = None) -> list[tuple]:
    """[(node name, W [N, K] float32, step [N, K] float32)] for every MatMulNBits node: the
    weight exactly as the kernel sees it ((q - zero point) * scale, the node computes A @ W.T)
    and its quantisation step (|scale| per block). `model` may be loaded without its external
    data: those tensors are read from `folder` (external_data.array_of), one at a time. Raises
    ValueError for other quantised ops (dynamic int8 MatMulInteger), whose weights this does not
    read back, and for external data without a folder or a truncated data file."""
    import numpy as np
    from onnx import helper

    from .external_data import array_of

    other = sorted({n.op_type for n in quantised_nodes(model)} - {"MatMulNBits"})
    if other:
        raise ValueError(f"cannot read back the weights of {', '.join(other)} nodes (only MatMulNBits)")
    inits = {t.name: t for t in model.graph.initializer}
    out = []
    for node in model.graph.node:
        if node.op_type != "MatMulNBits":
            continue
        a = {x.name: helper.get_attribute_value(x) for x in node.attribute}
        K, N, bits, block = a["K"], a["N"], a["bits"], a["block_size"]
        blocks = -(-K // block)
        packed = array_of(inits[node.input[1]], folder).astype(np.int32).reshape(N, blocks, -1)
        q = np.stack([packed & 0xF, packed >> 4], -1).reshape(N, blocks, block) if bits == 4 else packed
        scales = array_of(inits[node.input[2]], folder).astype(np.float32).reshape(N, blocks)
        if len(node.input) > 3 and node.input[3]:
            zp = array_of(inits[node.input[3]], folder).astype(np.int32).reshape(N, -1)
            zp = np.stack([zp & 0xF, zp >> 4], -1).reshape(N, -1)[:, :blocks] if bits == 4 else zp[:, :blocks]
        else:
            zp = np.full((N, blocks), 1 << (bits - 1), np.int32)
        w = ((q - zp[:, :, None]).astype(np.float32) * scales[:, :, None]).reshape(N, -1)[:, :K]
        out.append((node.name, np.ascontiguousarray(w), np.repeat(np.abs(scales), block, axis=1)[:, :K]))
    return out


def with_fp32_activations(model):
    """A copy of a MatMulNBits graph with accuracy_level 0 on every such node: the same
    quantised weights, dequantised and multiplied in fp32 (no int8 rounding of activations)."""
    import copy

    model = copy.deepcopy(model)
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            for attr in node.attribute:
                if attr.name == "accuracy_level":
                    attr.i = 0
    return model
