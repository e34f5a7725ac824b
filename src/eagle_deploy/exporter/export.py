"""`export()`: a checkpoint and its EAGLE head -> an export folder (graphs, tokenizer,
manifest), written to a private temporary folder and renamed into place only when complete,
so a failed export leaves nothing half-written."""
from __future__ import annotations

import platform
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from eagle_deploy.contract.manifest import Manifest
from eagle_deploy.contract.tree_config import DEFAULT_TREES, TreeConfig

from .draft_head import HEAD_WEIGHT_FILES, TOKEN_COUNTS_FILE, load_head, random_head
from .models import Checkpoint, publish_folder, resolve_draft, resolve_model, sha256_file
from .steps import TORCH_DTYPES, DraftOnnxFromHead, TargetOnnxFromHF, TokenizerFromHF
from .target import UnsupportedModelError, dims_of, supported_families

DRAFT_VOCAB_FILE = "draft_vocab.npy"
DTYPE_ALIASES = {"fp32": "float32", "float32": "float32", "fp16": "float16", "float16": "float16",
                 "bf16": "bfloat16", "bfloat16": "bfloat16"}


@dataclass
class ExportOptions:
    """dtype: float32 | float16 | bfloat16. max_length: KV capacity in rows (prompt + output - 1).
    graph_top_k: top-k computed inside the draft graph. quant: None | "int4" | "int8" (the
    target graph); quant_draft: quantise the draft graph the same way."""

    dtype: str = "float32"
    max_length: int | None = None
    graph_top_k: int = 10
    draft_vocab: int | None = None  # None: the alias default; 0: full vocabulary; N: the N most frequent tokens
    tree: TreeConfig | None = None  # None: DEFAULT_TREES[quant]
    external_data: str = "auto"
    quant: str | None = None
    quant_draft: bool = True  # with quant: quantise the draft graph too
    name: str | None = None
    force: bool = False
    seed: int = 0


def _say(progress, msg: str) -> None:
    if progress:
        progress(msg)


def _hash_weights(path: Path) -> dict:
    """sha256 of a checkpoint file, or of each weight file of a folder."""
    if path.is_file():
        return {path.name: sha256_file(path)}
    files = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".gguf") and p.is_file())
    return {p.name: sha256_file(p) for p in files}


def _tool_versions() -> dict:
    import onnx
    import onnxruntime
    import torch
    import transformers

    try:
        from importlib.metadata import version

        own = version("eagle-deploy")
    except Exception:
        own = "unknown"
    return {"eagle_deploy": own, "torch": torch.__version__, "transformers": transformers.__version__,
            "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__, "python": platform.python_version()}


def _eos_ids(hf_dir: Path, config, tokenizer) -> list[int]:
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


def draft_vocab_ids(head_dir: Path | None, size: int, vocab: int, eos_ids: list[int]):
    """The `size` most frequent response tokens (from the head's `token_counts.npy`, written
    by eagle-train), EOS ids always included, sorted by id; None for the full vocabulary.
    A reduced draft vocabulary only limits what the head can propose (as FR-Spec and EAGLE-3's
    d2t do); verification stays over the full vocabulary, so output stays lossless."""
    import numpy as np
    import torch

    if not size or size >= vocab:
        return None
    counts_path = head_dir / TOKEN_COUNTS_FILE if head_dir else None
    if counts_path is None or not counts_path.exists():
        raise ValueError(f"--draft-vocab needs token frequencies: {TOKEN_COUNTS_FILE} beside the head (eagle-train writes it)")
    counts = np.load(counts_path).astype(np.float64)
    if counts.shape != (vocab,):
        raise ValueError(f"{counts_path} has shape {counts.shape}, expected ({vocab},)")
    counts[[e for e in eos_ids if e < vocab]] = np.inf
    ids = np.sort(np.argsort(-counts, kind="stable")[:size])
    return torch.from_numpy(ids.astype(np.int64))


def load_target(checkpoint: Checkpoint):
    import torch
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(str(checkpoint.hf_dir), dtype=torch.float32, trust_remote_code=False)
    except Exception as err:  # missing, truncated or corrupt weights: one clear message
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UnsupportedModelError(
            f"cannot load the checkpoint in {checkpoint.hf_dir} ({type(err).__name__}: {first}); expected a complete "
            f"Hugging Face checkpoint (config.json + weights) of a supported family: {supported_families()}") from None
    return model.eval()


def check_export_name(name: str) -> str:
    """The export folder name: a plain folder name inside --out (ValueError otherwise)."""
    if not name or name in (".", "..") or name.startswith(".") or "/" in name or "\\" in name or Path(name).is_absolute():
        raise ValueError(f"--name must be a plain folder name inside --out (no path separators, not starting with '.'), got {name!r}")
    return name


def export(model: str, draft: str | None, out_root: Path, options: ExportOptions, progress=print) -> Path:
    """Export `model` (alias, HF folder or .gguf) and its head (`draft`: folder, hub id,
    "random", or None for the alias default) into `out_root/<name>`; returns that folder.

    Raises ModelNotAvailableError, UnsupportedModelError, HeadCheckpointError, ValueError,
    FileExistsError (folder exists and not options.force)."""
    dtype = DTYPE_ALIASES.get(options.dtype)
    if dtype is None:
        raise ValueError(f"--dtype {options.dtype} is not one of fp32, fp16, bf16")
    tree = (options.tree or DEFAULT_TREES[options.quant]).validate(options.graph_top_k)
    if options.quant and dtype != "float32":
        raise ValueError(f"--quant {options.quant} quantises an fp32 graph; drop --dtype {options.dtype}")
    _say(progress, f"resolving {model}")
    checkpoint = resolve_model(model)
    draft_spec = None if draft == "random" else (draft or checkpoint.default_draft)
    head_dir = resolve_draft(draft_spec)
    out = Path(out_root) / check_export_name(checkpoint.name if options.name is None else options.name)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not an export folder; remove it or choose another --name")
    if out.exists() and not options.force:
        raise FileExistsError(f"{out} exists; pass --force to replace it")
    _say(progress, f"loading {checkpoint.hf_dir}")
    hf = load_target(checkpoint)
    dims = dims_of(hf.config)
    max_length = options.max_length or checkpoint.max_length or min(dims.max_position_embeddings, 4096)
    if not 2 <= max_length <= dims.max_position_embeddings:
        raise ValueError(f"--max-length {max_length} must be in [2, {dims.max_position_embeddings}] (max_position_embeddings)")
    head = load_head(head_dir, hf) if head_dir else random_head(hf, seed=options.seed)
    draft_vocab = checkpoint.draft_vocab if options.draft_vocab is None else options.draft_vocab
    if draft_vocab and not options.graph_top_k <= draft_vocab <= dims.vocab:
        raise ValueError(f"--draft-vocab {draft_vocab} must be 0 (full vocabulary) or in [--graph-top-k {options.graph_top_k}, "
                         f"vocabulary size {dims.vocab}]")
    vocab_ids = draft_vocab_ids(head_dir, draft_vocab if head_dir else 0, dims.vocab, _eos_ids(checkpoint.hf_dir, hf.config, None))
    notes = [] if head_dir else ["draft head is RANDOMLY INITIALISED (untrained): expect acceptance near 1 token per round"]
    if dtype != "float32":
        hf.to(TORCH_DTYPES[dtype])
        head.to(TORCH_DTYPES[dtype])
    Path(out_root).mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out_root))
    try:
        _say(progress, f"exporting target graph ({dtype})")
        target_entry = TargetOnnxFromHF(dtype, options.external_data)(hf, tmp)
        _say(progress, "exporting draft graph")
        draft_entry = DraftOnnxFromHead(dtype, options.graph_top_k, vocab_ids, options.external_data)(head, tmp)
        draft_entry.extra["trained"] = head_dir is not None
        if vocab_ids is not None:  # the ids baked into the draft graph, for references and tools
            import numpy as np

            np.save(tmp / DRAFT_VOCAB_FILE, vocab_ids.numpy())
            draft_entry.extra["draft_vocab_file"] = DRAFT_VOCAB_FILE
        tokenizer = TokenizerFromHF()(checkpoint.hf_dir, tmp)
        if options.quant:
            from .quantize import quantize_graph

            _say(progress, f"quantising the target graph ({options.quant})")
            quantize_graph(tmp, target_entry, options.quant, options.external_data)
            notes.append(f"target quantised to {options.quant}: losslessness holds with respect to the quantised target")
            if not target_entry.extra["quant"]["batch_invariant"]:
                notes.append("the quantised matmuls round activations to int8, so a token's logits depend slightly on the other tokens "
                             "of its forward: greedy EAGLE output can part from vanilla greedy at near-ties on this engine")
            if options.quant_draft:  # measured 6-30% faster draft steps with unchanged tau
                _say(progress, f"quantising the draft graph ({options.quant})")
                quantize_graph(tmp, draft_entry, options.quant, options.external_data)
        _say(progress, "hashing sources and writing manifest")
        sources = {
            "target": {"spec": model, "path": str(checkpoint.source), "sha256": _hash_weights(checkpoint.source)},
            "draft": {"spec": draft or checkpoint.default_draft, "path": str(head_dir) if head_dir else None,
                      "sha256": {n: sha256_file(head_dir / n) for n in HEAD_WEIGHT_FILES if head_dir and (head_dir / n).exists()},
                      "trained": head_dir is not None},
        }
        manifest = Manifest(
            name=out.name, dims=dims.to_json(), max_length=int(max_length), target=target_entry, draft=draft_entry,
            tree=tree.to_json(), eos_token_ids=_eos_ids(checkpoint.hf_dir, hf.config, tokenizer),
            tokenizer="tokenizer" if tokenizer is not None else None,
            chat_template=bool(getattr(tokenizer, "chat_template", None)), sources=sources,
            tools=_tool_versions(), notes=notes)
        for entry in (target_entry, draft_entry):
            entry.sha256 = sha256_file(tmp / entry.path)
        manifest.save(tmp)
        publish_folder(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
