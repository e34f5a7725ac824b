"""The `Backend` protocol: one compiled graph (target or draft) behind one small contract.

A backend runs one forward of a graph that follows `eagle_deploy.contract.onnx_io`: it
reads the first `past` rows of a `KVBuffer` as the past KV and writes the new rows straight
into that buffer at row `past`. Inputs are a `StepInputs`; outputs come back typed
(`TargetOutputs` / `DraftOutputs`, built from the contract's output names by
`outputs_from_named`). Implementations: `ort.OrtBackend` (onnxruntime CPU),
`ort_cuda.OrtCudaBackend` (CUDA execution provider), `trt.TrtBackend` (TensorRT),
`eagle_deploy.validate.torch_backend.TorchBackend` (the PyTorch reference, for tests and
`eagle-validate`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

import numpy as np

from eagle_deploy.contract import onnx_io as c

from ..kv import KVBuffer


@dataclass
class StepInputs:
    """Host inputs of one forward: batch 1 for one request, batch B for the rows of a batched
    forward (`runtime.batch`; only backends whose `allocate_kv` takes a batch run those).

    input_ids [B, S] int64; position_ids [B, S] int64; attention_mask [B, S, past + S] bool;
    logits_indices [B, N] int64; features [B, S, H] (draft graph only, the graph's dtype).
    EAGLE-3 draft graph: tapped_features [B, T, n*H_target] for the first T rows and features
    [B, S - T, H] for the rest (either may have 0 rows; contract "EAGLE-3 exports").
    prefill: a prompt's rows (causal, at any past; Decoder.prefill_rows), which a batching
    engine runs apart from the decoding forwards (runtime.batch); no graph input.
    """

    input_ids: np.ndarray
    position_ids: np.ndarray
    attention_mask: np.ndarray
    logits_indices: np.ndarray
    features: np.ndarray | None = None
    tapped_features: np.ndarray | None = None
    prefill: bool = False

    def check_single(self, backend: str) -> None:
        """ValueError unless this is one sequence (batch 1): for backends without batched forwards."""
        if self.input_ids.shape[0] != 1:
            raise ValueError(f"{backend} runs one sequence per forward (batch 1), got a batch of "
                             f"{self.input_ids.shape[0]}: batched decoding needs the onnxruntime CPU backend")

    def feeds(self) -> dict[str, np.ndarray]:
        """The inputs by contract name (features / tapped_features only when given)."""
        out = {c.INPUT_IDS: self.input_ids, c.POSITION_IDS: self.position_ids,
               c.ATTENTION_MASK: self.attention_mask, c.LOGITS_INDICES: self.logits_indices}
        if self.features is not None:
            out[c.FEATURES] = self.features
        if self.tapped_features is not None:
            out[c.TAPPED_FEATURES] = self.tapped_features
        return out

    def check(self, past: int) -> None:
        """Raise ValueError on shapes that disagree with each other or with `past`."""
        B, S = self.input_ids.shape
        if B < 1 or self.position_ids.shape != self.input_ids.shape:
            raise ValueError(f"input_ids {self.input_ids.shape} / position_ids {self.position_ids.shape} "
                             "must both be [B, S]")
        if self.attention_mask.shape != (B, S, past + S):
            raise ValueError(f"attention_mask is {self.attention_mask.shape}, expected ({B}, {S}, {past + S})")
        if (self.logits_indices.ndim != 2 or self.logits_indices.shape[0] != B or np.any(self.logits_indices >= S)
                or np.any(self.logits_indices < 0)):
            raise ValueError(f"logits_indices must be [{B}, N] with values in [0, {S})")
        if any(a is not None and a.shape[0] != B for a in (self.features, self.tapped_features)):
            raise ValueError(f"features / tapped_features must have batch {B}")
        rows = sum(a.shape[1] for a in (self.features, self.tapped_features) if a is not None)
        if (self.features is not None or self.tapped_features is not None) and rows != S:
            raise ValueError(f"features / tapped_features hold {rows} rows for {S} tokens")

    def check_causal(self, past: int) -> None:
        """Raise ValueError when a new token may attend to a later new token. Graphs with the
        "shared" KV layout (fused GroupQueryAttention) apply a causal mask over the new tokens on
        top of `attention_mask`, so such a mask would be silently cut; trees in tree order
        (ancestors first) never need it."""
        if self.attention_mask.shape[1] == 1:  # one new token: nothing later to look at
            return
        new = self.attention_mask[:, :, past:]
        if np.triu(new, k=1).any():
            _, i, j = np.argwhere(np.triu(new, k=1))[0]
            raise ValueError(f"attention_mask lets new token {i} attend to the later new token {j}: this graph's "
                             "fused attention is causal over the new tokens (list tree nodes after their ancestors)")


def feature_inputs(features: np.ndarray, from_target: bool,
                   eagle3_widths: tuple[int, int] | None) -> tuple[np.ndarray, np.ndarray | None]:
    """(features, tapped_features) for a draft forward whose rows carry `features` [1, S, F]:
    (features, None) for an EAGLE-1/2 graph; for an EAGLE-3 one (`eagle3_widths` = (head
    hidden, tapped width)) the rows go to `tapped_features` when `from_target` (the target's
    taps, an extension) and to `features` otherwise (the head's own, an expansion), the other
    input with 0 rows (contract "EAGLE-3 exports")."""
    if eagle3_widths is None:
        return features, None
    own, taps = eagle3_widths
    empty = np.zeros((1, 0, own if from_target else taps), features.dtype)
    return (empty, features) if from_target else (features, empty)


def check_step(inputs: StepInputs, kv: KVBuffer, past: int, kv_layout: str, repeats_one_row: bool = False) -> None:
    """The checks every backend makes before a forward: input shapes against `past`, the rows
    the graph writes, [past, past + S) (one more for a one-token call of a graph that repeats
    one-row queries: contract rows_written), fit `kv`, `kv` holds as many sequences as the
    batch, the buffer has the graph's KV layout, and for the "shared" layout
    (fused attention, causal over the new tokens) no new token looks at a later one.
    Raises CapacityError or ValueError naming the problem."""
    inputs.check(past)
    kv.check(past, c.rows_written(inputs.input_ids.shape[1], repeats_one_row))
    if kv.batch != inputs.input_ids.shape[0]:
        raise ValueError(f"a batch of {inputs.input_ids.shape[0]} rows on a KV buffer of {kv.batch} sequences")
    if kv.layout != kv_layout:
        raise ValueError(f"KV buffer layout {kv.layout!r} differs from the graph's {kv_layout!r}: "
                         "allocate it with this backend's allocate_kv()")
    if kv_layout == c.KV_SHARED:
        inputs.check_causal(past)


def _named(self) -> dict[str, np.ndarray]:
    """The outputs by contract name (optional ones only when present)."""
    fields = {**self.NAMES, **self.OPTIONAL}
    return {name: getattr(self, field) for field, name in fields.items() if getattr(self, field) is not None}


@dataclass(frozen=True)
class TargetOutputs:
    """Host outputs of one target-graph forward (batch B = 1, S new tokens, N = logits_indices).

    logits [B, N, V] float32; features [B, S, H] in the graph dtype (float32 on the host for
    bfloat16 graphs); tapped_features [B, S, n*H] (EAGLE-3 exports only, else None). Arrays
    may be the backend's reused buffers: copy what must outlive the next call.
    """

    logits: np.ndarray
    features: np.ndarray
    tapped_features: np.ndarray | None = None

    NAMES: ClassVar[dict[str, str]] = {"logits": c.LOGITS, "features": c.FEATURES}  # field -> contract output name
    OPTIONAL: ClassVar[dict[str, str]] = {"tapped_features": c.TAPPED_FEATURES}

    @property
    def draft_features(self) -> np.ndarray:
        """What the draft head is fed from these rows: the tapped features of an EAGLE-3 export,
        else the final features."""
        return self.features if self.tapped_features is None else self.tapped_features

    named = _named


@dataclass(frozen=True)
class DraftOutputs:
    """Host outputs of one draft-graph forward (B = 1, S rows, N = logits_indices, K = graph_top_k).

    next_features [B, S, H] in the graph dtype (float32 on the host for bfloat16 graphs);
    topk_logprobs [B, N, K] float32, descending; topk_ids [B, N, K] int64. Arrays may be the
    backend's reused buffers: copy what must outlive the next call.
    """

    next_features: np.ndarray
    topk_logprobs: np.ndarray
    topk_ids: np.ndarray

    NAMES: ClassVar[dict[str, str]] = {"next_features": c.NEXT_FEATURES, "topk_logprobs": c.TOPK_LOGPROBS,
                                       "topk_ids": c.TOPK_IDS}
    OPTIONAL: ClassVar[dict[str, str]] = {}

    named = _named


StepOutputs = TargetOutputs | DraftOutputs


def outputs_from_named(named: dict) -> StepOutputs:
    """Non-KV graph outputs by contract name (`present.*` entries are ignored) -> the typed
    outputs of that graph: TargetOutputs when `logits` is there, else DraftOutputs. Raises
    ValueError naming a missing output."""
    kind = TargetOutputs if c.LOGITS in named else DraftOutputs
    missing = [name for name in kind.NAMES.values() if name not in named]
    if missing:
        raise ValueError(f"graph outputs {sorted(named)} lack {', '.join(missing)} for {kind.__name__}")
    optional = {field: named[name] for field, name in kind.OPTIONAL.items() if name in named}
    return kind(**{field: named[name] for field, name in kind.NAMES.items()}, **optional)


@runtime_checkable
class Backend(Protocol):
    """One graph, ready to run.

    name: e.g. "ort-cpu". kv_names: [(past input, present output)] in graph order.
    """

    name: str
    kv_names: list[tuple[str, str]]

    def allocate_kv(self, capacity: int) -> KVBuffer:
        """Allocate this graph's KV buffer once: `capacity` rows per layer and kind. A backend
        that runs batched forwards (runtime.batch; onnxruntime CPU) also takes `batch=N` for N
        sequences in one buffer."""
        ...

    def run(self, inputs: StepInputs, kv: KVBuffer, past: int) -> StepOutputs:
        """One forward over `inputs` with KV rows [0, past) as the past; writes the new rows at
        [past, past + S). Returns the non-KV outputs as host arrays (`TargetOutputs` for the
        target graph, `DraftOutputs` for the draft graph), valid until the next call. Raises
        CapacityError if the rows do not fit."""
        ...


def resolve_shape(spec_shape, sizes: dict[str, int]) -> tuple[int, ...]:
    """Contract shape (ints and symbols) -> concrete shape using `sizes` for the symbols."""
    return tuple(d if isinstance(d, int) else sizes[d] for d in spec_shape)
