"""A graph traced with its weights as graph inputs, then given its weights one tensor at a
time, so exporting a model never holds the model.

    onnx_with_weight_inputs   torch module + contract -> ModelProto whose every parameter is a
                              graph input named after it (traced on stand-in values that take
                              no memory: one zero broadcast to the parameter's shape)
    fill_weights              that ModelProto + a reader (parameter -> tensor) -> the same
                              graph with initializers: the weight-only nodes the TorchScript
                              exporter would have constant-folded (the transposes of every
                              linear layer's weight, the fused graph's [W_q; W_k; W_v] concat)
                              computed per tensor with torch and written to a TensorFile

The result equals what `torch.onnx.export` with the real weights and constant folding makes
(the same nodes and the same weight bytes; tests/exporter/test_streamed.py checks both and the
outputs, bit for bit), while the process holds one weight tensor (and one fold of it) at a
time. onnxruntime-genai's model builder and TensorRT-LLM's checkpoint converters bound memory
the same way, layer by layer from memory-mapped weights; tracing once on stand-ins keeps the
graph this project's (exporter/target.py) instead of a second, hand-built one.
"""
from __future__ import annotations

import tempfile
import warnings
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from .external_data import TensorFile

# the ops on weights alone that the TorchScript exporter folds in these graphs; anything else
# on weights alone is refused (it would need torch's folding semantics)
FOLDED_OPS = ("Transpose", "Concat", "Identity")


def _onnx_type(dtype: torch.dtype) -> int:
    import onnx

    return {torch.float32: onnx.TensorProto.FLOAT, torch.float16: onnx.TensorProto.FLOAT16,
            torch.bfloat16: onnx.TensorProto.BFLOAT16, torch.int64: onnx.TensorProto.INT64,
            torch.int32: onnx.TensorProto.INT32, torch.bool: onnx.TensorProto.BOOL}[dtype]


def raw_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of `t` in C order (any dtype, bfloat16 included; little-endian hosts)."""
    return memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def param_slots(model: nn.Module) -> dict[int, list[tuple[nn.Module, str, str]]]:
    """id(parameter) -> [(module, attribute, qualified name)] for every place it is registered
    (tied weights appear more than once)."""
    slots: dict[int, list] = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for attr, p in mod._parameters.items():
            if p is not None:
                slots.setdefault(id(p), []).append((mod, attr, f"{mod_name}.{attr}" if mod_name else attr))
    return slots


class _WeightsAsInputs(nn.Module):
    """`inner` with its parameters replaced, for one call, by trailing forward arguments (in
    the order of `params`), so the tracer records them as graph inputs instead of constants."""

    def __init__(self, inner: nn.Module, params: list[nn.Parameter], n_inputs: int):
        super().__init__()
        self.inner, self.n_inputs = inner, n_inputs
        self._params = params
        slots = param_slots(inner)
        self._slots = [[(mod, attr) for mod, attr, _ in slots[id(p)]] for p in params]

    def forward(self, *args):
        try:
            for slots, value in zip(self._slots, args[self.n_inputs:]):
                for mod, attr in slots:
                    mod._parameters[attr] = value
            return self.inner(*args[:self.n_inputs])
        finally:
            for slots, p in zip(self._slots, self._params):
                for mod, attr in slots:
                    mod._parameters[attr] = p


def onnx_with_weight_inputs(module: nn.Module, args: tuple, input_names: list[str], output_names: list[str],
                            dynamic_axes: dict, opset: int) -> tuple[object, dict[str, nn.Parameter]]:
    """(ModelProto, {graph input name: parameter}) for `module` traced on `args` with the
    TorchScript exporter (constant folding on: the non-weight constants, RoPE tables among
    them, fold as they always did). Parameters may be on the meta device: the trace runs on
    stand-ins `torch.zeros((), dtype).expand(shape)` (no memory per parameter)."""
    import onnx

    params = dict(module.named_parameters())  # one entry per parameter object (tied ones once)
    clash = set(params) & set(input_names)
    if clash:
        raise ValueError(f"parameter names clash with graph inputs: {sorted(clash)}")
    stand_ins = [torch.zeros((), dtype=p.dtype).expand(p.shape) for p in params.values()]
    wrapper = _WeightsAsInputs(module, list(params.values()), len(args))
    with tempfile.TemporaryDirectory() as scratch:
        raw = Path(scratch) / "graph.onnx"
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(wrapper, (*args, *stand_ins), str(raw), input_names=[*input_names, *params],
                              output_names=output_names, dynamic_axes=dynamic_axes, opset_version=opset,
                              do_constant_folding=True, dynamo=False, custom_opsets={"com.microsoft": 1})
        model = onnx.load(str(raw))
    return model, params


def fill_weights(model, params: dict[str, nn.Parameter], read: Callable[[nn.Parameter], torch.Tensor],
                 out: TensorFile, last_dim: int | None = None) -> None:
    """Turn the weight inputs of `model` (onnx_with_weight_inputs) into initializers written to
    `out`, folding the weight-only FOLDED_OPS nodes, one final tensor at a time. `read(param)`
    returns the parameter's value in the graph's dtype. Tensors computed from a parameter with
    a dimension of `last_dim` (the vocabulary: the embedding and LM head, which sharing may move
    to shared.data) are written last, so removing them from the file only shortens it. Raises
    ValueError for a weight-only node of another kind."""
    from onnx import helper

    graph = model.graph
    producer = {o: n for n in graph.node for o in n.output}
    sources = {name: {name} for name in params}  # value computed from weights alone -> those parameters
    derived = sources.keys()
    folded = []
    for node in graph.node:
        if node.input and all(i in derived for i in node.input):
            if node.op_type not in FOLDED_OPS:
                raise ValueError(f"a {node.op_type} node ({node.name}) computes from weights alone; "
                                 f"only {', '.join(FOLDED_OPS)} are folded")
            folded.append(node)
            for o in node.output:
                sources[o] = set().union(*(sources[i] for i in node.input))
    folded_ids = {id(n) for n in folded}
    finals: list[str] = []  # weight values read by the graph proper, in order of first use
    for node in graph.node:
        if id(node) not in folded_ids:
            finals += [i for i in node.input if i in derived and i not in finals]
    finals += [o.name for o in graph.output if o.name in derived and o.name not in finals]
    if last_dim:
        vocab_sized = {n for n in finals if any(last_dim in params[p].shape for p in sources[n])}
        finals = [n for n in finals if n not in vocab_sized] + [n for n in finals if n in vocab_sized]

    def value(name: str) -> torch.Tensor:
        if name in params:
            return read(params[name])
        node = producer[name]
        xs = [value(i) for i in node.input]
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "Transpose":
            return xs[0].permute(attrs.get("perm", list(range(xs[0].dim()))[::-1]))
        if node.op_type == "Concat":
            return torch.cat(xs, dim=attrs["axis"])
        return xs[0]  # Identity

    inits = []
    for name in finals:
        t = value(name).contiguous()
        inits.append(out.tensor(name, raw_bytes(t), _onnx_type(t.dtype), t.shape))
        del t
    kept = [n for n in graph.node if id(n) not in folded_ids]
    del graph.node[:]
    graph.node.extend(kept)
    inputs = [i for i in graph.input if i.name not in params]
    del graph.input[:]
    graph.input.extend(inputs)
    info = [v for v in graph.value_info if v.name not in derived]
    del graph.value_info[:]
    graph.value_info.extend(info)
    graph.initializer.extend(inits)
