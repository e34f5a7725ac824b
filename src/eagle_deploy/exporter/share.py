"""One copy of the weights the draft graph takes from its target.

    share_weights   export folder + both graph entries -> the shared tensors moved out of
                    target.onnx and draft.onnx into one external-data file, `shared.data`,
                    that both graphs (and a prefill graph) reference; returns the manifest record

A draft initializer is shared when it is byte-identical to a target initializer and
vocabulary-sized (one dimension a multiple of the vocabulary): the token embedding always
(the draft's `Gather` table is the target's), and the LM head weights when the draft
vocabulary is full (in quantised exports the same MatMulNBits blobs and scales, quantised the
same way). Small constants that happen to be equal (RoPE's rotate-half matrix) are left alone.
Runs after quantisation, on the finished graphs, so it works for any head kind without
knowing its tensor names. An export's prefill graph (exporter/prefill.py) references the shared
tensors it holds byte-identical too (the fp32 token embedding; its int8 LM head is its own).
See contract/onnx_io.py ("Shared weights", "Prefill graph").
"""
from __future__ import annotations

import hashlib
from pathlib import Path

from eagle_deploy.contract.manifest import GraphEntry, SharedTensor, SharedWeights
from eagle_deploy.contract.onnx_io import SHARED_ALIGNMENT, SHARED_WEIGHTS_FILE

from .external_data import save_graph, set_external, tensor_bytes

GATHER_OPS = ("Gather", "GatherBlockQuantized")


def _vocab_sized(tensor, vocab: int) -> bool:
    return any(d > 0 and d % vocab == 0 for d in tensor.dims)


def matching_tensors(target_model, draft_model, vocab: int,
                     folder: Path | None = None) -> list[tuple[str, object, object]]:
    """[(role, target tensor, draft tensor)] for every vocabulary-sized draft initializer that
    is byte-identical to a target initializer; role "embedding" when the target gathers rows
    from it, else "lm_head". The graphs' tensors need not be loaded (their external data is
    in `folder`): candidates are read one at a time."""
    gathered = {n.input[0] for n in target_model.graph.node if n.op_type in GATHER_OPS}
    candidates: dict[tuple, list] = {}
    for t in target_model.graph.initializer:
        if _vocab_sized(t, vocab):
            candidates.setdefault((t.data_type, tuple(t.dims)), []).append(t)
    found, used = [], set()
    for d in draft_model.graph.initializer:
        if not _vocab_sized(d, vocab):
            continue
        d_digest = None
        for t in candidates.get((d.data_type, tuple(d.dims)), []):
            if t.name in used:
                continue
            d_digest = d_digest or hashlib.sha256(tensor_bytes(d, folder)).digest()
            if hashlib.sha256(tensor_bytes(t, folder)).digest() == d_digest:
                found.append(("embedding" if t.name in gathered else "lm_head", t, d))
                used.add(t.name)
                break
    return found


def _same_bytes(model, kinds: set[tuple], folder: Path) -> dict[tuple, list]:
    """{(data type, dims, sha256 digest): [initializer]} of `model`'s initializers whose
    (data type, dims) is one of `kinds` (read one at a time; no other one is read)."""
    found: dict[tuple, list] = {}
    for t in model.graph.initializer:
        if (t.data_type, tuple(t.dims)) in kinds:
            key = (t.data_type, tuple(t.dims), hashlib.sha256(tensor_bytes(t, folder)).digest())
            found.setdefault(key, []).append(t)
    return found


def share_weights(folder: Path, target: GraphEntry, draft: GraphEntry, vocab: int,
                  external_data: str = "auto", prefill: GraphEntry | None = None) -> SharedWeights | None:
    """Move the tensors `draft` shares with `target` (see matching_tensors) into
    `folder/shared.data` and rewrite both graphs to reference it (their other weights stay
    inline, or in their own `<graph>.data` as `external_data` decides), one tensor at a time;
    with `prefill` (the prefill graph's entry), that graph's initializers byte-identical to a
    shared tensor are pointed at it too (SharedTensor.prefill_name). Returns the manifest
    record, or None when the graphs share nothing (nothing is rewritten then)."""
    import onnx
    from onnx.helper import tensor_dtype_to_np_dtype

    folder = Path(folder)
    target_model = onnx.load(str(folder / target.path), load_external_data=False)
    draft_model = onnx.load(str(folder / draft.path), load_external_data=False)
    matches = matching_tensors(target_model, draft_model, vocab, folder)
    if not matches:
        return None
    prefill_model = onnx.load(str(folder / prefill.path), load_external_data=False) if prefill is not None else None
    kinds = {(t.data_type, tuple(t.dims)) for _, t, _ in matches}  # what the prefill graph could share
    in_prefill = _same_bytes(prefill_model, kinds, folder) if prefill_model is not None else {}
    records, offset, digest = [], 0, hashlib.sha256()
    with open(folder / SHARED_WEIGHTS_FILE, "wb") as f:
        for role, t, d in matches:
            data = tensor_bytes(t, folder)
            pad = -offset % SHARED_ALIGNMENT
            f.write(b"\0" * pad)
            digest.update(b"\0" * pad)
            offset += pad
            f.write(data)
            digest.update(data)
            same = in_prefill.get((t.data_type, tuple(t.dims), hashlib.sha256(data).digest()), [])
            p = same.pop(0) if same else None
            for tensor in (t, d) + ((p,) if p is not None else ()):
                set_external(tensor, SHARED_WEIGHTS_FILE, offset, len(data))
            records.append(SharedTensor(role=role, target_name=t.name, draft_name=d.name,
                                        prefill_name=p.name if p is not None else None,
                                        dtype=str(tensor_dtype_to_np_dtype(t.data_type)), shape=tuple(t.dims),
                                        offset=offset, length=len(data)))
            offset += len(data)
            del data
    save_graph(target_model, folder / target.path, folder, external_data, keep=(SHARED_WEIGHTS_FILE,))
    save_graph(draft_model, folder / draft.path, folder, external_data, keep=(SHARED_WEIGHTS_FILE,))
    if prefill_model is not None:
        save_graph(prefill_model, folder / prefill.path, folder, external_data, keep=(SHARED_WEIGHTS_FILE,))
    return SharedWeights(file=SHARED_WEIGHTS_FILE, size=offset, tensors=tuple(records), sha256=digest.hexdigest())
