"""onnxruntime on the CUDA execution provider, with IO binding onto torch device buffers.

KV buffers are torch CUDA tensors allocated once (`allocate_kv`); the past input is bound to
rows [0, past) and each present output straight to row `past` of the same buffer, so the
cache never leaves the device. Token and mask tensors (small) are copied host -> device into
reused staging buffers; logits / features / top-k come back to host numpy.

Also home of the device-buffer helpers the TensorRT backend shares (`DeviceBuffers`,
`coerce_host_array`, `check_device_kv`). With `device="cpu"` the same binding code runs on
onnxruntime's CPU provider over torch CPU tensors (how the CPU test suite exercises it).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from eagle_deploy.contract import dtypes
from eagle_deploy.contract import onnx_io as c
from eagle_deploy.contract.manifest import Dims, GraphEntry

from ..kv import KVBuffer
from .base import StepInputs, StepOutputs, check_step, outputs_from_named, resolve_shape


def torch_dtype(name: str):
    """contract dtype name (one of `contract.dtypes.NAMES`, which torch spells alike) -> torch
    dtype. Raises ValueError for any other name."""
    import torch

    if name not in dtypes.NAMES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(dtypes.NAMES)}")
    return getattr(torch, name)


def coerce_host_array(name: str, arr, want) -> np.ndarray:
    """A C-contiguous host array of dtype `want` for binding `name`.

    Same dtype: as is. Integer -> integer (e.g. int64 ids into an int32 binding): cast after
    checking every value fits. Float -> float: cast. Anything else (bool <-> int, int <->
    float) raises TypeError: a buffer is never handed over as bytes of another type."""
    arr = np.asarray(arr)
    want = np.dtype(want)
    if arr.dtype == want:
        return np.ascontiguousarray(arr)
    if arr.dtype.kind in "iu" and want.kind in "iu":
        info = np.iinfo(want)
        if arr.size and (int(arr.min()) < info.min or int(arr.max()) > info.max):
            raise TypeError(f"input {name!r}: values in [{int(arr.min())}, {int(arr.max())}] do not fit the "
                            f"engine's {want} binding")
        return np.ascontiguousarray(arr.astype(want))
    if arr.dtype.kind == "f" and want.kind == "f":
        return np.ascontiguousarray(arr.astype(want))
    raise TypeError(f"input {name!r} is {arr.dtype} but the binding is {want}; refusing to reinterpret "
                    f"{arr.dtype} data as {want} (convert it explicitly)")


def check_device_kv(kv: KVBuffer, device, dtypes: dict[str, object], tail: tuple[int, int, int]) -> None:
    """Raise TypeError unless every KV array is a contiguous torch tensor on `device` with
    the binding's dtype (`dtypes[past name]`) and shape [capacity, *tail] viewed
    sequence-major (`KVBuffer.rows`: [batch, kv_heads, capacity, head_dim] in the shared layout)."""
    import torch

    for i, ((past, _), t) in enumerate(zip(kv.names, kv.arrays)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"KV buffer {past!r} is a {type(t).__name__}, not a torch tensor on {device}: "
                            f"allocate it with this backend's allocate_kv()")
        if t.device != torch.device(device) or t.dtype != dtypes[past]:
            raise TypeError(f"KV buffer {past!r} is {t.dtype} on {t.device}; "
                            f"the binding needs {dtypes[past]} on {device}")
        if tuple(kv.rows(i).shape[1:]) != tuple(tail) or not t.is_contiguous():
            raise TypeError(f"KV buffer {past!r} has shape {tuple(t.shape)} (contiguous={t.is_contiguous()}); "
                            f"expected a contiguous [capacity, {', '.join(map(str, tail))}]")


class DeviceBuffers:
    """Reused flat buffers by name (grown, never shrunk): device staging for inputs and
    outputs, and host (pinned on CUDA) landing buffers for outputs."""

    def __init__(self, device):
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        self._dev: dict[str, object] = {}
        self._host: dict[str, object] = {}

    def _grow(self, pool: dict, name: str, shape, dtype, device, pin: bool):
        need = int(np.prod(shape, dtype=np.int64))
        buf = pool.get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < need:
            size = max(need, 2 * buf.numel() if buf is not None and buf.dtype == dtype else 0, 1)
            buf = self.torch.empty(size, dtype=dtype, device=device, pin_memory=pin)
            pool[name] = buf
        return buf[:need].view(tuple(shape))

    def view(self, name: str, shape, dtype):
        """A device tensor of `shape` and `dtype` (contents undefined)."""
        return self._grow(self._dev, name, shape, dtype, self.device, False)

    def upload(self, name: str, host: np.ndarray, dtype):
        """Copy a host array into the staging buffer `name` (cast to `dtype` by torch)."""
        dev = self.view(name, host.shape, dtype)
        if not host.flags.writeable:  # torch.from_numpy warns on read-only arrays
            host = host.copy()
        dev.copy_(self.torch.from_numpy(host), non_blocking=self.pinned)
        return dev

    def download(self, name: str, dev) -> np.ndarray:
        """Enqueue a copy of `dev` into the host buffer `name`; the returned numpy array is
        valid once the stream is synchronised (bfloat16 comes back as float32)."""
        if dev.dtype == self.torch.bfloat16:
            dev = dev.float()
        host = self._grow(self._host, name, tuple(dev.shape), dev.dtype, "cpu", self.pinned)
        host.copy_(dev, non_blocking=self.pinned)
        return host.numpy()


class OrtCudaBackend:
    """One exported graph in an onnxruntime session on the CUDA execution provider (or, with
    device="cpu", on the CPU provider over torch CPU tensors), IO-bound to torch buffers."""

    def __init__(self, folder: Path, graph: GraphEntry, dims: Dims, device: str = "cuda", device_id: int = 0,
                 threads: int | None = None):
        import onnxruntime as ort
        import torch

        from .ort import check_session, open_session, session_options

        self.torch, self.graph, self.dims = torch, graph, dims
        self.device = torch.device(device if device == "cpu" else f"cuda:{device_id}")
        self.device_id = device_id
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("the ort-cuda backend needs a CUDA GPU (torch.cuda.is_available() is False)")
        path = Path(folder) / graph.path
        if not path.exists():
            raise FileNotFoundError(f"graph {path} is missing from the export folder")
        providers = ([("CUDAExecutionProvider", {"device_id": device_id}), "CPUExecutionProvider"]
                     if self.device.type == "cuda" else ["CPUExecutionProvider"])
        self.session = open_session(path, session_options(threads), providers)
        active = self.session.get_providers()[0]
        if self.device.type == "cuda" and active != "CUDAExecutionProvider":
            raise RuntimeError(f"onnxruntime has no CUDA execution provider here (active: {active}; available: "
                               f"{ort.get_available_providers()}); install onnxruntime-gpu in place of onnxruntime")
        check_session(self.session, folder, graph, dims)
        self.name = "ort-cuda" if self.device.type == "cuda" else "ort-torch-cpu"
        self.kv_names = c.kv_names(graph.num_kv_layers())
        self._in_dtypes = {s.name: s.dtype for s in graph.inputs}
        self._outputs = [o for o in graph.outputs if not o.name.startswith("present.")]
        self._buffers = DeviceBuffers(self.device)
        self._binding = self.session.io_binding()
        self._bind_device = "cuda" if self.device.type == "cuda" else "cpu"

    def _element_type(self, dtype: str):
        if dtype == "bfloat16":
            from onnx import TensorProto

            return TensorProto.BFLOAT16
        return dtypes.host_dtype(dtype)

    def allocate_kv(self, capacity: int) -> KVBuffer:
        dtype = torch_dtype(self._in_dtypes[self.kv_names[0][0]])
        shape = KVBuffer.shape(self.graph.kv_layout, capacity, 1, self.dims.num_kv_heads, self.dims.head_dim)
        return KVBuffer(self.kv_names,
                        [self.torch.zeros(shape, dtype=dtype, device=self.device) for _ in self.kv_names],
                        self.graph.kv_layout)

    def _bind_in(self, name: str, t, shape) -> None:
        self._binding.bind_input(name, self._bind_device, self.device_id, self._element_type(self._in_dtypes[name]),
                                 tuple(shape), t.data_ptr())

    def run(self, inputs: StepInputs, kv: KVBuffer, past: int) -> StepOutputs:
        S, N = inputs.input_ids.shape[1], inputs.logits_indices.shape[1]
        inputs.check_single(self.name)
        check_step(inputs, kv, past, self.graph.kv_layout, self.graph.repeats_one_row)
        kvh, hd = self.dims.num_kv_heads, self.dims.head_dim
        shared = self.graph.kv_layout == c.KV_SHARED
        check_device_kv(kv, self.device, {p: torch_dtype(self._in_dtypes[p]) for p, _ in self.kv_names}, (1, kvh, hd))
        b = self._binding
        b.clear_binding_inputs()
        b.clear_binding_outputs()
        for name, arr in inputs.feeds().items():
            dtype = self._in_dtypes[name]
            host = coerce_host_array(name, arr, dtypes.host_dtype(dtype))
            self._bind_in(name, self._buffers.upload(name, host, torch_dtype(dtype)), host.shape)
        for (past_name, present_name), t in zip(self.kv_names, kv.arrays):
            if shared:  # one buffer in and out: the fused attention writes rows [past, past + S) in place
                self._bind_in(past_name, t, tuple(t.shape))
                b.bind_output(present_name, self._bind_device, self.device_id,
                              self._element_type(self._in_dtypes[past_name]), tuple(t.shape), t.data_ptr())
                continue
            self._bind_in(past_name, t, (past, 1, kvh, hd))
            # new rows land at row `past`
            b.bind_output(present_name, self._bind_device, self.device_id,
                          self._element_type(self._in_dtypes[past_name]), (S, 1, kvh, hd), t[past].data_ptr())
        sizes = {"batch": 1, "seq": S, "num_logits": N, "vocab": self.dims.vocab, "hidden": self.dims.hidden}
        outs = {}
        for spec in self._outputs:
            dev = self._buffers.view(spec.name, resolve_shape(spec.shape, sizes), torch_dtype(spec.dtype))
            b.bind_output(spec.name, self._bind_device, self.device_id, self._element_type(spec.dtype),
                          tuple(dev.shape), dev.data_ptr())
            outs[spec.name] = dev
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)  # staging copies and KV compaction are on torch's stream
        self.session.run_with_iobinding(b)
        b.synchronize_outputs()
        results = {name: self._buffers.download(name, dev) for name, dev in outs.items()}
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)
        return outputs_from_named(results)
