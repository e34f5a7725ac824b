"""The `Backend` protocol: one compiled graph (target or draft) behind one small contract.

A backend runs one forward of a graph that follows `eagle_deploy.contract.onnx_io`: it
reads the first `past` rows of a `KVBuffer` as the past KV and writes the new rows straight
into that buffer at row `past`. Implementations: `ort.OrtBackend` (onnxruntime, CPU or CUDA
execution provider), `trt.TrtBackend` (TensorRT), `torch_ref.TorchBackend` (the PyTorch
reference, for tests and `eagle-validate`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from ..kv import KVBuffer

DTYPES = {"float32": np.float32, "float16": np.float16, "bool": np.bool_, "int64": np.int64, "int32": np.int32}


@dataclass
class StepInputs:
    """Host inputs of one forward (batch 1).

    input_ids [1, S] int64; position_ids [1, S] int64; attention_mask [1, S, past + S] bool;
    logits_indices [1, N] int64; features [1, S, H] (draft graph only, the graph's dtype).
    """

    input_ids: np.ndarray
    position_ids: np.ndarray
    attention_mask: np.ndarray
    logits_indices: np.ndarray
    features: np.ndarray | None = None

    def feeds(self) -> dict[str, np.ndarray]:
        from eagle_deploy.contract import onnx_io as c

        out = {c.INPUT_IDS: self.input_ids, c.POSITION_IDS: self.position_ids,
               c.ATTENTION_MASK: self.attention_mask, c.LOGITS_INDICES: self.logits_indices}
        if self.features is not None:
            out[c.FEATURES] = self.features
        return out

    def check(self, past: int) -> None:
        """Raise ValueError on shapes that disagree with each other or with `past`."""
        S = self.input_ids.shape[1]
        if self.input_ids.shape[0] != 1 or self.position_ids.shape != self.input_ids.shape:
            raise ValueError(f"input_ids {self.input_ids.shape} / position_ids {self.position_ids.shape} must both be [1, S]")
        if self.attention_mask.shape != (1, S, past + S):
            raise ValueError(f"attention_mask is {self.attention_mask.shape}, expected (1, {S}, {past + S})")
        if self.logits_indices.ndim != 2 or np.any(self.logits_indices >= S) or np.any(self.logits_indices < 0):
            raise ValueError(f"logits_indices must be [1, N] with values in [0, {S})")


@runtime_checkable
class Backend(Protocol):
    """One graph, ready to run.

    name: e.g. "ort-cpu". kv_names: [(past input, present output)] in graph order.
    """

    name: str
    kv_names: list[tuple[str, str]]

    def allocate_kv(self, capacity: int) -> KVBuffer:
        """Allocate this graph's KV buffer once: `capacity` rows per layer and kind."""
        ...

    def run(self, inputs: StepInputs, kv: KVBuffer, past: int) -> dict[str, np.ndarray]:
        """One forward over `inputs` with KV rows [0, past) as the past; writes the new rows at
        [past, past + S). Returns the non-KV outputs by contract name as host arrays, valid
        until the next call. Raises CapacityError if the rows do not fit."""
        ...


def resolve_shape(spec_shape, sizes: dict[str, int]) -> tuple[int, ...]:
    """Contract shape (ints and symbols) -> concrete shape using `sizes` for the symbols."""
    return tuple(d if isinstance(d, int) else sizes[d] for d in spec_shape)
