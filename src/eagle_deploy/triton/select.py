"""Which engine backend a Triton model instance decodes with: "ort" (onnxruntime CPU),
"ort-cuda" (onnxruntime CUDA execution provider) or "trt" (TensorRT engines).

The model's `backend` parameter is "auto" (the default) or one of those names. "auto" picks,
in order: "trt" when the export's manifest records TensorRT engines (`engines.trt`, written by
`eagle-export --backend trt`), a CUDA GPU is visible and `tensorrt` imports; "ort-cuda" when a
GPU is visible and onnxruntime offers the CUDAExecutionProvider; else "ort". A named backend is
checked against the same facts and refused with a reason instead of failing later.

Only the CPU path has run; the GPU branches are tested on CPU with a fake `Host` (the GPU
path itself has not run). Imports nothing heavy: the probe imports onnxruntime lazily.
"""
from __future__ import annotations

import ctypes
import importlib.util
from dataclasses import dataclass

from eagle_deploy.common.cli_args import BACKEND_NAMES

BACKEND_CHOICES = ("auto", *BACKEND_NAMES)
CUDA_PROVIDER = "CUDAExecutionProvider"


@dataclass(frozen=True)
class Host:
    """What this machine offers. gpus: CUDA devices visible to this process (after
    CUDA_VISIBLE_DEVICES); ort_providers: onnxruntime's available execution providers;
    tensorrt: whether the `tensorrt` Python package is importable."""

    gpus: int = 0
    ort_providers: tuple[str, ...] = ("CPUExecutionProvider",)
    tensorrt: bool = False


def cuda_device_count() -> int:
    """CUDA devices the driver reports (cuInit + cuDeviceGetCount through libcuda); 0 when
    there is no driver library or it fails (e.g. a machine without a GPU)."""
    for name in ("libcuda.so.1", "libcuda.so"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        count = ctypes.c_int(0)
        if lib.cuInit(0) != 0 or lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
            return 0
        return int(count.value)
    return 0


def probe_host() -> Host:
    """The real Host of this process (imports onnxruntime)."""
    try:
        import onnxruntime

        providers = tuple(onnxruntime.get_available_providers())
    except ImportError:
        providers = ()
    return Host(gpus=cuda_device_count(), ort_providers=providers,
                tensorrt=importlib.util.find_spec("tensorrt") is not None)


def select_backend(requested: str, manifest, host: Host) -> tuple[str, str]:
    """-> (backend, reason): the backend to load for an export whose Manifest is `manifest`
    on `host`, and one line saying why. requested: one of BACKEND_CHOICES.
    Raises ValueError for an unknown name, or a named backend this host or export cannot run
    (the message says what is missing)."""
    if requested not in BACKEND_CHOICES:
        raise ValueError(f"backend must be one of {', '.join(BACKEND_CHOICES)}, got {requested!r}")
    has_trt = manifest.engines.trt is not None
    cuda_ep = CUDA_PROVIDER in host.ort_providers
    if requested == "auto":
        if has_trt and host.gpus and host.tensorrt:
            return "trt", f"auto: the export has TensorRT engines and {host.gpus} GPU(s) are visible"
        if host.gpus and cuda_ep:
            why = "; TensorRT engines exist but tensorrt does not import" if has_trt and not host.tensorrt else ""
            return "ort-cuda", f"auto: {host.gpus} GPU(s) and onnxruntime's {CUDA_PROVIDER}{why}"
        if host.gpus:
            return "ort", (f"auto: {host.gpus} GPU(s) visible but onnxruntime has no {CUDA_PROVIDER} "
                           "(install onnxruntime-gpu)")
        return "ort", "auto: no CUDA GPU visible"
    if requested in ("ort-cuda", "trt") and not host.gpus:
        raise ValueError(f"backend {requested!r} needs a CUDA GPU and none is visible to this model instance")
    if requested == "ort-cuda" and not cuda_ep:
        raise ValueError(f"backend 'ort-cuda' needs onnxruntime-gpu ({CUDA_PROVIDER} is not available)")
    if requested == "trt":
        if not has_trt:
            raise ValueError("backend 'trt' needs TensorRT engines in the export "
                             "(re-export with eagle-export --backend trt)")
        if not host.tensorrt:
            raise ValueError("backend 'trt' needs the tensorrt Python package, which does not import here")
    return requested, "named by the model's backend parameter"
