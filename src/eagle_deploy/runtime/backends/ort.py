"""onnxruntime backend: IO binding onto preallocated host buffers (no per-step allocation
of KV; outputs land in reused arrays)."""
from __future__ import annotations

import math
import weakref
from pathlib import Path

import numpy as np

from eagle_deploy.contract import onnx_io as c
from eagle_deploy.contract.dtypes import numpy_dtype
from eagle_deploy.contract.errors import first_line
from eagle_deploy.contract.manifest import Dims, DraftEntry, GraphEntry, ManifestError, SharedWeights, check_graph_io
from eagle_deploy.contract.onnx_io import TensorSpec

from ..kv import KVBuffer
from .base import StepInputs, StepOutputs, check_step, outputs_from_named, resolve_shape


def open_session(path: Path, options, providers):
    """An onnxruntime InferenceSession over `path`; a truncated or corrupt graph raises
    ManifestError (onnxruntime's own exceptions are not ValueErrors)."""
    import onnxruntime as ort

    try:
        return ort.InferenceSession(str(path), options, providers=providers)
    except Exception as err:
        raise ManifestError(f"onnxruntime cannot load {path} ({first_line(err)}); the export folder is damaged: "
                            f"re-export it") from None


# onnxruntime type strings -> contract dtype names
ORT_TYPES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(bfloat16)": "bfloat16",
             "tensor(int64)": "int64", "tensor(int32)": "int32", "tensor(int8)": "int8", "tensor(uint8)": "uint8",
             "tensor(bool)": "bool"}


def session_io(session) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """(inputs, outputs) an onnxruntime session reports, as contract TensorSpecs (unknown
    dimensions as "?")."""
    def spec(arg) -> TensorSpec:
        shape = tuple("?" if d is None else d for d in arg.shape)
        return TensorSpec(arg.name, ORT_TYPES.get(arg.type, arg.type), shape)
    return [spec(a) for a in session.get_inputs()], [spec(a) for a in session.get_outputs()]


def check_session(session, folder: Path, graph: GraphEntry, dims: Dims, which: str | None = None) -> None:
    """ManifestError (one line, naming the manifest field) unless the manifest's entry for this
    graph (`which`; None: "draft" for a DraftEntry, else "target") declares exactly the
    inputs/outputs the opened session has (names in order, dtypes, ranks, fixed sizes against
    `dims`)."""
    which = which or ("draft" if isinstance(graph, DraftEntry) else "target")
    check_graph_io(graph, which, *session_io(session), dims=dims, source=str(Path(folder) / c.MANIFEST_FILE))


def session_options(threads: int | None = None, spinning: bool = False):
    """Session options for graphs that share a machine with another live session. With target
    and draft sessions both live, spinning in both pools slows EAGLE (the idle pool spins
    against the busy one), while spinning in the target's pool alone (OrtBackend's default)
    speeds up both vanilla and EAGLE decoding (docs/decisions.md, 'Thread spinning, measured')."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.inter_op_num_threads = 1
    if threads:
        so.intra_op_num_threads = threads
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    so.log_severity_level = 3
    return so


class _Mapping:
    """The shared-weights file mapped read-only once, and an OrtValue over each embedding in it
    (`values`: [(SharedTensor, OrtValue)])."""

    def __init__(self, path: Path, shared: SharedWeights):
        self.array = np.memmap(path, dtype=np.uint8, mode="r", shape=(shared.size,))
        self.values = []
        for t in shared.tensors:
            if t.role not in MAPPED_ROLES:
                continue
            view = self.array[t.offset:t.offset + t.length].view(numpy_dtype(t.dtype)).reshape(t.shape)
            self.values.append((t, ort_value(view)))


_MAPPINGS: "weakref.WeakValueDictionary[tuple, _Mapping]" = weakref.WeakValueDictionary()
# Shared tensors handed to the sessions from the one mapping: the embedding (read by Gather in
# place, so only the rows gathered become resident, once). LM-head weights (shared with a full
# draft vocabulary) are not: onnxruntime prepacks them into each session's own buffer anyway,
# and its own mapping of the file is released after prepacking, while ours would stay resident.
MAPPED_ROLES = ("embedding",)


def ort_value(array: np.ndarray):
    import onnxruntime as ort

    return ort.OrtValue.ortvalue_from_numpy(array)


def shared_initializers(folder: Path, shared: SharedWeights | None, which: str) -> tuple[object, dict]:
    """(keep-alive handle, {initializer name in graph `which`: OrtValue}) for the shared
    embedding of an export (MAPPED_ROLES): the file is mapped once per process (np.memmap,
    read-only) and every session of the export gets OrtValues over that one mapping
    (SessionOptions.add_initializer: no copy), so the target, draft (and prefill) graphs hold one copy,
    counted once in RSS, of which only the rows actually gathered become resident
    (docs/decisions.md, 'One mapping of shared.data, measured'). Raises ManifestError when the
    file is missing or truncated (SharedWeights.check)."""
    if shared is None or not shared.tensors:
        return None, {}
    shared.check(folder, which)
    if not any(t.role in MAPPED_ROLES for t in shared.tensors):
        return None, {}
    path = (Path(folder) / shared.file).resolve()
    stat = path.stat()
    key = (str(path), stat.st_size, stat.st_mtime_ns)
    mapping = _MAPPINGS.get(key)
    if mapping is None:
        mapping = _Mapping(path, shared)
        _MAPPINGS[key] = mapping
    return mapping, {t.name_in(which): value for t, value in mapping.values if t.name_in(which) is not None}


class OrtBackend:
    """One exported graph in an onnxruntime session (CPUExecutionProvider by default)."""

    def __init__(self, folder: Path, graph: GraphEntry, dims: Dims, threads: int | None = None,
                 spinning: bool | None = None, providers: list[str] | None = None,
                 shared: SharedWeights | None = None, which: str | None = None):
        """spinning: intra-op threads spin between ops; None = on for the target graph (the
        one with logits, and the prefill graph, which has them too), off for the draft (see
        session_options). shared: the export's shared weights (Manifest.shared_weights), given
        to the session from one process-wide mapping (shared_initializers). which: the graph's
        name in the manifest ("target" | "draft" | "prefill"; None: "draft" for a DraftEntry,
        else "target"). Raises ManifestError when the graph's inputs/outputs are not the ones
        `graph` declares (check_session) or the shared weights are missing."""
        if spinning is None:
            spinning = any(o.name == c.LOGITS for o in graph.outputs)

        self.graph = graph
        self.dims = dims
        self.threads = threads  # intra-op threads (None: onnxruntime's default)
        path = Path(folder) / graph.path
        if not path.exists():
            raise FileNotFoundError(f"graph {path} is missing from the export folder")
        options = session_options(threads, spinning)
        which = which or ("draft" if isinstance(graph, DraftEntry) else "target")
        self._shared, initializers = shared_initializers(folder, shared, which)  # kept alive with the session
        for name, value in initializers.items():
            options.add_initializer(name, value)
        self.session = open_session(path, options, providers or ["CPUExecutionProvider"])
        check_session(self.session, folder, graph, dims, which)
        self.name = "ort-" + self.session.get_providers()[0].replace("ExecutionProvider", "").lower()
        self.kv_names = [(p, q) for p, q in c.kv_names(graph.num_kv_layers())]
        self.kv_dtype = numpy_dtype(graph.dtype)
        self.kv_layout = graph.kv_layout  # read from the input specs: once, not per forward
        self._outputs = [(o, numpy_dtype(o.dtype)) for o in graph.outputs if not o.name.startswith("present.")]
        self._in_buffers: dict[str, np.ndarray] = {}
        self._out_buffers: dict[str, np.ndarray] = {}
        self._binding = self.session.io_binding()
        self._kv_bound: tuple | None = None  # shared layout: (KVBuffer, array ids) whose KV stays bound
        self._bound: dict[str, tuple] = {}  # input/output name -> (address, shape) bound now

    def allocate_kv(self, capacity: int, batch: int = 1) -> KVBuffer:
        """KV buffers in this graph's layout (graph.kv_layout), `capacity` rows each, for
        `batch` sequences (batch > 1: the slots of `runtime.batch.BatchRuntime`)."""
        return KVBuffer.allocate(self.kv_names, capacity, batch, self.dims.num_kv_heads, self.dims.head_dim,
                                 self.kv_dtype, layout=self.graph.kv_layout)

    @staticmethod
    def _buffer(store: dict[str, np.ndarray], name: str, dtype, shape: tuple[int, ...]) -> np.ndarray:
        """A reused array of `shape` at the start of `store[name]` (grown, never shrunk; replaced
        when the dtype differs), so that its address stays the same from call to call."""
        need = math.prod(shape)
        buf = store.get(name)
        if buf is None or buf.size < need or buf.dtype != dtype:
            grow = 0 if buf is None or buf.dtype != dtype else 2 * buf.size
            buf = store[name] = np.empty(max(need, grow), dtype=dtype)
        return buf[:need].reshape(shape)

    def _bind(self, name: str, arr: np.ndarray, output: bool) -> None:
        """Bind `arr` (a reused buffer, `_buffer`) unless that address is bound with
        this shape already: a binding outlives the forward, so a step whose shapes repeat
        (vanilla decoding: all but the attention mask) makes no binding calls for them."""
        key = (arr.ctypes.data, arr.shape)  # the address, not id(): a new buffer may reuse an old id
        if self._bound.get(name) == key:
            return
        bind = self._binding.bind_output if output else self._binding.bind_input
        bind(name, "cpu", 0, arr.dtype, arr.shape, key[0])
        self._bound[name] = key

    def run(self, inputs: StepInputs, kv: KVBuffer, past: int) -> StepOutputs:
        (B, S), N = inputs.input_ids.shape, inputs.logits_indices.shape[1]
        check_step(inputs, kv, past, self.kv_layout, self.graph.repeats_one_row)
        shared = self.kv_layout == c.KV_SHARED
        b = self._binding
        # shared layout: the KV bindings (whole buffers, in and out) do not change from call to call,
        # so they are bound once per buffer and only the other inputs/outputs are rebound (a
        # binding by the same name replaces the old one): ~120 fewer binding calls per forward
        key = (kv, tuple(map(id, kv.arrays))) if shared else None
        if key is None or self._kv_bound is None or self._kv_bound[0] is not kv or self._kv_bound[1] != key[1]:
            b.clear_binding_inputs()
            b.clear_binding_outputs()
            self._kv_bound, self._bound = None, {}
            shape_past = (past, B, self.dims.num_kv_heads, self.dims.head_dim)
            shape_new = (S,) + shape_past[1:]
            for (past_name, present_name), arr in zip(self.kv_names, kv.arrays):
                if shared:  # one buffer in and out: the fused attention writes rows [past, past + S) in place
                    b.bind_input(past_name, "cpu", 0, self.kv_dtype, arr.shape, arr.ctypes.data)
                    b.bind_output(present_name, "cpu", 0, self.kv_dtype, arr.shape, arr.ctypes.data)
                    continue
                b.bind_input(past_name, "cpu", 0, self.kv_dtype, shape_past, arr.ctypes.data)
                b.bind_output(present_name, "cpu", 0, self.kv_dtype, shape_new, arr[past:].ctypes.data)
            self._kv_bound = key
        # inputs are copied into reused buffers (a few hundred bytes) so that their bindings can persist
        for name, arr in inputs.feeds().items():
            buf = self._buffer(self._in_buffers, name, arr.dtype, arr.shape)
            buf[...] = arr
            self._bind(name, buf, output=False)
        sizes = {"batch": B, "seq": S, "num_logits": N, "vocab": self.dims.vocab, "hidden": self.dims.hidden}
        results = {}
        for spec, dtype in self._outputs:
            out = self._buffer(self._out_buffers, spec.name, dtype, resolve_shape(spec.shape, sizes))
            self._bind(spec.name, out, output=True)
            results[spec.name] = out
        self.session.run_with_iobinding(b)
        return outputs_from_named(results)
