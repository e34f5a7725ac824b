"""ONNX external data, decided and read in one place: when a graph's weights go to a
`<file>.data` beside it (`use_external_data`: the exporter and the quantiser), and every
tensor a graph holds (`graph_tensors`: which external files a graph needs, trt_build).
Imports onnx only inside `graph_tensors`."""
from __future__ import annotations

from typing import Iterator

TWO_GIB = 2 * 1024**3  # protobuf's limit on one serialized message (an .onnx file without external data)
HEADROOM = 64 << 20  # bytes left under the limit for the graph itself (nodes, names, shapes)
MODES = ("auto", "always", "never")


def use_external_data(mode: str, weight_bytes: int, what: str = "the graph") -> bool:
    """Whether a graph with `weight_bytes` bytes of weights is saved with external data:
    mode "always": yes; "auto": when the weights exceed 2 GiB - 64 MiB; "never": no. Raises
    ValueError on an unknown mode, and for "never" when the weights cannot fit inline
    (`what` names the graph in that message)."""
    if mode not in MODES:
        raise ValueError(f"external data mode {mode!r} is not one of {', '.join(MODES)}")
    too_big = weight_bytes > TWO_GIB - HEADROOM
    if mode == "never" and too_big:
        raise ValueError(f"{what}: {weight_bytes / 2**30:.1f} GiB of weights need external data (protobuf limit 2 GiB)")
    return mode == "always" or (mode == "auto" and too_big)


def graph_tensors(model) -> Iterator:
    """Every TensorProto of an onnx ModelProto: initializers, sparse initializers (values and
    indices) and constant tensors in node attributes, in subgraphs too (If / Loop / Scan
    bodies). Public protobuf fields only."""
    import onnx

    def of_graph(graph) -> Iterator:
        yield from graph.initializer
        for sparse in graph.sparse_initializer:
            yield sparse.values
            yield sparse.indices
        for node in graph.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.TENSOR:
                    yield attr.t
                elif attr.type == onnx.AttributeProto.TENSORS:
                    yield from attr.tensors
                elif attr.type == onnx.AttributeProto.SPARSE_TENSOR:
                    yield attr.sparse_tensor.values
                    yield attr.sparse_tensor.indices
                elif attr.type == onnx.AttributeProto.GRAPH:
                    yield from of_graph(attr.g)
                elif attr.type == onnx.AttributeProto.GRAPHS:
                    for sub in attr.graphs:
                        yield from of_graph(sub)

    yield from of_graph(model.graph)
