"""Weight quantisation of an exported graph for CPU, with onnxruntime's own tools.

    int4_model_from_onnx   fp32 ModelProto -> MatMulNBits (4-bit, blockwise) ModelProto
    int8_model_from_file   fp32 graph file -> dynamic int8 (MatMulInteger) ModelProto
    quantize_graph         export folder + GraphEntry -> the same file quantised in place,
                           entry.quant and entry.extra["quant"] filled in

Only MatMuls with a constant weight are quantised: every linear layer and the LM head (a
MatMul on the transposed, constant-folded embedding when embeddings are tied). Attention
matmuls (activation x activation), norms and the embedding Gather stay fp32. Defaults below
were chosen by measurement on SmolLM2-135M, 2 threads (see the quantisation report in the
issue): int4 block 32 with accuracy_level 4 (int8 activations in the kernel) and int8
per-channel dynamic quantisation.
"""
from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from pathlib import Path

from eagle_deploy.runtime.manifest import GraphEntry

TWO_GIB = 2 * 1024**3
QUANT_KINDS = ("int4", "int8")
DEFAULTS = {
    "int4": {"block_size": 32, "accuracy_level": 4, "symmetric": True},
    "int8": {"per_channel": True, "reduce_range": False},
}
QUANT_OPS = {"int4": ("MatMulNBits",), "int8": ("MatMulInteger", "DynamicQuantizeMatMul", "MatMulIntegerToFloat")}


def weight_bytes(model) -> int:
    """Bytes of initializer data held by `model` (inline or already loaded external data)."""
    return sum(len(t.raw_data) or t.ByteSize() for t in model.graph.initializer)


def constant_matmuls(model) -> list[str]:
    """Names of the MatMul nodes whose second input is an initializer (the quantisable ones)."""
    inits = {t.name for t in model.graph.initializer}
    return [n.name for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in inits]


def quantised_nodes(model, kind: str) -> list:
    """The quantised matmul nodes of a graph quantised as `kind`."""
    return [n for n in model.graph.node if n.op_type in QUANT_OPS[kind]]


def int4_model_from_onnx(model, block_size: int = 32, accuracy_level: int = 4, symmetric: bool = True):
    """Every constant-weight MatMul -> MatMulNBits (4-bit, `block_size` rows per scale along
    K; accuracy_level 4 = int8 activations inside the kernel, 0 = fp32)."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quant = MatMulNBitsQuantizer(model, bits=4, block_size=block_size, is_symmetric=symmetric,
                                 accuracy_level=accuracy_level, op_types_to_quantize=("MatMul",))
    quant.process()
    return quant.model.model


def int8_model_from_file(path: Path, per_channel: bool = True, reduce_range: bool = False):
    """Dynamic int8 quantisation (weights int8, activations quantised per call) of every
    constant-weight MatMul of the graph at `path`."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    path = Path(path)
    external = (path.parent / (path.name + ".data")).exists()
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        out = Path(scratch) / path.name
        quantize_dynamic(path, out, op_types_to_quantize=["MatMul"], per_channel=per_channel,
                         reduce_range=reduce_range, weight_type=QuantType.QInt8, use_external_data_format=external,
                         extra_options={"MatMulConstBOnly": True})
        return onnx.load(str(out), load_external_data=True)


@contextlib.contextmanager
def quiet_logging(level: int = logging.WARNING):
    """onnxruntime's quantisers log every skipped node at INFO on the root logger."""
    root = logging.getLogger()
    old = root.level
    root.setLevel(max(old, level))
    try:
        yield
    finally:
        root.setLevel(old)


def save_graph_in_place(model, path: Path, external_data: str = "auto") -> None:
    """Write `model` over `path` through a temporary file (external data `<file>.data` when
    the weights exceed 2 GiB or `external_data` == "always"), then rename into place."""
    import onnx

    path = Path(path)
    external = external_data == "always" or (external_data == "auto" and weight_bytes(model) > TWO_GIB - (64 << 20))
    data = path.parent / (path.name + ".data")
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        tmp = Path(scratch) / path.name
        if external:
            onnx.save_model(model, str(tmp), save_as_external_data=True, all_tensors_to_one_file=True,
                            location=data.name, size_threshold=1024)
            os.replace(Path(scratch) / data.name, data)
        else:
            onnx.save_model(model, str(tmp))
            data.unlink(missing_ok=True)
        os.replace(tmp, path)


def quantize_graph(folder: Path, entry: GraphEntry, kind: str, external_data: str = "auto", **options) -> GraphEntry:
    """Quantise graph `entry` of export `folder` in place as `kind` ("int4" | "int8").

    options override DEFAULTS[kind] (int4: block_size, accuracy_level, symmetric; int8:
    per_channel, reduce_range). Sets entry.quant and entry.extra["quant"]; the caller
    recomputes entry.sha256 after. Raises ValueError on an unknown kind or option, and
    RuntimeError when the LM head (or any constant-weight MatMul) was left unquantised."""
    import onnx

    if kind not in QUANT_KINDS:
        raise ValueError(f"--quant {kind} is not one of {', '.join(QUANT_KINDS)}")
    unknown = set(options) - set(DEFAULTS[kind])
    if unknown:
        raise ValueError(f"unknown {kind} option(s): {', '.join(sorted(unknown))}")
    if entry.dtype != "float32":
        raise ValueError(f"--quant needs an fp32 export (this graph is {entry.dtype})")
    settings = {**DEFAULTS[kind], **options}
    path = Path(folder) / entry.path
    model = onnx.load(str(path), load_external_data=True)
    todo = constant_matmuls(model)
    with quiet_logging():
        if kind == "int4":
            quantised = int4_model_from_onnx(model, **settings)
        else:
            del model
            quantised = int8_model_from_file(path, **settings)
    left = set(todo) & set(constant_matmuls(quantised))
    if left:
        raise RuntimeError(f"{entry.path}: {len(left)} weight MatMul(s) were not quantised, e.g. {sorted(left)[:3]}")
    n_quant = len(quantised_nodes(quantised, kind))
    save_graph_in_place(quantised, path, external_data)
    entry.quant = kind
    entry.extra["quant"] = {"kind": kind, **settings, "tool": "onnxruntime.quantization", "quantised_matmuls": n_quant}
    return entry
