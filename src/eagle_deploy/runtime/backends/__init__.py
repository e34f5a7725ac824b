"""Backends by name. TensorRT and the CUDA execution provider are imported only when asked for."""
from __future__ import annotations

from pathlib import Path

from .base import Backend, DraftOutputs, StepInputs, StepOutputs, TargetOutputs

BACKENDS = ("ort", "ort-cuda", "trt")


def load_backend(kind: str, folder: Path, manifest, which: str, threads: int | None = None, tree=None) -> Backend:
    """Open graph `which` ("target" or "draft") of an export with backend `kind`. `tree`
    (a TreeConfig; default the manifest's) lets TensorRT reject a tree too large for its
    optimization profiles at start-up."""
    graph = getattr(manifest, which)
    if kind == "ort":
        from .ort import OrtBackend

        return OrtBackend(folder, graph, manifest.dims, threads=threads)
    if kind == "ort-cuda":
        from .ort_cuda import OrtCudaBackend

        return OrtCudaBackend(folder, graph, manifest.dims, threads=threads)
    if kind == "trt":
        from .trt import TrtBackend

        return TrtBackend.from_manifest(folder, manifest, which, tree=tree)
    raise ValueError(f"unknown backend {kind!r}; choose one of {', '.join(BACKENDS)}")


__all__ = ["Backend", "StepInputs", "StepOutputs", "TargetOutputs", "DraftOutputs", "load_backend", "BACKENDS"]
