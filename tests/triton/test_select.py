"""Engine backend selection for a Triton model instance (triton/select.py), on fake hosts: the
GPU branches run here on CPU without a GPU (the GPU path itself has not run)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from eagle_deploy.triton.select import CUDA_PROVIDER, Host, probe_host, select_backend

CPU_ONLY = Host(gpus=0, ort_providers=("CPUExecutionProvider",), tensorrt=False)
GPU_ORT = Host(gpus=1, ort_providers=(CUDA_PROVIDER, "CPUExecutionProvider"), tensorrt=False)
GPU_ALL = Host(gpus=2, ort_providers=(CUDA_PROVIDER, "CPUExecutionProvider"), tensorrt=True)
GPU_NO_EP = Host(gpus=1, ort_providers=("CPUExecutionProvider",), tensorrt=True)


def manifest(trt: bool):
    return SimpleNamespace(engines=SimpleNamespace(trt=object() if trt else None))


@pytest.mark.parametrize("trt, host, want", [
    (True, GPU_ALL, "trt"),
    (True, GPU_ORT, "ort-cuda"),  # engines, GPU, but tensorrt does not import
    (False, GPU_ALL, "ort-cuda"),  # GPU but no engines in the export
    (True, GPU_NO_EP, "trt"),  # TensorRT needs no onnxruntime provider
    (False, GPU_NO_EP, "ort"),  # GPU, no CUDA provider, no engines -> CPU
    (True, CPU_ONLY, "ort"),
    (False, CPU_ONLY, "ort"),
])
def test_auto_prefers_trt_then_cuda_then_cpu(trt, host, want):
    backend, reason = select_backend("auto", manifest(trt), host)
    assert backend == want and reason.startswith("auto:")


@pytest.mark.parametrize("requested, trt, host, message", [
    ("trt", True, CPU_ONLY, "needs a CUDA GPU"),
    ("ort-cuda", False, CPU_ONLY, "needs a CUDA GPU"),
    ("ort-cuda", False, GPU_NO_EP, "onnxruntime-gpu"),
    ("trt", False, GPU_ALL, "eagle-export --backend trt"),
    ("trt", True, GPU_ORT, "tensorrt"),
    ("tensorrt", True, GPU_ALL, "backend must be one of"),
])
def test_named_backend_refused_with_the_reason(requested, trt, host, message):
    with pytest.raises(ValueError, match=message):
        select_backend(requested, manifest(trt), host)


@pytest.mark.parametrize("requested, trt, host", [("ort", True, GPU_ALL), ("ort-cuda", True, GPU_ALL),
                                                  ("trt", True, GPU_ALL), ("ort", False, CPU_ONLY)])
def test_named_backend_taken_when_possible(requested, trt, host):
    assert select_backend(requested, manifest(trt), host)[0] == requested


def test_probe_on_this_machine_is_consistent():
    host = probe_host()
    assert host.gpus >= 0 and "CPUExecutionProvider" in host.ort_providers
    if host.gpus == 0:
        assert select_backend("auto", manifest(True), host)[0] == "ort"
