"""eagle-validate's PyTorch reference for an export: the memory it needs, the torch modules
that stand in for each graph (`reference_backends`), the reduced draft vocabulary baked into
the draft graph, and a quantised graph's own weights given to the reference. The checkpoints
it is built from are found through `exporter.sources` (which checkpoint the export came from).
"""
from __future__ import annotations

import math
from pathlib import Path

from eagle_deploy.exporter.sources import ReferenceLoadError, target_checkpoint_dir


def memory_needed(manifest, folder: Path, graphs=("target", "draft")) -> tuple[int, str]:
    """(bytes, breakdown) eagle-validate needs at once: the PyTorch reference in fp32 (every
    checkpoint tensor x 4 bytes, read from the file headers; twice with the prefill graph, which
    gets a copy with its own weights) plus the files of the graphs it opens with onnxruntime
    (their data and shared.data, which onnxruntime loads)."""
    from eagle_deploy.exporter.weights import CheckpointWeights

    weights = CheckpointWeights(target_checkpoint_dir(manifest))
    params = sum(math.prod(shape) for shape in weights.shapes.values()) * (2 if "prefill" in graphs else 1)
    folder = Path(folder)
    files = set()
    for which in graphs:
        path = getattr(manifest, which).path
        files |= {path, path + ".data"}
    if manifest.shared_weights:
        files.add(manifest.shared_weights.file)
    graph_bytes = sum((folder / f).stat().st_size for f in files if (folder / f).exists())
    gib = 2**30
    return 4 * params + graph_bytes, (f"the PyTorch reference in fp32, {params / 1e9:.2f}B parameters x 4 bytes = "
                                      f"{4 * params / gib:.1f} GiB, plus the graphs onnxruntime loads, "
                                      f"{graph_bytes / gib:.1f} GiB")


def check_memory(manifest, folder: Path, graphs=("target", "draft")) -> None:
    """ReferenceLoadError, saying how much memory validation needs, when this machine has less
    available (psutil's `available`) than `memory_needed`; nothing when psutil is missing."""
    try:
        import psutil
    except ImportError:
        return
    need, why = memory_needed(manifest, folder, graphs)
    available = psutil.virtual_memory().available
    if need > available:
        raise ReferenceLoadError(f"eagle-validate needs about {need / 2**30:.1f} GiB ({why}) and this machine has "
                             f"{available / 2**30:.1f} GiB available: validate on a machine with more memory (the "
                             "export streamed its weights; validation holds the whole PyTorch model)")


def draft_vocab_of(manifest, folder):
    """The reduced draft vocabulary ids baked into the draft graph (None = full vocabulary),
    as eagle-export saved them beside the graph."""
    name = manifest.draft.draft_vocab_file
    if not name:
        return None
    import numpy as np
    import torch

    return torch.from_numpy(np.load(Path(folder) / name))


def reference_backends(manifest, hf, head, folder):
    """{"target": TorchBackend, "draft": TorchBackend} over the exporter's own torch modules
    (an EAGLE-3 export: the target with its taps; the draft is `Eagle3Reference`, written
    independently of the exporter's EAGLE-3 module from the same weights)."""
    from eagle_deploy.exporter.draft import ExportableDraft
    from eagle_deploy.heads.eagle3 import Eagle3Head
    from eagle_deploy.validate.eagle3_reference import Eagle3Reference
    from eagle_deploy.validate.torch_backend import TorchBackend

    if isinstance(head, Eagle3Head):
        draft = Eagle3Reference(head, manifest.draft.graph_top_k)
    else:
        draft = ExportableDraft(head, manifest.draft.graph_top_k, draft_vocab_of(manifest, folder))
    return {"target": TorchBackend.target(hf, manifest.target.feature_layers),
            "draft": TorchBackend(draft, head.dims.num_layers, head.dims, name="torch-draft")}


def with_quantised_weights(module, weights, bound: float = 1.01) -> list[str]:
    """Give the torch reference `module` the weights a quantised graph multiplies with.

    `weights`: exporter.quantize.dequantised_weights(graph), [(node, W [N, K], step [N, K])].
    Each node's W replaces, in place, the 2-D parameter (not an nn.Embedding's: the graph's
    embedding Gather stays fp32, also when the LM head is tied to it) that quantises to it,
    i.e. lies within `bound` quantisation steps of W everywhere (round-to-nearest puts the
    source weight within half a step, a clamped extreme within one; another weight of the
    same shape is many steps away). The parameter is replaced, not written into, so a tied
    embedding keeps its fp32 values. A W that no single parameter matches may be several
    parameters packed along N (the fused graph's [W_q; W_k; W_v]): its rows are matched, in
    order, to parameters with the same K, each replaced by its slice. Returns the nodes no
    parameter (or packing of parameters) matched."""
    import numpy as np
    import torch

    slots = {}
    for mod in module.modules():
        if isinstance(mod, torch.nn.Embedding):
            continue
        for pname, p in mod.named_parameters(recurse=False):
            if p.dim() == 2:
                slots.setdefault(tuple(p.shape), []).append((mod, pname))

    def steps_off(mod, pname, w, step, cols=slice(None)):
        p = getattr(mod, pname).detach().cpu().numpy()
        return float((np.abs(p[:, cols] - w[:, cols]) / np.maximum(step[:, cols], 1e-30)).max())

    def match(w, step):
        for mod, pname in slots.get(w.shape, []):
            # the first columns rule out other weights cheaply; then every element is checked
            if steps_off(mod, pname, w, step, slice(0, 32)) <= bound and steps_off(mod, pname, w, step) <= bound:
                return mod, pname
        return None

    def match_packed(w, step):
        """[(slot, row slice)] covering the rows of w with parameters of its K, or None."""
        parts, row = [], 0
        heights = sorted({n for (n, k) in slots if k == w.shape[1] and n < w.shape[0]}, reverse=True)
        while row < w.shape[0]:
            found = next(((slot, slice(row, row + n)) for n in heights if row + n <= w.shape[0]
                          for slot in [match(w[row:row + n], step[row:row + n])] if slot is not None), None)
            if found is None:
                return None
            parts.append(found)
            row = found[1].stop
        return parts

    unmatched = []
    for node, w, step in weights:
        found = match(w, step)
        parts = [(found, slice(None))] if found is not None else match_packed(w, step)
        if parts is None:
            unmatched.append(node)
            continue
        for (mod, pname), rows in parts:
            old = getattr(mod, pname)
            new = torch.nn.Parameter(torch.from_numpy(np.ascontiguousarray(w[rows])).to(old.device, old.dtype),
                                     requires_grad=False)
            setattr(mod, pname, new)
    return unmatched
