"""Backends by name. TensorRT and the CUDA execution provider are imported only when asked for."""
from __future__ import annotations

from pathlib import Path

from eagle_deploy.common.cli_args import BACKEND_NAMES

from .base import Backend, DraftOutputs, StepInputs, StepOutputs, TargetOutputs

BACKENDS = BACKEND_NAMES


def load_backend(kind: str, folder: Path, manifest, which: str, threads: int | None = None, tree=None) -> Backend:
    """Open graph `which` ("target", "draft", or "prefill" where the manifest has one) of an
    export with backend `kind`. `tree` (a TreeConfig; default the manifest's) lets TensorRT
    reject a tree too large for its optimization profiles at start-up. Graphs that take weights
    from the export's shared file (manifest.shared_weights) fail with ManifestError when it is
    missing; the CPU backend maps it once for every graph. TensorRT engines hold their own
    weights and do not read it (and exist for "target" and "draft" only). ValueError for a
    graph the export does not have or an unknown backend."""
    graph = getattr(manifest, which)
    if graph is None:
        raise ValueError(f"this export has no {which} graph")
    shared = getattr(manifest, "shared_weights", None)
    if kind == "ort":
        from .ort import OrtBackend

        return OrtBackend(folder, graph, manifest.graph_dims(which), threads=threads, shared=shared, which=which)
    if kind == "ort-cuda" and shared is not None:
        shared.check(folder, which)
    if kind == "ort-cuda":
        from .ort_cuda import OrtCudaBackend

        return OrtCudaBackend(folder, graph, manifest.graph_dims(which), threads=threads)
    if kind == "trt":
        from .trt import TrtBackend

        return TrtBackend.from_manifest(folder, manifest, which, tree=tree)
    raise ValueError(f"unknown backend {kind!r}; choose one of {', '.join(BACKENDS)}")


__all__ = ["Backend", "StepInputs", "StepOutputs", "TargetOutputs", "DraftOutputs", "load_backend", "BACKENDS"]
