"""exporter.external_data: the one size rule for ONNX external data, and the tensor walk
(public protobuf fields) that finds every tensor a graph may keep outside the .onnx."""
from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import helper, numpy_helper  # noqa: E402

from eagle_deploy.exporter.external_data import HEADROOM, TWO_GIB, graph_tensors, use_external_data  # noqa: E402


def test_size_rule():
    limit = TWO_GIB - HEADROOM
    assert use_external_data("always", 10) and not use_external_data("auto", 10) and not use_external_data("never", 10)
    assert use_external_data("auto", limit + 1) and not use_external_data("auto", limit)
    with pytest.raises(ValueError, match="target.onnx: 2.0 GiB of weights need external data"):
        use_external_data("never", TWO_GIB, "target.onnx")
    with pytest.raises(ValueError, match="sometimes"):
        use_external_data("sometimes", 1)


def _tensor(name, value):
    return numpy_helper.from_array(np.full(2, value, np.float32), name)


def test_graph_tensors_finds_initializers_attributes_and_subgraphs():
    body = helper.make_graph([helper.make_node("Constant", [], ["k"], value=_tensor("sub_const", 3))], "body", [],
                             [helper.make_tensor_value_info("k", onnx.TensorProto.FLOAT, [2])],
                             initializer=[_tensor("sub_init", 4)])
    nodes = [helper.make_node("Constant", [], ["c"], value=_tensor("const", 1)),
             helper.make_node("If", ["cond"], ["out"], then_branch=body, else_branch=body)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("cond", onnx.TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("out", onnx.TensorProto.FLOAT, [2])],
                              initializer=[_tensor("init", 0)])
    model = helper.make_model(graph)
    names = [t.name for t in graph_tensors(model)]
    assert sorted(names) == sorted(["init", "const", "sub_init", "sub_const", "sub_init", "sub_const"])
