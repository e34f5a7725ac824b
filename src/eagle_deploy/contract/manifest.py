"""`manifest.json`: what an export folder holds, read by the runtime instead of guessing.

Written by `eagle-export` beside the graphs; the runtime reads only this file, the graphs and
the tokenizer folder (it never imports the torch model).

`Manifest` and its records (`manifest_records`) are frozen pydantic models, each field
declared once (`manifest_json.Record`); `save` writes `model_dump(mode="json")`. `Manifest.load` validates everything
it reads: a missing key, a wrong type, a non-positive size, dims that contradict each other or
the graphs' I/O lists, a tree the draft graph cannot serve. Each problem is one
`ManifestError` line naming the field, what was expected and what was found, e.g.

    /x/manifest.json max_length: expected an integer >= 2, found -3

The checks across records (the graphs' I/O against the ONNX contract for the dims, the layer
count, the draft vocabulary against top-k, a tree's top_k against the draft graph's) are
`Manifest`'s validator, run on every manifest read. `check_graph_io` compares a graph entry
with the inputs/outputs an opened graph reports (backends call it when they open a session).

Format 2 (FORMAT_VERSION): a manifest of another format is refused with one line that says to
export again (docs/exports.md, "The manifest"). The draft record (`graph_top_k`, `trained`,
...) and the quantisation record live under each graph's `"extra"` object; `engines` holds
`"trt"` (`TrtRecord`) and `"tuning"` (`TuningRecord`). `"prefill"`, a third graph entry beside
`"target"` and `"draft"`, is optional within format 2: exports without a prefill graph leave it
out and load as before (contract onnx_io, "Prefill graph").
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, ClassVar, Literal, Optional, Sequence

from pydantic import ValidationInfo, model_validator

from . import onnx_io as c
from .errors import ManifestError, unreadable
from .field_errors import MISSING, Expect, failed
from .manifest_json import JSON_LAYOUT, Record, Said, Text, at_least, omitted, read, shown
from .manifest_records import (  # noqa: F401 (the records, imported from here by their users)
    DRAFT_VOCAB_SOURCES,
    GRAPHS,
    HEAD_KINDS,
    PREFILL_GRAPH,
    QUANT_KINDS,
    SHARED_ROLES,
    Dims,
    DraftEntry,
    Engines,
    FileRecord,
    GraphEntry,
    HeadRecord,
    QuantRecord,
    SharedTensor,
    SharedWeights,
    SourceRecord,
    Sources,
    Tree,
    TrtRecord,
    TuningRecord,
)
from .onnx_io import MANIFEST_FILE, TensorSpec

FORMAT_VERSION = 2
# `eagle-export --draft-quant`: quantisation of the draft graph's weights (MatMulNBits); the rule
# and its measurements are in exporter.export.draft_quant_for
DRAFT_QUANTS = ("auto", "none") + QUANT_KINDS
# a manifest note about the draft graph alone starts with this (Manifest.notes_for leaves it out
# of runs that never open that graph)
DRAFT_GRAPH_NOTE = "draft graph "
_ENTRY = Expect("a graph entry (JSON object)")


class Manifest(Record):
    """Everything the runtime needs about an export (see engines/README.md). Frozen: change
    a copy with `replace` and `save` it."""

    label: ClassVar[str] = MANIFEST_FILE
    name: Text
    dims: Dims
    max_length: at_least(2)  # KV capacity in tokens (prompt + generated), 2..dims.max_position_embeddings
    target: Annotated[GraphEntry, _ENTRY]
    draft: Annotated[DraftEntry, _ENTRY]
    # the int8 prefill graph (`eagle-export --prefill-weights int8`): the target's I/O, run for
    # prompt forwards only; None: the target graph prefills (every export before 2026-12-07)
    prefill: Annotated[Optional[GraphEntry], _ENTRY] = omitted(None)
    tree: Tree  # the default draft tree, valid for draft.graph_top_k
    eos_token_ids: tuple[at_least(0, "a token id (integer >= 0)"), ...]
    tokenizer: Optional[Text]  # folder name inside the export, or None
    chat_template: bool
    sources: Sources
    tools: dict[str, Text]  # tool -> version that produced the export
    engines: Engines = Engines()
    notes: tuple[str, ...] = ()
    format_version: Literal[FORMAT_VERSION] = FORMAT_VERSION
    shared_weights: Optional[SharedWeights] = omitted(None)  # weights both graphs use, stored once
    files: dict[str, FileRecord]  # every file of the folder but the manifest

    @property
    def output_notes(self) -> tuple[str, ...]:
        """The notes a run prints: those that bear on the committed tokens (a quantised target),
        not those about the draft graph alone (they start DRAFT_GRAPH_NOTE: a quantised draft
        graph changes proposals only, never the output)."""
        return tuple(n for n in self.notes if not n.startswith(DRAFT_GRAPH_NOTE))

    @property
    def graph_names(self) -> tuple[str, ...]:
        """The graphs this export holds: "target", "draft", and "prefill" when it has one."""
        return GRAPHS + ((PREFILL_GRAPH,) if self.prefill is not None else ())

    @property
    def length_limit(self) -> int:
        """The largest max_length a re-export of this model and head may have (`eagle-export
        --max-length`): the smaller of the target's and the head's max_position_embeddings."""
        return min(self.dims.max_position_embeddings, self.draft.max_position_embeddings)

    def graph_dims(self, which: str) -> Dims:
        """The dims graph `which` ("target" | "draft" | "prefill") runs with: the target's, except
        that the draft graph has the head's decoder layers (`num_layers` = `draft.num_layers`) and
        an EAGLE-3 head its own hidden width, heads and head dim (its KV buffer and `features` /
        `next_features` are sized by them)."""
        if which != "draft":
            return self.dims
        dims, head = self.dims.replace(num_layers=self.draft.num_layers), self.draft.head
        if head.kind != "eagle3":
            return dims
        return dims.replace(hidden=head.hidden, num_heads=head.num_heads, num_kv_heads=head.num_kv_heads,
                            head_dim=head.head_dim)

    def save(self, folder: Path) -> Path:
        path = Path(folder) / MANIFEST_FILE
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.model_dump(mode="json"), indent=2) + "\n")
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, folder: Path) -> "Manifest":
        """Read and validate `<folder>/manifest.json`. Raises ManifestError (one line naming
        the field, the expected and the found value) on anything missing or malformed."""
        folder = Path(folder)
        path = folder / MANIFEST_FILE
        problem = unreadable(path)
        if problem not in (None, "is missing"):  # a loop or a dangling link is not "no manifest"
            raise ManifestError(f"{path} {problem}; copy the whole export folder or re-export")
        if problem is not None:
            if not folder.exists():
                raise ManifestError(f"{folder} does not exist: pass an export folder (eagle-export prints the one it "
                                    "writes), or run eagle-export first")
            inside = sorted(str(p.parent) for p in folder.glob(f"*/{MANIFEST_FILE}")) if folder.is_dir() else []
            if inside:  # --out of eagle-export given instead of the export in it
                raise ManifestError(f"{folder} is not an export folder (no {MANIFEST_FILE}) but holds "
                                    f"{'exports' if len(inside) > 1 else 'an export'}: pass "
                                    f"{' or '.join(inside[:3])}{' or ...' if len(inside) > 3 else ''}")
            raise ManifestError(f"{folder} is not an export folder (no {MANIFEST_FILE}); run eagle-export first")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ManifestError(f"{path} is not valid JSON: {err}") from None
        except (OSError, UnicodeDecodeError) as err:
            raise ManifestError(f"{path} cannot be read ({type(err).__name__}: {err}); re-export") from None
        except (ValueError, RecursionError) as err:  # json's own limits: a 4,300-digit integer, deep nesting
            raise ManifestError(f"{path} is not a manifest JSON can read ({type(err).__name__}: "
                                f"{' '.join(str(err).split())[:100]}); re-export") from None
        return cls.from_json(data, str(path))

    @classmethod
    def from_json(cls, data, source: str = MANIFEST_FILE) -> "Manifest":
        """A validated Manifest from parsed JSON of this format version; `source` prefixes
        every error message."""
        if not isinstance(data, dict):
            raise ManifestError(f"{source} is malformed: expected a JSON object, found {type(data).__name__}; "
                                "export again with eagle-export")
        version = data.get("format_version")
        if isinstance(version, int) and not isinstance(version, bool) and version != FORMAT_VERSION:
            raise ManifestError(f"{source} is format {version}; this eagle-deploy reads format {FORMAT_VERSION}: "
                                "export again with eagle-export")
        if version != FORMAT_VERSION or isinstance(version, bool):
            raise ManifestError(f"{source} format_version: expected {FORMAT_VERSION} (the format this eagle-deploy "
                                f"reads), found {shown(data.get('format_version', MISSING))}; export again with "
                                "eagle-export")
        return read(cls, data, source)

    @model_validator(mode="after")
    def _consistent(self, info: ValidationInfo):
        """The checks across records, on a manifest read (not on records built in Python), in
        the order a reader meets them."""
        if info.context is not JSON_LAYOUT:
            return self
        dims = self.dims
        if self.max_length > dims.max_position_embeddings:
            raise failed("max_length", expected=f"at most dims.max_position_embeddings {dims.max_position_embeddings}")
        _check_taps(self.target, self.draft, dims)
        _check_target(self.target, dims)
        _check_draft(self.draft, dims)
        if self.prefill is not None:
            shared = self.shared_weights.file if self.shared_weights is not None else c.SHARED_WEIGHTS_FILE
            _check_prefill(self.prefill, self.target, (self.draft.path, shared))
        limit = self.draft.max_position_embeddings
        if self.max_length > limit:
            raise failed("max_length", expected=f"at most draft.extra.max_position_embeddings {limit} (the draft "
                                                 "head's position limit)")
        tuning = self.engines.tuning
        for at, tree in ((("tree",), self.tree), (("engines", "tuning", "previous"), tuning and tuning.previous),
                         (("engines", "tuning", "chosen"), tuning and tuning.chosen)):
            if tree is not None and tree.top_k > self.draft.graph_top_k:
                raise failed(*at, "top_k", expected=f"at most draft.extra.graph_top_k {self.draft.graph_top_k}")
        file = self.shared_weights.file if self.shared_weights is not None else None
        if file is not None and ("/" in file or "\\" in file or file in (".", "..", self.target.path, self.draft.path)):
            raise failed("shared_weights", "file", expected="a data file name inside the export folder")
        for i, t in enumerate(self.shared_weights.tensors if self.shared_weights is not None else ()):
            if t.prefill_name is not None and self.prefill is None:
                raise failed("shared_weights", "tensors", i, "prefill_name",
                             expected="no such field (this export has no prefill graph)", found=t.prefill_name)
        for path in self.files:
            if path == MANIFEST_FILE or "\\" in path or any(p in ("", ".", "..") for p in path.split("/")):
                raise failed("files", path, expected="a relative file path inside the export folder ('/'-separated)",
                             found=path)
        return self


# ---------------------------------------------------------------------------------------------
# The checks across records (raise field_errors.failed: the path from the manifest down)


def _check_quant(graph: GraphEntry, which: str) -> None:
    quant = graph.quant_info
    if quant is not None and quant.kind != graph.quant:
        raise failed(which, "quant", expected=f"{quant.kind!r} (as {which}.extra.quant.kind says)")


def _check_layers(layers: Sequence[int], at: tuple, num_layers: int) -> None:
    """`feature_layers`: distinct layer ids in [0, num_layers), ascending."""
    for i, v in enumerate(layers):
        if v >= num_layers:
            raise failed(*at, i, expected=f"a decoder layer id in [0, dims.num_layers {num_layers})")
    if not layers or list(layers) != sorted(set(layers)):
        raise failed(*at, expected="distinct layer ids in ascending order")


def _check_taps(target: GraphEntry, draft: DraftEntry, dims: Dims) -> None:
    """The layers an EAGLE-3 head reads, recorded on both graphs alike (none for EAGLE-1/2)."""
    if draft.feature_layers is not None:  # the draft's taps are its head's
        raise failed("draft", "feature_layers", expected="no such field (the draft head's taps are "
                                                         "draft.extra.head.feature_layers)")
    if target.feature_layers is not None:
        _check_layers(target.feature_layers, ("target", "feature_layers"), dims.num_layers)
    if draft.head.kind == "eagle3":
        _check_layers(draft.head.feature_layers, ("draft", "head", "feature_layers"), dims.num_layers)
    taps = draft.head.feature_layers or None
    if (target.feature_layers or None) != taps:
        raise failed("target", "feature_layers", expected=f"{shown(list(taps) if taps else None)} (the draft "
                                                          "head's draft.extra.head.feature_layers)",
                     found=list(target.feature_layers) if target.feature_layers else None)


def _check_target(graph: GraphEntry, dims: Dims) -> None:
    _check_quant(graph, "target")
    layers = graph.feature_layers
    past = [s.name for s in graph.inputs if s.name.startswith("past_key_values.")]
    found = len(past) // 2
    if found != dims.num_layers and past == [p for p, _ in c.kv_names(found)]:
        raise failed("dims", "num_layers", expected=f"{found} (target.inputs holds the KV of {found} layers)")
    _check_contract(graph, "target", *c.target_io(dims.num_layers, graph.dtype, graph.kv_layout,
                                                  len(layers) * dims.hidden if layers else None))


def _check_draft(graph: DraftEntry, dims: Dims) -> None:
    _check_quant(graph, "draft")
    top_k = graph.graph_top_k
    if not top_k <= graph.draft_vocab_size <= dims.vocab:
        raise failed("draft", "draft_vocab_size", expected=f"an integer in [graph_top_k {top_k}, dims.vocab "
                                                           f"{dims.vocab}]")
    head = graph.head
    found_k = next((s.shape[-1] for s in graph.outputs if s.name == c.TOPK_IDS and s.shape), top_k)
    if isinstance(found_k, int) and found_k != top_k:
        raise failed("draft", "graph_top_k", expected=f"{found_k} (the last dimension of draft.outputs "
                                                      f"{c.TOPK_IDS!r})")
    past = [s.name for s in graph.inputs if s.name.startswith("past_key_values.")]
    found = len(past) // 2
    if found != graph.num_layers and past == [p for p, _ in c.kv_names(found)]:
        raise failed("draft", "num_layers", expected=f"{found} (draft.inputs holds the KV of {found} layers)")
    _check_contract(graph, "draft", *c.draft_io(graph.dtype, top_k, graph.kv_layout, head.tapped_width(dims.hidden),
                                                graph.num_layers))


def _check_prefill(graph: GraphEntry, target: GraphEntry, taken: tuple[str, ...]) -> None:
    """The prefill graph: a file of its own, int8, and exactly the target graph's inputs,
    outputs and taps (the runtime runs it in the target's place: contract "Prefill graph")."""
    if graph.path in (target.path, *taken):
        raise failed("prefill", "path", expected="a graph file of its own (not the target's, the draft's or the "
                                                 "shared weights')")
    _check_quant(graph, "prefill")
    if graph.quant != "int8":
        raise failed("prefill", "quant", expected="'int8' (the prefill graph's weights)")
    if graph.feature_layers != target.feature_layers:
        raise failed("prefill", "feature_layers", expected=f"{shown(list(target.feature_layers or []) or None)} "
                                                           "(the target graph's)",
                     found=list(graph.feature_layers) if graph.feature_layers else None)
    _check_contract(graph, "prefill", list(target.inputs), list(target.outputs))


def _check_contract(graph: GraphEntry, which: str, inputs: list[TensorSpec], outputs: list[TensorSpec]) -> None:
    """The entry's I/O lists are the ONNX contract's for its dims, dtype and top-k."""
    for key, declared, expected in (("inputs", graph.inputs, inputs), ("outputs", graph.outputs, outputs)):
        for i, (d, e) in enumerate(zip(declared, expected)):
            if d != e:
                part = "name" if d.name != e.name else "dtype" if d.dtype != e.dtype else "shape"
                want, got = {"name": (e.name, d.name), "dtype": (e.dtype, d.dtype),
                             "shape": (list(e.shape), list(d.shape))}[part]
                of = "" if part == "name" else f" for {e.name!r}"
                raise failed(which, key, i, part, expected=f"{shown(want)} (the ONNX I/O contract{of})", found=got)
        if len(declared) != len(expected):
            raise failed(which, key, expected=f"{len(expected)} tensors (the ONNX I/O contract)",
                         found=Said(f"{len(declared)} tensors"))


# ---------------------------------------------------------------------------------------------
# Manifest vs. an opened graph

# symbolic dimensions fixed by the model, and the dims field each comes from
DIM_FIELDS = {"hidden": "hidden", "vocab": "vocab", "head_dim": "head_dim", "kv_heads": "num_kv_heads"}


def io_mismatch(declared: Sequence[TensorSpec], actual: Sequence[TensorSpec], dims: Dims | None = None,
                kind: str = "input", graph: str = "the graph") -> tuple[str, str] | None:
    """None if `declared` (the manifest's specs) matches `actual` (what the opened graph
    reports: names in order, dtypes, ranks, and every fixed dimension, the manifest's
    symbols `hidden`/`vocab`/`head_dim`/`kv_heads` resolved through `dims`); else
    (field suffix, "expected ..., found ..." text) for the first difference. Pure."""
    for i, (d, a) in enumerate(zip(declared, actual)):
        if d.name != a.name:
            return f"[{i}]", f"expected {kind} {a.name!r} ({graph} has it there), found {d.name!r}"
        if d.dtype != a.dtype:
            return f"[{i}].dtype", f"expected {a.dtype} ({graph} {kind} {a.name!r}), found {d.dtype}"
        if len(d.shape) != len(a.shape):
            return (f"[{i}].shape", f"expected rank {len(a.shape)} {list(a.shape)} ({graph} {kind} {a.name!r}), "
                                    f"found rank {len(d.shape)} {list(d.shape)}")
        for axis, (dd, ad) in enumerate(zip(d.shape, a.shape)):
            value = getattr(dims, DIM_FIELDS[dd]) if dims is not None and dd in DIM_FIELDS else dd
            if isinstance(ad, int) and isinstance(value, int) and value != ad:
                where = f"dims.{DIM_FIELDS[dd]}" if isinstance(dd, str) else f"[{i}].shape[{axis}]"
                return where, f"expected {ad} ({graph} {kind} {a.name!r} dimension {axis}), found {value}"
    if len(declared) < len(actual):
        extra = actual[len(declared)]
        return "", f"expected {kind} {extra.name!r} ({graph} has {len(actual)} {kind}s), found only {len(declared)}"
    if len(declared) > len(actual):
        first = declared[len(actual)].name
        return f"[{len(actual)}]", f"expected no more {kind}s ({graph} has {len(actual)}), found {first!r}"
    return None


def check_graph_io(entry: GraphEntry, which: str, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec],
                   dims: Dims | None = None, source: str = MANIFEST_FILE) -> None:
    """Raise ManifestError (one line) unless graph entry `which` ("target" | "draft") declares
    exactly the `inputs` and `outputs` its opened graph reports (see io_mismatch). `source`:
    the manifest path, prefixed to the message."""
    for key, declared, actual, kind in (("inputs", entry.inputs, inputs, "input"),
                                        ("outputs", entry.outputs, outputs, "output")):
        found = io_mismatch(declared, actual, dims, kind, f"graph {entry.path}")
        if found is not None:
            suffix, text = found
            name = suffix if suffix.startswith("dims.") else f"{which}.{key}{suffix}"
            raise ManifestError(f"{source} {name}: {text}; the graph and the manifest disagree: re-export")
