"""TensorRT backend: one serialized engine behind the `Backend` protocol.

Name-based tensor API of TensorRT 10/11 (`set_input_shape`, `set_tensor_address`,
`execute_async_v3`). The runtime owns every device buffer (torch CUDA tensors): KV buffers
are allocated once and written in place (each present output is bound at row `past` of its
buffer; where that row's address is not 256-byte aligned, as TensorRT requires, the new rows
land in an aligned scratch buffer and are copied to row `past` on the same stream: S rows per
layer), token / mask tensors go host -> device through reused staging buffers, and logits,
features and top-k come back to host numpy.

Before any enqueue each call is checked against the engine's optimization profiles: a shape
outside every profile raises `ProfileShapeError` naming the input, its size and the bounds
(case T2), and a tree too large for the profiles fails at start-up (`check_tree_fits`).
Every host array is checked against its binding's dtype and cast only where that is exact
(int64 ids into an int32 binding: range-checked cast; case T3).

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

import numpy as np

from eagle_deploy.exporter import contract as c

from ..kv import KVBuffer
from ..manifest import GraphEntry
from ..tree import TreeConfig, TreeConfigError
from .base import StepInputs
from .ort_cuda import HOST_DTYPES, DeviceBuffers, check_device_kv, coerce_host_array, torch_dtype

Shape = tuple[int, ...]
Bounds = dict[str, tuple[Shape, Shape, Shape]]  # input name -> (min, opt, max)
NamedBounds = Sequence[tuple[str, Bounds]]  # one (profile name, bounds) per profile, in engine order

# TensorRT DataType member name -> contract dtype name
# IExecutionContext::setTensorAddress: "The pointer must have at least 256-byte alignment"
# (NvInferRuntime.h, TensorRT 10 and 11).
ADDRESS_ALIGNMENT = 256

TRT_DTYPE_NAMES = {"FLOAT": "float32", "HALF": "float16", "BF16": "bfloat16", "INT64": "int64", "INT32": "int32",
                   "INT8": "int8", "UINT8": "uint8", "BOOL": "bool"}


class ProfileShapeError(ValueError):
    """A call (or a configuration) is outside the engine's optimization profiles."""


class TreeProfileError(ProfileShapeError, TreeConfigError):
    """A tree configuration the engine's profiles cannot run (raised at start-up)."""


# ---------------------------------------------------------------------------------------------
# Pure checks


def profile_violation(shapes: dict[str, Shape], bounds: Bounds) -> str | None:
    """None if every input shape lies within `bounds`, else a sentence naming the first input
    outside them with its size and the profile's bounds."""
    for name, shape in shapes.items():
        if name not in bounds:
            continue
        lo, _, hi = bounds[name]
        shape = tuple(int(s) for s in shape)
        if len(shape) != len(lo):
            return f"input {name!r} has rank {len(shape)} {shape}, the engine expects rank {len(lo)}"
        for axis, (s, a, b) in enumerate(zip(shape, lo, hi)):
            if not a <= s <= b:
                return (f"input {name!r} has shape {shape}: dimension {axis} is {s}, outside [{a}, {b}] "
                        f"(profile bounds min {tuple(lo)} max {tuple(hi)})")
    return None


def profile_order(profiles: NamedBounds) -> list[int]:
    """Profile indices, tightest first (smallest max sequence length), so a decode step uses
    the decode profile and a tree the verification profile."""
    def max_seq(i: int) -> int:
        hi = profiles[i][1].get(c.INPUT_IDS, ((), (), (0, 0)))[2]
        return int(hi[1]) if len(hi) > 1 else 0
    return sorted(range(len(profiles)), key=lambda i: (max_seq(i), i))


def select_profile(shapes: dict[str, Shape], profiles: NamedBounds, order: Sequence[int] | None = None,
                   label: str = "engine") -> int:
    """Index of the first profile (in `order`) accepting every shape, else ProfileShapeError
    listing, per profile, which input is out of bounds."""
    problems = []
    for i in order if order is not None else range(len(profiles)):
        why = profile_violation(shapes, profiles[i][1])
        if why is None:
            return i
        problems.append(f"profile {i} ({profiles[i][0]}): {why}")
    seq = shapes.get(c.INPUT_IDS, (0, "?"))[1]
    past = next((s[0] for n, s in shapes.items() if n.startswith("past_key_values.")), "?")
    raise ProfileShapeError(
        f"{label}: no TensorRT optimization profile accepts this call (seq={seq}, past={past}); nothing was "
        f"enqueued.\n  " + "\n  ".join(problems) + "\nUse a smaller tree or shorter input, or rebuild the engines with "
        "larger bounds (python -m eagle_deploy.exporter.trt_build FOLDER --max-tree-tokens N / --max-prompt N).")


def step_shapes(seq: int, past: int, num_logits: int, dims: dict, kv_names: Sequence[tuple[str, str]],
                draft: bool) -> dict[str, Shape]:
    """Input shapes (batch 1) of one forward with `seq` new tokens over `past` cached rows."""
    shapes = {c.INPUT_IDS: (1, seq), c.POSITION_IDS: (1, seq), c.ATTENTION_MASK: (1, seq, past + seq),
              c.LOGITS_INDICES: (1, num_logits)}
    if draft:
        shapes[c.FEATURES] = (1, seq, dims["hidden"])
    for p, _ in kv_names:
        shapes[p] = (past, 1, dims["num_kv_heads"], dims["head_dim"])
    return shapes


def _frontier_sizes(tree: TreeConfig) -> list[int]:
    """Nodes fed through the draft per expansion step (all depths)."""
    if tree.depth <= 1:
        return []
    if tree.kind == "static":
        by_depth: dict[int, set] = {}
        for path in tree.choices:
            if len(path) > 1:
                by_depth.setdefault(len(path) - 1, set()).add(path[:-1])
        return sorted({len(v) for v in by_depth.values()})
    return [tree.top_k]


def tree_calls(which: str, tree: TreeConfig, max_length: int, draft_capacity: int | None = None) -> list[tuple[str, int, int, int]]:
    """(what, seq, past, num_logits) of the forwards a round with `tree` makes, at the largest
    past each can have (and at past 0). Prompt-sized prefills are excluded (checked per call)."""
    calls = []
    if which == "target":
        for n in range(1, min(tree.total_tokens, max_length - 1) + 1):
            calls += [("verify", n, max_length - n, n), ("verify", n, 0, n)]
        return calls
    cap = draft_capacity or max_length + tree.max_draft_inputs()
    for k in range(1, min(tree.depth + 1, max_length - 1) + 1):  # extension: accepted path + bonus
        calls.append(("draft extension", k, max_length - k, 1))
    for F in _frontier_sizes(tree):
        calls.append(("draft expansion", F, cap - F, F))
    return calls


def check_tree_fits(profiles: NamedBounds, which: str, tree: TreeConfig, max_length: int, dims: dict | None = None,
                    kv_names: Sequence[tuple[str, str]] | None = None, draft_capacity: int | None = None,
                    label: str = "engine") -> None:
    """Raise TreeProfileError (a TreeConfigError) if some forward of a round with `tree`
    falls outside every profile. `dims`/`kv_names` default to what the bounds imply."""
    dims = dims or _dims_from_bounds(profiles)
    kv_names = kv_names or [(n, n.replace("past_key_values", "present"))
                            for n in profiles[0][1] if n.startswith("past_key_values.")]
    order = profile_order(profiles)
    for what, seq, past, n in tree_calls(which, tree, max_length, draft_capacity):
        shapes = step_shapes(seq, past, n, dims, kv_names, draft=(which == "draft"))
        try:
            select_profile(shapes, profiles, order, label)
        except ProfileShapeError as err:
            raise TreeProfileError(
                f"tree {tree.to_json()} does not fit {label}: its {what} with seq={seq} at past={past} is outside "
                f"every optimization profile.\n{err}") from None


def _dims_from_bounds(profiles: NamedBounds) -> dict:
    b = profiles[0][1]
    kv = next(v for n, v in b.items() if n.startswith("past_key_values."))[0]
    hidden = b[c.FEATURES][0][2] if c.FEATURES in b else 0
    return {"num_kv_heads": kv[2], "head_dim": kv[3], "hidden": hidden}


def engine_dtype_names(trt) -> dict:
    """{trt.DataType member: contract dtype name} for the members this TensorRT has."""
    return {getattr(trt.DataType, k): v for k, v in TRT_DTYPE_NAMES.items() if hasattr(trt.DataType, k)}


# ---------------------------------------------------------------------------------------------
# Backend


def _import_trt():
    try:
        import tensorrt as trt
    except ImportError as err:
        raise ImportError(f"TensorRT is not installed or cannot load ({err}); on a CUDA host run "
                          f"`pip install '.[gpu]'`") from None
    return trt


@dataclass(frozen=True)
class Binding:
    name: str
    is_input: bool
    dtype: str  # contract dtype name of the engine tensor


class TrtBackend:
    """One TensorRT engine (target or draft graph). Build with `from_manifest`; the
    constructor takes an already deserialized engine (tests pass a stand-in)."""

    def __init__(self, engine, graph: GraphEntry, dims: dict, *, label: str = "engine",
                 profile_names: Sequence[str] | None = None, tree: TreeConfig | None = None,
                 max_length: int | None = None, device: str = "cuda", trt_module=None, keepalive=(),
                 align: int = ADDRESS_ALIGNMENT):
        import torch

        self.torch, self.trt = torch, trt_module or _import_trt()
        self.engine, self.graph, self.dims, self.label = engine, graph, dims, label
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("the TensorRT backend needs a CUDA GPU (torch.cuda.is_available() is False)")
        self._keepalive = keepalive
        self.name = "trt"
        self.is_draft = any(s["name"] == c.FEATURES for s in graph.inputs)
        self.kv_names = c.kv_names(sum(1 for s in graph.inputs if s["name"].startswith("past_key_values.")) // 2)
        self.io = self._read_io()
        self._check_contract()
        names = list(profile_names or [])
        self.profiles: list[tuple[str, Bounds]] = [
            (names[p] if p < len(names) else f"profile{p}", self._profile_bounds(p))
            for p in range(engine.num_optimization_profiles)]
        self._order = profile_order(self.profiles)
        self._outputs = [s for s in graph.outputs if not s["name"].startswith("present.")]
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
        """Open `<folder>/<which>.engine` as recorded in `manifest.engines["trt"]`."""
        import torch

        folder = Path(folder).resolve()
        record = (manifest.engines or {}).get("trt")
        if not record or which not in record.get("files", {}):
            raise FileNotFoundError(f"{folder} has no TensorRT {which} engine; export with --backend trt or run "
                                    f"python -m eagle_deploy.exporter.trt_build {folder}")
        path = folder / record["files"][which]
        if not path.is_file():
            raise FileNotFoundError(f"TensorRT engine {path} is missing (listed in the manifest); rebuild it")
        trt = _import_trt()
        built, here = record.get("trt_version"), getattr(trt, "__version__", None)
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
            raise RuntimeError(f"TensorRT could not deserialize {path} (built on {record.get('device')} with "
                               f"TensorRT {built}); rebuild it on this machine")
        names = [p["name"] for p in record.get("profiles", {}).get(which, [])]
        return cls(engine, getattr(manifest, which), manifest.dims, label=f"{which} engine {path.name}",
                   profile_names=names, tree=tree or TreeConfig.from_json(manifest.tree),
                   max_length=manifest.max_length, device=device, trt_module=trt, keepalive=(runtime, logger))

    # -- engine introspection ----------------------------------------------------------------

    def _read_io(self) -> dict[str, Binding]:
        table = engine_dtype_names(self.trt)
        io = {}
        for i in range(self.engine.num_io_tensors):
            name = self.engine.get_tensor_name(i)
            dt = self.engine.get_tensor_dtype(name)
            if dt not in table:
                raise TypeError(f"{self.label}: tensor {name!r} has TensorRT type {dt}, which this runtime does not bind")
            io[name] = Binding(name, self.engine.get_tensor_mode(name) == self.trt.TensorIOMode.INPUT, table[dt])
        return io

    def _check_contract(self) -> None:
        """Every contract tensor exists with the right direction; KV dtypes match the graph."""
        for spec, is_input in [(s, True) for s in self.graph.inputs] + [(s, False) for s in self.graph.outputs]:
            b = self.io.get(spec["name"])
            if b is None or b.is_input != is_input:
                raise RuntimeError(f"{self.label} has no {'input' if is_input else 'output'} {spec['name']!r} "
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
        cap = max_length + tree.max_draft_inputs() if self.is_draft else max_length
        check_tree_fits(self.profiles, "draft" if self.is_draft else "target", tree, max_length, self.dims,
                        self.kv_names, draft_capacity=cap, label=self.label)

    def allocate_kv(self, capacity: int) -> KVBuffer:
        """Device KV buffers; raises ProfileShapeError if the engine cannot read that many rows."""
        most = max(b[c.past_name(0, "key")][2][0] for _, b in self.profiles)
        if capacity - 1 > most:
            raise ProfileShapeError(f"{self.label}: a KV buffer of {capacity} rows needs past up to {capacity - 1}, "
                                    f"but the engine's profiles accept past <= {most}; rebuild the engines")
        shape = (capacity, 1, self.dims["num_kv_heads"], self.dims["head_dim"])
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

    def run(self, inputs: StepInputs, kv: KVBuffer, past: int) -> dict[str, np.ndarray]:
        S = inputs.input_ids.shape[1]
        inputs.check(past)
        feeds = inputs.feeds()
        kvh, hd = self.dims["num_kv_heads"], self.dims["head_dim"]
        shapes = {name: tuple(arr.shape) for name, arr in feeds.items()}
        shapes.update({p: (past, 1, kvh, hd) for p, _ in self.kv_names})
        p = select_profile(shapes, self.profiles, self._order, self.label)  # T2: before any enqueue
        kv.check(past, S)
        check_device_kv(kv, self.device, {n: self._torch_dtype(n) for n, _ in self.kv_names}, (1, kvh, hd))
        if self.device.type == "cuda" and any(t.data_ptr() % self.align for t in kv.arrays):
            raise TypeError(f"{self.label}: KV buffers must start {self.align}-byte aligned; allocate them with allocate_kv()")
        hosts = {name: coerce_host_array(name, arr, HOST_DTYPES[self.io[name].dtype]) for name, arr in feeds.items()}  # T3
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
                shape = self._output_shape(ctx, spec["name"])
                dev = self._buffers.view(spec["name"], shape, self._torch_dtype(spec["name"]))
                self._set_address(ctx, spec["name"], dev.data_ptr())
                outs[spec["name"]] = dev
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
        return results

    def _output_shape(self, ctx, name: str) -> Shape:
        shape = tuple(int(d) for d in ctx.get_tensor_shape(name))
        if any(d < 0 for d in shape):
            raise RuntimeError(f"{self.label}: output {name!r} has unresolved shape {shape}")
        return shape

