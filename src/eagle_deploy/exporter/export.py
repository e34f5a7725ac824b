"""`export()`: a checkpoint and its EAGLE head -> an export folder (graphs, tokenizer,
manifest), written to a private temporary folder and renamed into place only when complete,
so a failed export leaves nothing half-written. While it runs it holds a lock on its
destination (exporter/publish.py), so a second export of the same name fails at once."""
from __future__ import annotations

import platform
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from eagle_deploy.contract.dtypes import CLI_NAMES as CLI_DTYPES
from eagle_deploy.contract.dtypes import canonical as canonical_dtype
from eagle_deploy.contract.manifest import (
    DRAFT_GRAPH_NOTE,
    DRAFT_QUANTS,
    Dims,
    DraftEntry,
    GraphEntry,
    Manifest,
    SharedWeights,
    SourceRecord,
    Sources,
)
from eagle_deploy.contract.onnx_io import KV_SEQ_MAJOR, KV_SHARED, MANIFEST_FILE, TOKENIZER_DIR
from eagle_deploy.contract.tree_config import TreeConfig, default_tree
from eagle_deploy.contract.verify import file_records, sha256_file
from eagle_deploy.heads.api import load_head, random_head
from eagle_deploy.heads.eagle3 import Eagle3Head
from eagle_deploy.heads.files import HEAD_WEIGHT_FILES

from .draft_vocab import default_size as default_draft_vocab
from .draft_vocab import draft_vocab_ids
from .models import Checkpoint, resolve_draft, resolve_model
from .prefill import build_prefill_graph, prefill_graph_wanted
from .publish import destination_lock, partial_prefix, publish_folder, remove_stale_partials
from .sources import eos_ids, weight_digests
from .steps import TORCH_DTYPES, DraftOnnxFromHead, TargetOnnxFromHF, TokenizerFromHF
from .target import dims_of
from .weights import skeleton_target

DRAFT_VOCAB_FILE = "draft_vocab.npy"
PREFILL_NOTE = ("prompts are prefilled by prefill.onnx (int8 weights, per-token int8 activations), decoding and "
                "verification by the int4 target graph; --prefill-graph target (RuntimeOptions prefill_graph) "
                "prefills with the target graph instead")


@dataclass
class ExportOptions:
    """dtype: float32 | float16 | bfloat16. max_length: KV capacity in rows (prompt + output - 1).
    graph_top_k: top-k computed inside the draft graph. quant: None | "int4" | "int8" (the
    target graph); draft_quant: one of DRAFT_QUANTS (`draft_quant_for`); repeat_one_row: one of
    REPEAT_ONE_ROW (`repeat_one_row_for`); prefill_weights: one of prefill.PREFILL_WEIGHTS ("int8":
    an int8 prefill graph beside an int4 target, `prefill.prefill_graph_wanted`)."""

    dtype: str = "float32"
    max_length: int | None = None
    graph_top_k: int = 10
    draft_vocab: int | None = None  # None: the alias's, else draft_vocab.default_size; 0: full vocabulary; N: N tokens
    tree: TreeConfig | None = None  # None: tree_config.default_tree(quant, the draft's quantisation)
    external_data: str = "auto"
    quant: str | None = None
    draft_quant: str = "auto"  # DRAFT_QUANTS: "auto" = quant's kind, else int8 for an fp32 fused export
    name: str | None = None
    force: bool = False
    seed: int = 0
    graph: str = "auto"  # GRAPH_KINDS: "fused" (onnxruntime contrib ops), "standard" (plain ONNX, TensorRT)
    repeat_one_row: str = "auto"  # REPEAT_ONE_ROW: "auto" = on for a quantised fused target graph
    prefill_weights: str = "none"  # prefill.PREFILL_WEIGHTS: "int8" = prefill.onnx beside an int4 target.onnx


# "fused": attention/RoPE/residual norms as onnxruntime contrib operators, KV layout "shared"
# (exporter/fused.py); "standard": plain ONNX operators, KV layout "seq_major" (what TensorRT
# and any other runtime can run); "auto": fused for fp32 graphs, standard otherwise
GRAPH_KINDS = ("auto", "fused", "standard")


def draft_quant_for(options: "ExportOptions", dtype: str, kv_layout: str) -> str | None:
    """The quantisation of the draft graph (None: as exported): "auto" follows options.quant,
    and for an fp32 fused export without one (onnxruntime, where MatMulNBits runs) is int8; the
    standard graph (TensorRT) and fp16/bf16 graphs stay unquantised. ValueError for an unknown
    kind, or a kind asked for a graph that is not fp32.

    The draft only proposes tokens, so this never changes what the target commits (greedy output
    stays the target's own; sampling keeps its distribution), only which tokens are proposed.
    An int8 draft keeps τ and makes draft steps cheaper (docs/decisions.md, 'the draft graph int8
    by default', and 'Draft graph quantisation, the int4 run')."""
    kind = options.draft_quant
    if kind not in DRAFT_QUANTS:
        raise ValueError(f"--draft-quant {kind} is not one of {', '.join(DRAFT_QUANTS)}")
    if kind == "none":
        return None
    if kind != "auto":
        if dtype != "float32":
            raise ValueError(f"--draft-quant {kind} quantises an fp32 draft graph; drop --dtype {options.dtype} "
                             "or use --draft-quant none")
        return kind
    if options.quant:
        return options.quant
    return "int8" if dtype == "float32" and kv_layout == KV_SHARED else None


# whether the fused target graph repeats a one-row query inside its attention (exporter/fused.py,
# "One-row queries"), so row-exact decoding runs one-token forwards as one row: "auto" = with --quant
REPEAT_ONE_ROW = ("auto", "on", "off")


def repeat_one_row_for(options: "ExportOptions", kv_layout: str) -> bool:
    """Whether the target graph repeats one-row queries: options.repeat_one_row "on", or "auto"
    for a quantised target (row-exact decoding, its default, then runs one-token forwards as one
    row; fp32 graphs do not decode row-exact by default and would pay for the repeat), on the
    fused graph only. ValueError for an unknown choice, or "on" with the standard graph."""
    choice = options.repeat_one_row
    if choice not in REPEAT_ONE_ROW:
        raise ValueError(f"--repeat-one-row {choice} is not one of {', '.join(REPEAT_ONE_ROW)}")
    if choice == "on" and kv_layout != KV_SHARED:
        raise ValueError("--repeat-one-row on needs the fused graph (onnxruntime's GroupQueryAttention); this export "
                         "makes the standard one")
    return kv_layout == KV_SHARED and (choice == "on" or (choice == "auto" and bool(options.quant)))


def kv_layout_for(graph: str, dtype: str) -> str:
    """The contract KV layout of the graphs `graph` (GRAPH_KINDS) makes at `dtype`; ValueError
    for fused bfloat16 / float16 (only the fp32 fused graph is tested; onnxruntime's CPU
    GroupQueryAttention has no bfloat16 kernel)."""
    if graph not in GRAPH_KINDS:
        raise ValueError(f"--graph {graph} is not one of {', '.join(GRAPH_KINDS)}")
    if graph == "fused" and dtype != "float32":
        raise ValueError(f"--graph fused is fp32 only (found --dtype {dtype}); use --graph standard")
    return KV_SHARED if graph == "fused" or (graph == "auto" and dtype == "float32") else KV_SEQ_MAJOR


def fused_unsupported(*dims: Dims) -> str | None:
    """Why the fused graph cannot hold a model with these attention geometries (target, head),
    or None: onnxruntime's GroupQueryAttention needs a head dim that is a multiple of 16, and the
    exporter's fused path needs at least 2 KV heads (1 fails at trace time)."""
    for d in dims:
        if d.head_dim % 16:
            return f"head dim {d.head_dim} is not a multiple of 16 (onnxruntime's GroupQueryAttention)"
        if d.num_kv_heads < 2:
            return "a single KV head (multi-query attention) is not traced into the fused graph"
    return None


def _say(progress, msg: str) -> None:
    if progress:
        progress(msg)


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


def check_export_name(name: str) -> str:
    """The export folder name: a plain folder name inside --out (ValueError otherwise)."""
    if (not name or name in (".", "..") or name.startswith(".") or "/" in name or "\\" in name
            or Path(name).is_absolute()):
        raise ValueError("--name must be a plain folder name inside --out (no path separators, "
                         f"not starting with '.'), got {name!r}")
    return name


@dataclass
class ExportPlan:
    """What `export` works from, resolved and checked before anything is written: the specs as
    given, the checkpoint, the head folder (None: a random head), the output folder, the graph
    dtype and the default tree."""

    model: str
    draft: str | None
    checkpoint: Checkpoint
    head_dir: Path | None
    out: Path
    dtype: str
    tree: TreeConfig


@dataclass
class LoadedModels:
    """The torch models of an export (in the graph dtype) and what was derived from them."""

    hf: object  # the target's skeleton (exporter/weights.py): meta parameters but its embedding and LM head
    weights: object  # weights.WeightSource: each target parameter's checkpoint tensor
    head: object
    dims: Dims
    max_length: int
    vocab_ids: object  # torch int64 ids of a reduced draft vocabulary, or None
    vocab_source: str | None = None  # how they were ranked (manifest DRAFT_VOCAB_SOURCES)


def check_options(options: ExportOptions) -> tuple[str, TreeConfig]:
    """(graph dtype, default tree) from `options`, or ValueError / TreeConfigError naming the
    bad option. Needs no model."""
    dtype = canonical_dtype(options.dtype)
    if dtype is None:
        raise ValueError(f"--dtype {options.dtype} is not one of {', '.join(CLI_DTYPES)}")
    if options.quant and dtype != "float32":
        raise ValueError(f"--quant {options.quant} quantises an fp32 graph; drop --dtype {options.dtype}")
    if not isinstance(options.graph_top_k, int) or options.graph_top_k < 1:
        raise ValueError(f"--graph-top-k must be an integer >= 1 (the draft graph's top-k output width), got "
                         f"{options.graph_top_k}")
    layout = kv_layout_for(options.graph, dtype)
    repeat_one_row_for(options, layout)
    prefill_graph_wanted(options.prefill_weights, options.quant)
    return dtype, tree_for(options, dtype, layout)


def tree_for(options: ExportOptions, dtype: str, kv_layout: str) -> TreeConfig:
    """options.tree, else the default tree for the target's and the draft graph's quantisation
    (`default_tree`), validated. Raises ValueError (draft_quant_for) or TreeConfigError."""
    draft = draft_quant_for(options, dtype, kv_layout)
    return (options.tree or default_tree(options.quant, draft)).validate(options.graph_top_k)


def resolve_inputs(model: str, draft: str | None, out_root: Path, options: ExportOptions, progress=None) -> ExportPlan:
    """Check the options, resolve the checkpoint and the head, and the output folder (which must
    not exist unless options.force, and then must be an export folder, holding a manifest, or
    empty: --force never deletes anything else). Raises ValueError, ModelNotAvailableError,
    UnsupportedModelError, HeadCheckpointError, FileExistsError."""
    dtype, tree = check_options(options)
    _say(progress, f"resolving {model}")
    checkpoint = resolve_model(model, progress)
    head_dir = resolve_draft(None if draft == "random" else (draft or checkpoint.default_draft))
    out = Path(out_root) / check_export_name(checkpoint.name if options.name is None else options.name)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not an export folder; remove it or choose another --name")
    if out.exists() and not options.force:
        raise FileExistsError(f"{out} exists; pass --force to replace it")
    if out.exists() and not (out / MANIFEST_FILE).is_file() and any(out.iterdir()):
        raise FileExistsError(f"{out} is a folder with files but no {MANIFEST_FILE}, not an export: --force replaces "
                              "only an export folder; remove it yourself or choose another --name")
    return ExportPlan(model, draft, checkpoint, head_dir, out, dtype, tree)


def check_max_length(requested: int | None, target: Dims, head: Dims) -> int:
    """The KV capacity to export: `requested` (--max-length or the alias's), else
    min(target limit, head limit, 4096). ValueError when it is below 2 or above the target's
    max_position_embeddings, or when an explicit request exceeds the draft head's own (the
    head was never trained at later positions; a default is capped to it instead)."""
    if requested is None:
        return min(target.max_position_embeddings, head.max_position_embeddings, 4096)
    if not 2 <= requested <= target.max_position_embeddings:
        raise ValueError(f"--max-length {requested} must be in [2, {target.max_position_embeddings}] "
                         "(max_position_embeddings)")
    if requested > head.max_position_embeddings:
        limit = head.max_position_embeddings
        raise ValueError(f"--max-length {requested} exceeds the draft head's max_position_embeddings {limit} "
                         f"(its config.json): use --max-length <= {limit} or a head trained for longer contexts")
    return requested


def load_models(plan: ExportPlan, options: ExportOptions, progress=None) -> LoadedModels:
    """Load the target's skeleton (its weights stay in the checkpoint, read one tensor at a time
    when the graph is written: exporter/weights.py) and the head, check the sizes that depend on
    them (max length, draft vocabulary) and cast the head to the graph dtype. Writes nothing."""
    checkpoint, head_dir = plan.checkpoint, plan.head_dir
    _say(progress, f"reading {checkpoint.hf_dir}")
    hf, weights = skeleton_target(checkpoint.hf_dir, TORCH_DTYPES[plan.dtype])
    dims = dims_of(hf.config)
    requested = options.max_length if options.max_length is not None else checkpoint.max_length
    if requested is not None:
        check_max_length(requested, dims, dims)  # the target's range, before the head loads
    head = load_head(head_dir, hf) if head_dir else random_head(hf, seed=options.seed)
    if options.max_length is None and requested is not None:  # an alias default is capped like the computed one
        requested = min(requested, head.dims.max_position_embeddings)
    max_length = check_max_length(requested, dims, head.dims)
    if isinstance(head, Eagle3Head):  # its own draft vocabulary, mapped in its graph by d2t
        vocab_ids, vocab_source = eagle3_vocab(head, options)
    else:
        vocab_ids, vocab_source = _reduced_vocab(checkpoint, head_dir, hf, dims, options)
    if plan.dtype != "float32":
        head.to(TORCH_DTYPES[plan.dtype])
    return LoadedModels(hf, weights, head, dims, int(max_length), vocab_ids, vocab_source)


def eagle3_vocab(head: Eagle3Head, options: ExportOptions):
    """(draft -> target ids, "head_d2t") of an EAGLE-3 head with a reduced draft vocabulary,
    (None, None) with a full one. ValueError for an explicit --draft-vocab (the head's
    vocabulary is fixed by its LM head) or a --graph-top-k above its draft vocabulary."""
    if options.draft_vocab is not None:
        raise ValueError(f"--draft-vocab {options.draft_vocab or 'full'} does not apply to an EAGLE-3 head: it "
                         f"brings its own draft vocabulary ({head.cfg.draft_vocab} tokens, its d2t table)")
    if options.graph_top_k > head.cfg.draft_vocab:
        raise ValueError(f"--graph-top-k {options.graph_top_k} exceeds the EAGLE-3 head's draft vocabulary "
                         f"({head.cfg.draft_vocab} tokens)")
    if head.cfg.draft_vocab == head.cfg.vocab:
        return None, None
    return head.draft_to_target.detach().cpu().clone(), "head_d2t"


def _reduced_vocab(checkpoint: Checkpoint, head_dir, hf, dims: Dims, options: ExportOptions):
    """(ids, source) of the reduced draft vocabulary an EAGLE-1/2 head's graph gets (see
    draft_vocab.py), or (None, None)."""
    draft_vocab = checkpoint.draft_vocab if options.draft_vocab is None else options.draft_vocab
    if draft_vocab is None:  # every head gets a reduced draft vocabulary unless asked otherwise
        draft_vocab = min(default_draft_vocab(dims.vocab), dims.vocab)
    if draft_vocab and not options.graph_top_k <= draft_vocab <= dims.vocab:
        raise ValueError(f"--draft-vocab {draft_vocab} must be 'full' (or 0) or in "
                         f"[--graph-top-k {options.graph_top_k}, vocabulary size {dims.vocab}]")
    eos = eos_ids(checkpoint.hf_dir, hf.config, None)
    return draft_vocab_ids(head_dir, draft_vocab, dims.vocab, eos, tokenizer_dir=checkpoint.hf_dir)


def head_description(plan: ExportPlan, eagle3: bool) -> str:
    """Which head the draft graph is built from, for the progress line: "the shipped head
    NAME", "head SPEC" (a folder or hub id), or "a random head (untrained)"."""
    if plan.head_dir is None:
        return "a random head (untrained)"
    spec = plan.draft or plan.checkpoint.default_draft or str(plan.head_dir)
    kind = "EAGLE-3 head" if eagle3 else "head"
    if spec.startswith("shipped:"):
        return f"the shipped {kind} {spec.removeprefix('shipped:')}"
    return f"{kind} {spec}"


def build_graphs(plan: ExportPlan, models: LoadedModels, options: ExportOptions, tmp: Path, progress=None):
    """target.onnx, draft.onnx (+ the draft vocabulary ids) and tokenizer/ into `tmp`; returns
    (target GraphEntry, DraftEntry, tokenizer or None)."""
    layout = kv_layout_for(options.graph, plan.dtype)
    why = fused_unsupported(models.dims, models.head.dims)
    if layout == KV_SHARED and why:
        if options.graph == "fused":
            raise ValueError(f"--graph fused cannot export this model: {why}; use --graph standard")
        layout = KV_SEQ_MAJOR
        lost = draft_quant_for(options, plan.dtype, KV_SHARED) != draft_quant_for(options, plan.dtype, layout)
        _say(progress, f"the fused graph does not fit ({why}): exporting the standard graph"
                       + (" (and an unquantised draft graph)" if lost else ""))
    kind = "fused onnxruntime operators" if layout == KV_SHARED else "standard ONNX operators"
    _say(progress, f"exporting target graph ({plan.dtype}, {kind})")
    taps = models.head.cfg.feature_layers if isinstance(models.head, Eagle3Head) else None
    dtype = TORCH_DTYPES[plan.dtype]
    target_step = TargetOnnxFromHF(plan.dtype, options.external_data, layout, taps, repeat_one_row_for(options, layout))
    target_entry = target_step(models.hf, tmp, read=lambda p: models.weights.read(p, dtype))
    _say(progress, f"exporting draft graph ({head_description(plan, taps is not None)}, "
                   + ("full vocabulary)" if models.vocab_ids is None else f"draft vocabulary {len(models.vocab_ids)})"))
    baked = None if taps else models.vocab_ids  # an EAGLE-3 graph maps its ids itself (d2t)
    draft_step = DraftOnnxFromHead(plan.dtype, options.graph_top_k, baked, options.external_data, layout)
    draft_entry = draft_step(models.head, tmp)
    draft_entry = draft_entry.replace(trained=plan.head_dir is not None)
    if models.vocab_ids is not None:  # the ids baked into the draft graph, for references and tools
        import numpy as np

        np.save(tmp / DRAFT_VOCAB_FILE, models.vocab_ids.numpy())
        draft_entry = draft_entry.replace(draft_vocab_file=DRAFT_VOCAB_FILE, draft_vocab_source=models.vocab_source)
    tokenizer = TokenizerFromHF()(plan.checkpoint.hf_dir, tmp)
    return target_entry, draft_entry, tokenizer


def quantise_graphs(target_entry: GraphEntry, draft_entry: DraftEntry, options: ExportOptions, tmp: Path,
                    progress=None) -> tuple[GraphEntry, DraftEntry, list[str]]:
    """With options.quant, quantise the target graph, and the draft graph as `draft_quant_for`
    says, in `tmp`; returns the updated entries and the notes for the manifest."""
    from .quantize import quantize_graph

    notes = []
    if options.quant:
        _say(progress, f"quantising the target graph ({options.quant})")
        target_entry = quantize_graph(tmp, target_entry, options.quant, options.external_data)
        notes.append(f"target quantised to {options.quant}: losslessness holds with respect to the quantised target")
        if not target_entry.quant_info.batch_invariant:
            notes.append("the quantised matmuls round activations to int8, which turns the last-bit differences "
                         "between a one-token and a tree forward's attention into different logits: the runtime "
                         "decodes this export row-exact by default (one-token forwards with their two-row bits, "
                         "depth-first trees), so greedy EAGLE output equals vanilla greedy")
    draft_kind = draft_quant_for(options, target_entry.dtype, target_entry.kv_layout)
    if draft_kind:
        _say(progress, f"quantising the draft graph ({draft_kind})")
        draft_entry = quantize_graph(tmp, draft_entry, draft_kind, options.external_data)
        if not options.quant:
            notes.append(f"{DRAFT_GRAPH_NOTE}quantised to {draft_kind} (its proposals only: the target, and so every "
                         "committed token, is unchanged)")
    return target_entry, draft_entry, notes


def prefill_graph(target_entry: GraphEntry, options: ExportOptions, tmp: Path, progress=None) -> GraphEntry | None:
    """With options.prefill_weights "int8": prefill.onnx from the fp32 target graph in `tmp`,
    before the target is quantised (exporter/prefill.py); returns its entry, else None."""
    if not prefill_graph_wanted(options.prefill_weights, options.quant):
        return None
    _say(progress, "building the int8 prefill graph (int8 weights, per-token int8 activations)")
    return build_prefill_graph(tmp, target_entry, options.external_data)


def share_graph_weights(target_entry: GraphEntry, draft_entry: DraftEntry, dims: Dims, options: ExportOptions,
                        tmp: Path, progress=None, prefill: GraphEntry | None = None) -> SharedWeights | None:
    """Store the weights the draft graph takes from the target (its token embedding; with a
    full draft vocabulary its LM head too) once, in `shared.data`, referenced by both graphs
    and by the `prefill` graph (its embedding; exporter/share.py); returns the manifest record
    (None: nothing shared)."""
    from .share import share_weights

    _say(progress, "sharing the target's embedding with the draft graph" + (" and the prefill graph" * bool(prefill)))
    return share_weights(tmp, target_entry, draft_entry, dims.vocab, options.external_data, prefill)


def write_manifest(plan: ExportPlan, models: LoadedModels, target_entry: GraphEntry, draft_entry: DraftEntry,
                   tokenizer, notes: list[str], tmp: Path, progress=None,
                   shared: SharedWeights | None = None, prefill: GraphEntry | None = None) -> Manifest:
    """Hash the sources and every file of `tmp` (the manifest's `files`, which the runtime
    checks on load: contract/verify.py), write `tmp/manifest.json` and read it back (the
    runtime's own validation), so a manifest the runtime would refuse is never published.
    `shared`: the weights both graphs take from the shared file (share_graph_weights);
    `prefill`: the prefill graph's entry (prefill_graph), None without one."""
    _say(progress, "hashing sources and writing manifest")
    checkpoint, head_dir = plan.checkpoint, plan.head_dir
    sources = Sources(
        target=SourceRecord(spec=plan.model, path=str(checkpoint.source), sha256=weight_digests(checkpoint.source)),
        draft=SourceRecord(spec=plan.draft or checkpoint.default_draft, path=str(head_dir) if head_dir else None,
                           sha256={n: sha256_file(head_dir / n) for n in HEAD_WEIGHT_FILES
                                   if head_dir and (head_dir / n).exists()}))
    files = file_records(tmp)
    if head_dir is None:
        notes = ["draft head is RANDOMLY INITIALISED (untrained): expect acceptance near 1 token per round", *notes]
    manifest = Manifest(
        name=plan.out.name, dims=models.dims, max_length=models.max_length,
        target=target_entry.replace(sha256=files[target_entry.path].sha256),
        draft=draft_entry.replace(sha256=files[draft_entry.path].sha256),
        prefill=prefill.replace(sha256=files[prefill.path].sha256) if prefill is not None else None,
        tree=plan.tree, eos_token_ids=tuple(eos_ids(checkpoint.hf_dir, models.hf.config, tokenizer)),
        tokenizer=TOKENIZER_DIR if tokenizer is not None else None,
        chat_template=bool(getattr(tokenizer, "chat_template", None)), sources=sources,
        tools=_tool_versions(), notes=tuple(notes), shared_weights=shared, files=files)
    manifest.save(tmp)
    Manifest.load(tmp)
    return manifest


def export(model: str, draft: str | None, out_root: Path, options: ExportOptions, progress=print) -> Path:
    """Export `model` (alias, HF folder or .gguf) and its head (`draft`: folder, hub id,
    "random", or None for the alias default) into `out_root/<name>`; returns that folder.

    Steps: resolve_inputs (options checked, nothing loaded) -> load_models (sizes checked,
    nothing written) -> build_graphs -> prefill_graph -> quantise_graphs -> share_graph_weights
    -> write_manifest,
    all in a private temporary folder under `out_root` -> publish_folder (renamed into place).
    From the start to the rename it holds the destination's lock (publish.destination_lock);
    --force (options.force) is checked again at the rename, and an old folder is deleted only
    once the new one is in place. A failure at any step leaves no partial folder, and the
    partial folders of an export killed outright are removed by the next one to the same
    destination (publish.remove_stale_partials, under the lock).

    Raises ModelNotAvailableError, UnsupportedModelError, HeadCheckpointError, ValueError,
    FileExistsError (folder exists and not options.force, also when it appeared meanwhile),
    DestinationBusyError (a FileExistsError: another process is exporting the same folder),
    OSError (a destination that cannot be written: read-only, full; common.cli_args.disk_error)."""
    plan = resolve_inputs(model, draft, out_root, options, progress)
    created = not Path(out_root).exists()
    Path(out_root).mkdir(parents=True, exist_ok=True)
    try:
        with destination_lock(plan.out):  # before the models load: a busy or read-only destination fails at once
            stale = remove_stale_partials(plan.out)
            if stale:
                _say(progress, f"removed {len(stale)} partial folder(s) a killed export of {plan.out.name} left: "
                               f"{', '.join(p.name for p in stale)}")
            models = load_models(plan, options, progress)
            tmp = Path(tempfile.mkdtemp(prefix=partial_prefix(plan.out), dir=out_root))
            try:
                target_entry, draft_entry, tokenizer = build_graphs(plan, models, options, tmp, progress)
                plan = replace(plan, tree=tree_for(options, plan.dtype, target_entry.kv_layout))  # the graph kind made
                prefill = prefill_graph(target_entry, options, tmp, progress)  # from the fp32 target graph
                target_entry, draft_entry, notes = quantise_graphs(target_entry, draft_entry, options, tmp, progress)
                notes += [PREFILL_NOTE] if prefill is not None else []
                shared = share_graph_weights(target_entry, draft_entry, models.dims, options, tmp, progress, prefill)
                write_manifest(plan, models, target_entry, draft_entry, tokenizer, notes, tmp, progress, shared,
                               prefill)
                publish_folder(tmp, plan.out, replace=options.force)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        if created:  # a failed export leaves no --out folder it made itself
            try:
                Path(out_root).rmdir()
            except OSError:
                pass
        raise
    return plan.out
