"""Dtype names: the one list of contract dtype names (as the manifest and `onnx_io` spell
them), their numpy dtypes, and the command-line spellings of export precisions. Numpy only,
and imported only when a numpy dtype is asked for (so argument parsers can use the names
cheaply). The torch and TensorRT tables are built from `NAMES` where torch / TensorRT are
imported (`runtime.backends.ort_cuda.torch_dtype`, `exporter.steps.TORCH_DTYPES`,
`runtime.backends.trt.TRT_MEMBERS`).
"""
from __future__ import annotations

# every dtype a graph tensor may have, by contract name (numpy, torch and onnx spell them alike)
NAMES = ("float32", "float16", "bfloat16", "int64", "int32", "int8", "uint8", "bool")
# export precisions (the graph dtype T of onnx_io) and their command-line spellings
FLOAT_NAMES = ("float32", "float16", "bfloat16")
CLI_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
ALIASES = {**CLI_NAMES, **{name: name for name in FLOAT_NAMES}}
# numpy has no bfloat16: such tensors are held as float32 on the host
_HOST_NAMES = {**{name: name for name in NAMES}, "bfloat16": "float32"}


def _check(name: str) -> None:
    if name not in _HOST_NAMES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(NAMES)}")


def numpy_dtype(name: str):
    """The exact numpy dtype of contract dtype `name`. Raises TypeError for bfloat16 (numpy
    has none) and ValueError for a name that is not in NAMES."""
    import numpy as np

    _check(name)
    if name == "bfloat16":
        raise TypeError("numpy has no bfloat16: this graph needs a device backend (ort-cuda or trt)")
    return np.dtype(name)


def host_dtype(name: str):
    """The numpy dtype a host array of contract dtype `name` is held in (bfloat16 -> float32).
    Raises ValueError for a name that is not in NAMES."""
    import numpy as np

    _check(name)
    return np.dtype(_HOST_NAMES[name])


def canonical(alias: str) -> str | None:
    """An export precision as given on a command line (fp32, fp16, bf16 or a full name) ->
    its contract name; None when it is not one."""
    return ALIASES.get(alias)
