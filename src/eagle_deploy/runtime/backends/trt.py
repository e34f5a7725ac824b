"""TensorRT backend: one serialized engine behind the `Backend` protocol.

Name-based tensor API of TensorRT 10/11 (`set_input_shape`, `set_tensor_address`,
`execute_async_v3`). The runtime owns every device buffer (torch CUDA tensors): KV buffers
are allocated once and written in place (each present output is bound at row `past` of its
buffer; where that row's address is not 256-byte aligned, as TensorRT requires, the new rows
land in an aligned scratch buffer and are copied to row `past` on the same stream: S rows per
layer), token / mask tensors go host -> device through reused staging buffers, and logits,
features and top-k come back to host numpy.

Before any enqueue each call is checked against the engine's optimization profiles: a shape
outside every profile raises `ProfileShapeError` naming the input, its size and the bounds,
and a tree too large for the profiles fails at start-up (`check_tree_fits`).
Every host array is checked against its binding's dtype and cast only where that is exact
(int64 ids handed to an int32 binding: range-checked cast).

One execution context per optimization profile, created on first use; no CUDA graphs
(capture is not done: shapes change every round with the tree size).

The pure functions (`profile_violation`, `select_profile`, `check_tree_fits`, ...) import
neither TensorRT nor torch.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from eagle_deploy.contract import dtypes
from eagle_deploy.contract import onnx_io as c
from eagle_deploy.contract.errors import import_tensorrt
from eagle_deploy.contract.manifest import Dims, GraphEntry
from eagle_deploy.contract.profiles import (  # noqa: F401  (re-exported for callers of the backend)
    Bounds,
    KVDims,
    NamedBounds,
    ProfileShapeError,
    Shape,
    TreeProfileError,
    check_tree_fits,
    draft_kv_capacity,
    profile_order,
    profile_violation,
    select_profile,
    step_shapes,
    tree_calls,
)
from eagle_deploy.contract.tree_config import TreeConfig

from ..kv import KVBuffer
from .base import StepInputs, StepOutputs, outputs_from_named
from .ort_cuda import DeviceBuffers, check_device_kv, coerce_host_array, torch_dtype

# IExecutionContext::setTensorAddress: "The pointer must have at least 256-byte alignment"
# (NvInferRuntime.h, TensorRT 10 and 11).
ADDRESS_ALIGNMENT = 256

# contract dtype name (every one of contract.dtypes.NAMES) -> TensorRT DataType member name
TRT_MEMBERS = {"float32": "FLOAT", "float16": "HALF", "bfloat16": "BF16", "int64": "INT64", "int32": "INT32",
               "int8": "INT8", "uint8": "UINT8", "bool": "BOOL"}
assert set(TRT_MEMBERS) == set(dtypes.NAMES), "TRT_MEMBERS must name every contract dtype"


def engine_dtype_names(trt) -> dict:
    """{trt.DataType member: contract dtype name} for the members this TensorRT has."""
    return {getattr(trt.DataType, m): name for name, m in TRT_MEMBERS.items() if hasattr(trt.DataType, m)}


# ---------------------------------------------------------------------------------------------
# Backend


@dataclass(frozen=True)
class Binding:
    name: str
    is_input: bool
    dtype: str  # contract dtype name of the engine tensor


class TrtBackend:
    """One TensorRT engine (target or draft graph). Build with `from_manifest`; the
    constructor takes an already deserialized engine (tests pass a stand-in)."""

    def __init__(self, engine, graph: GraphEntry, dims: Dims, *, label: str = "engine",
                 profile_names: Sequence[str] | None = None, tree: TreeConfig | None = None,
                 max_length: int | None = None, device: str = "cuda", trt_module=None, keepalive=(),
                 align: int = ADDRESS_ALIGNMENT):
        import torch

        if graph.kv_layout != c.KV_SEQ_MAJOR:  # engines are built from standard-op graphs only (trt_build)
            raise ValueError(f"{label}: graph {graph.path} has KV layout {graph.kv_layout!r} (onnxruntime's fused "
                             "operators), which no TensorRT engine is built from; re-export with --backend trt")
        self.torch, self.trt = torch, trt_module or import_tensorrt()
        self.engine, self.graph, self.dims, self.label = engine, graph, dims, label
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("the TensorRT backend needs a CUDA GPU (torch.cuda.is_available() is False)")
        self._keepalive = keepalive
        self.name = "trt"
        self.is_draft = any(s.name == c.FEATURES for s in graph.inputs)
        tapped = next((s.shape[2] for s in graph.inputs if s.name == c.TAPPED_FEATURES), 0)
        self.profile_dims = KVDims(dims.hidden, dims.num_kv_heads, dims.head_dim, tapped)  # an EAGLE-3 draft: taps
        self.kv_names = c.kv_names(graph.num_kv_layers())
        self.io = self._read_io()
        self._check_contract()
        names = list(profile_names or [])
        self.profiles: list[tuple[str, Bounds]] = [
            (names[p] if p < len(names) else f"profile{p}", self._profile_bounds(p))
            for p in range(engine.num_optimization_profiles)]
        self._order = profile_order(self.profiles)
        self._outputs = [s for s in graph.outputs if not s.name.startswith("present.")]
        self._contexts: dict[int, object] = {}
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._buffers = DeviceBuffers(self.device)
        self.align = int(align)
        self.enqueued = 0  # forwards handed to TensorRT
        self.scratch_presents = 0  # present outputs that went through an aligned scratch buffer
        if tree is not None and max_length:
            self.check_tree(tree, max_length)

    @classmethod
    def from_manifest(cls, folder: Path, manifest, which: str, tree: TreeConfig | None = None,
                      device: str = "cuda") -> "TrtBackend":
        """Open `<folder>/<which>.engine` as recorded in `manifest.engines.trt`."""
        import torch

        folder = Path(folder).resolve()
        record = manifest.engines.trt
        if record is None or which not in record.files:
            raise FileNotFoundError(f"{folder} has no TensorRT {which} engine; export with --backend trt or run "
                                    f"python -m eagle_deploy.exporter.trt_build {folder}")
        path = folder / record.files[which]
        if not path.is_file():
            raise FileNotFoundError(f"TensorRT engine {path} is missing (listed in the manifest); rebuild it")
        trt = import_tensorrt()
        built, here = record.trt_version, getattr(trt, "__version__", None)
        if built and here and built != here:
            raise RuntimeError(f"{path.name} was built with TensorRT {built} but TensorRT {here} is installed; "
                               f"engines are not portable across versions: rebuild with "
                               f"python -m eagle_deploy.exporter.trt_build {folder}")
        if not torch.cuda.is_available():
            raise RuntimeError("the TensorRT backend needs a CUDA GPU (torch.cuda.is_available() is False)")
        torch.cuda.init()  # TensorRT runs in torch's (primary) CUDA context
        logger = trt.Logger(trt.Logger.WARNING)
        if hasattr(trt, "init_libnvinfer_plugins"):
            trt.init_libnvinfer_plugins(logger, "")
        runtime = trt.Runtime(logger)
        engine = runtime.deserialize_cuda_engine(path.read_bytes())
        if engine is None:
            raise RuntimeError(f"TensorRT could not deserialize {path} (built on {record.device} with "
                               f"TensorRT {built}); rebuild it on this machine")
        names = [p.name for p in record.profiles.get(which, ())]
        return cls(engine, getattr(manifest, which), manifest.graph_dims(which), label=f"{which} engine {path.name}",
                   profile_names=names, tree=tree or manifest.tree,
                   max_length=manifest.max_length, device=device, trt_module=trt, keepalive=(runtime, logger))

    # -- engine introspection ----------------------------------------------------------------

    def _read_io(self) -> dict[str, Binding]:
        table = engine_dtype_names(self.trt)
        io = {}
        for i in range(self.engine.num_io_tensors):
            name = self.engine.get_tensor_name(i)
            dt = self.engine.get_tensor_dtype(name)
            if dt not in table:
                raise TypeError(f"{self.label}: tensor {name!r} has TensorRT type {dt}, "
                                "which this runtime does not bind")
            io[name] = Binding(name, self.engine.get_tensor_mode(name) == self.trt.TensorIOMode.INPUT, table[dt])
        return io

    def _check_contract(self) -> None:
        """Every contract tensor exists with the right direction; KV dtypes match the graph."""
        for spec, is_input in [(s, True) for s in self.graph.inputs] + [(s, False) for s in self.graph.outputs]:
            b = self.io.get(spec.name)
            if b is None or b.is_input != is_input:
                raise RuntimeError(f"{self.label} has no {'input' if is_input else 'output'} {spec.name!r} "
                                   f"(engine tensors: {sorted(self.io)}); rebuild it from this export")
        for p, q in self.kv_names:
            if self.io[p].dtype != self.io[q].dtype:
                raise TypeError(f"{self.label}: {p} is {self.io[p].dtype} but {q} is {self.io[q].dtype}")

    def _profile_bounds(self, p: int) -> Bounds:
        return {name: tuple(tuple(int(d) for d in dims) for dims in self.engine.get_tensor_profile_shape(name, p))
                for name, b in self.io.items() if b.is_input}

    # -- checks ------------------------------------------------------------------------------

    def check_tree(self, tree: TreeConfig, max_length: int) -> None:
        """Raise TreeProfileError unless every forward of a round with `tree` fits a profile."""
        cap = draft_kv_capacity(max_length, tree) if self.is_draft else max_length
        check_tree_fits(self.profiles, "draft" if self.is_draft else "target", tree, max_length, self.profile_dims,
                        self.kv_names, draft_capacity=cap, label=self.label)

    def allocate_kv(self, capacity: int) -> KVBuffer:
        """Device KV buffers; raises ProfileShapeError if the engine cannot read that many rows."""
        most = max(b[c.past_name(0, "key")][2][0] for _, b in self.profiles)
        if capacity - 1 > most:
            raise ProfileShapeError(f"{self.label}: a KV buffer of {capacity} rows needs past up to {capacity - 1}, "
                                    f"but the engine's profiles accept past <= {most}; rebuild the engines")
        shape = (capacity, 1, self.dims.num_kv_heads, self.dims.head_dim)
        return KVBuffer(self.kv_names, [self.torch.zeros(shape, dtype=self._torch_dtype(p), device=self.device)
                                        for p, _ in self.kv_names])

    def _torch_dtype(self, name: str):
        return torch_dtype(self.io[name].dtype)

    # -- one forward -------------------------------------------------------------------------

    def _context(self, p: int):
        ctx = self._contexts.get(p)
        if ctx is None:
            ctx = self.engine.create_execution_context()
            if ctx is None:
                raise RuntimeError(f"{self.label}: could not create an execution context (out of GPU memory?)")
            ctx.set_optimization_profile_async(p, self._stream_handle())
            self._sync()
            self._contexts[p] = ctx
        return ctx

    def _stream_handle(self) -> int:
        return self._stream.cuda_stream if self._stream is not None else 0

    def _sync(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()

    def _set_input(self, ctx, name: str, shape: Shape, ptr: int) -> None:
        if not ctx.set_input_shape(name, tuple(shape)):
            raise ProfileShapeError(f"{self.label}: TensorRT rejected shape {tuple(shape)} for input {name!r}")
        self._set_address(ctx, name, ptr)

    def _set_address(self, ctx, name: str, ptr: int) -> None:
        if not ctx.set_tensor_address(name, int(ptr)):
            raise RuntimeError(f"{self.label}: TensorRT rejected the address of {name!r}")

    def run(self, inputs: StepInputs, kv: KVBuffer, past: int) -> StepOutputs:
        S = inputs.input_ids.shape[1]
        inputs.check(past)
        inputs.check_single(self.label)
        feeds = inputs.feeds()
        kvh, hd = self.dims.num_kv_heads, self.dims.head_dim
        shapes = {name: tuple(arr.shape) for name, arr in feeds.items()}
        shapes.update({p: (past, 1, kvh, hd) for p, _ in self.kv_names})
        # a shape outside the optimization profiles raises here, before any enqueue
        p = select_profile(shapes, self.profiles, self._order, self.label)
        kv.check(past, S)
        check_device_kv(kv, self.device, {n: self._torch_dtype(n) for n, _ in self.kv_names}, (1, kvh, hd))
        if self.device.type == "cuda" and any(t.data_ptr() % self.align for t in kv.arrays):
            raise TypeError(f"{self.label}: KV buffers must start {self.align}-byte aligned; "
                            "allocate them with allocate_kv()")
        hosts = {name: coerce_host_array(name, arr, dtypes.host_dtype(self.io[name].dtype))  # int64 ids -> int32
                 for name, arr in feeds.items()}
        ctx = self._context(p)
        stream = self._stream
        if stream is not None:
            stream.wait_stream(self.torch.cuda.current_stream(self.device))  # KV compaction runs on torch's stream
        with self.torch.cuda.stream(stream) if stream is not None else nullcontext():
            for name, host in hosts.items():
                dev = self._buffers.upload(name, host, self._torch_dtype(name))
                self._set_input(ctx, name, host.shape, dev.data_ptr())
            pending = []
            for (past_name, present_name), t in zip(self.kv_names, kv.arrays):
                self._set_input(ctx, past_name, (past, 1, kvh, hd), t.data_ptr())
                rows = t[past:past + S]
                if rows.data_ptr() % self.align == 0:
                    self._set_address(ctx, present_name, rows.data_ptr())  # new rows land at row `past`
                else:  # TensorRT wants 256-byte aligned addresses: land in scratch, copy S rows after
                    scratch = self._buffers.view("scratch/" + present_name, tuple(rows.shape), t.dtype)
                    self._set_address(ctx, present_name, scratch.data_ptr())
                    pending.append((rows, scratch))
            outs = {}
            for spec in self._outputs:
                shape = self._output_shape(ctx, spec.name)
                dev = self._buffers.view(spec.name, shape, self._torch_dtype(spec.name))
                self._set_address(ctx, spec.name, dev.data_ptr())
                outs[spec.name] = dev
            for _, present_name in self.kv_names:
                got = self._output_shape(ctx, present_name)
                if got != (S, 1, kvh, hd):
                    raise RuntimeError(f"{self.label}: {present_name} would be {got}, expected {(S, 1, kvh, hd)}")
            if not ctx.execute_async_v3(self._stream_handle()):
                raise RuntimeError(f"{self.label}: execute_async_v3 failed (see the TensorRT log above)")
            self.enqueued += 1
            for rows, scratch in pending:
                rows.copy_(scratch, non_blocking=True)
            self.scratch_presents += len(pending)
            results = {name: self._buffers.download(name, dev) for name, dev in outs.items()}
        self._sync()
        return outputs_from_named(results)

    def _output_shape(self, ctx, name: str) -> Shape:
        shape = tuple(int(d) for d in ctx.get_tensor_shape(name))
        if any(d < 0 for d in shape):
            raise RuntimeError(f"{self.label}: output {name!r} has unresolved shape {shape}")
        return shape

