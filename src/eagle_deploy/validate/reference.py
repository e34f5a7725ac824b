"""The checkpoints an export came from, read back from its manifest (`sources`): the
transformers target (for eagle-validate's PyTorch reference and eagle-bench's HF baselines)
and the draft head.

    hf_dir = target_checkpoint_dir(manifest)          # converted HF folder (GGUF sources: cached)
    hf = load_reference_target(manifest)              # LlamaForCausalLM, fp32, eval
    head, note = load_reference_head(manifest, hf)    # EagleHead bound to hf
"""
from __future__ import annotations

import math
from pathlib import Path


class ReferenceLoadError(FileNotFoundError):
    """The checkpoint named in the manifest is not on this machine."""


def target_source(manifest) -> Path | None:
    """The file or folder the export was made from (a .gguf file, an HF folder), if known."""
    path = manifest.sources.target.path
    return Path(path) if path else None


def target_checkpoint_dir(manifest) -> Path:
    """The transformers folder of the export's target. GGUF sources go through
    `exporter.models.convert_gguf` (cached after the first conversion)."""
    from eagle_deploy.exporter.models import convert_gguf, resolve_model

    src = manifest.sources.target
    path = target_source(manifest)
    if path is not None and path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path)
    if path is not None and path.is_dir():
        return path
    if src.spec:
        try:
            return resolve_model(src.spec).hf_dir
        except Exception as err:  # ModelNotAvailableError, UnsupportedModelError: one message
            raise ReferenceLoadError(f"the export's target {src.path or src.spec} is not available: {err}") from None
    raise ReferenceLoadError("the manifest names no target checkpoint (sources.target)")


def memory_needed(manifest, folder: Path, graphs=("target", "draft")) -> tuple[int, str]:
    """(bytes, breakdown) eagle-validate needs at once: the PyTorch reference in fp32 (every
    checkpoint tensor x 4 bytes, read from the file headers) plus the files of the graphs it
    opens with onnxruntime (their data and shared.data, which onnxruntime loads)."""
    from eagle_deploy.exporter.weights import CheckpointWeights

    weights = CheckpointWeights(target_checkpoint_dir(manifest))
    params = sum(math.prod(shape) for shape in weights.shapes.values())
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


def load_reference_target(manifest):
    """The export's target as a transformers model (fp32, CPU, eval mode)."""
    import torch
    from transformers import AutoModelForCausalLM

    hf_dir = target_checkpoint_dir(manifest)
    return AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()


def head_dir_of(manifest) -> Path | None:
    """The head folder named in the manifest (path, else the spec resolved again), or None
    for a random head. Raises ReferenceLoadError when it is missing, or when its weight files are
    not the ones the export was made from (sha256 against `sources.draft.sha256`: a head
    retrained or replaced in place would otherwise be reported as a wrong export)."""
    from eagle_deploy.exporter.models import resolve_draft

    src = manifest.sources.draft
    if src.path and Path(src.path).is_dir():
        return check_head_unchanged(Path(src.path), src.sha256)
    if not manifest.draft.trained:
        return None
    try:
        found = resolve_draft(src.spec)
    except Exception as err:
        raise ReferenceLoadError(f"the export's draft head {src.path or src.spec} is not available: {err}") from None
    if found is None:
        raise ReferenceLoadError(f"the export's trained draft head {src.path or src.spec} is not on this machine")
    return check_head_unchanged(found, src.sha256)


def check_head_unchanged(folder: Path, recorded) -> Path:
    """`folder` when each weight file recorded at export time ({name: sha256}) is there with
    the same sha256; ReferenceLoadError naming the first that differs or is missing."""
    from eagle_deploy.contract.verify import sha256_file

    for name, digest in sorted(recorded.items()):
        path = folder / name
        if not path.is_file():
            raise ReferenceLoadError(f"the draft head {folder} no longer has {name}, which the export was made from: "
                                 "restore that head, or re-export from the new one")
        if sha256_file(path) != digest:
            raise ReferenceLoadError(f"the draft head {folder} changed since the export was made ({name} has another "
                                 "sha256 than the manifest's sources.draft): eagle-validate compares an export with "
                                 "the head it was made from; restore that head, or re-export from the new one")
    return folder


def load_reference_head(manifest, hf):
    """(EagleHead or Eagle3Head bound to `hf`, note). An untrained export's head is
    regenerated with random_head(seed=0), as eagle-export made it."""
    from eagle_deploy.heads.api import load_head, random_head

    head_dir = head_dir_of(manifest)
    if head_dir is None:
        return random_head(hf, seed=0), "draft head: random_head(seed=0), regenerated (the export's head is untrained)"
    return load_head(head_dir, hf), f"draft head: {head_dir}"


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
            "draft": TorchBackend(draft, 1, head.dims, name="torch-draft")}


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
