"""Checkpoint provenance: which checkpoints an export is made from, what its manifest
records of them (`sources`: paths, specs, weight sha256s; the EOS ids), and those checkpoints
found and loaded again from the manifest, for eagle-validate's PyTorch reference, eagle-bench's
baselines and eagle-train's --answers-from.

    weight_digests(checkpoint.source)                 # {file: sha256}, as `sources` records them
    eos_ids(hf_dir, config, tokenizer)                # the EOS ids a manifest records
    hf = load_target(checkpoint)                      # a resolved checkpoint, fp32, eval
    hf_dir = target_checkpoint_dir(manifest)          # converted HF folder (GGUF sources: cached)
    hf = load_reference_target(manifest)              # the export's target, fp32, eval
    head, note = load_reference_head(manifest, hf)    # EagleHead or Eagle3Head bound to hf

Imports nothing heavy at module level (eagle-validate's --help imports ReferenceLoadError).
"""
from __future__ import annotations

from pathlib import Path

from eagle_deploy.contract.errors import first_line
from eagle_deploy.contract.verify import sha256_file

from .models import Checkpoint, convert_gguf, resolve_draft, resolve_model


class ReferenceLoadError(FileNotFoundError):
    """The checkpoint named in the manifest is not on this machine."""


# --- what an export records of its checkpoints ---------------------------------------------

def weight_digests(path: Path) -> dict:
    """sha256 of a checkpoint file, or of each weight file of a folder."""
    if path.is_file():
        return {path.name: sha256_file(path)}
    files = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".gguf") and p.is_file())
    return {p.name: sha256_file(p) for p in files}


def eos_ids(hf_dir: Path, config, tokenizer) -> list[int]:
    """The checkpoint's end-of-sequence ids, each once, in this order: generation_config.json's
    eos_token_id (what the model was tuned to stop on), then `config`'s, then `tokenizer`'s
    (either may be None). The manifest records them; eagle-train stops its answers on them."""
    from transformers import GenerationConfig

    ids: list[int] = []
    try:
        gen = GenerationConfig.from_pretrained(str(hf_dir)).eos_token_id
    except OSError:
        gen = None
    for value in (gen, getattr(config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, int) and v not in ids:
                ids.append(v)
    return ids


def load_target(checkpoint: Checkpoint):
    """The checkpoint's transformers model (fp32, CPU, eval mode, no checkpoint code run).
    UnsupportedModelError, naming the folder, when it cannot be loaded."""
    import torch
    from transformers import AutoModelForCausalLM

    from .target import UnsupportedModelError, supported_families

    try:
        model = AutoModelForCausalLM.from_pretrained(str(checkpoint.hf_dir), dtype=torch.float32,
                                                     trust_remote_code=False)
    except Exception as err:  # missing, truncated or corrupt weights: one clear message
        raise UnsupportedModelError(
            f"cannot load the checkpoint in {checkpoint.hf_dir} ({type(err).__name__}: {first_line(err)}); "
            f"expected a complete "
            f"Hugging Face checkpoint (config.json + weights) of a supported family: {supported_families()}") from None
    return model.eval()


# --- the checkpoints found again from a manifest --------------------------------------------

def target_source(manifest) -> Path | None:
    """The file or folder the export was made from (a .gguf file, an HF folder), if known."""
    path = manifest.sources.target.path
    return Path(path) if path else None


def target_checkpoint_dir(manifest) -> Path:
    """The transformers folder of the export's target. GGUF sources go through
    `exporter.models.convert_gguf` (cached after the first conversion)."""
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
    for name, digest in sorted(recorded.items()):
        path = folder / name
        if not path.is_file():
            raise ReferenceLoadError(f"the draft head {folder} no longer has {name}, which the export was made from: "
                                     "restore that head, or re-export from the new one")
        if sha256_file(path) != digest:
            raise ReferenceLoadError(
                f"the draft head {folder} changed since the export was made ({name} has another sha256 than the "
                "manifest's sources.draft): eagle-validate compares an export with the head it was made from; "
                "restore that head, or re-export from the new one")
    return folder


def load_reference_head(manifest, hf):
    """(EagleHead or Eagle3Head bound to `hf`, note). An untrained export's head is
    regenerated with random_head(seed=0), as eagle-export made it."""
    from eagle_deploy.heads.api import load_head, random_head

    head_dir = head_dir_of(manifest)
    if head_dir is None:
        return random_head(hf, seed=0), "draft head: random_head(seed=0), regenerated (the export's head is untrained)"
    return load_head(head_dir, hf), f"draft head: {head_dir}"
