"""`manifest.json`: what an export folder holds, read by the runtime instead of guessing.

Written by `eagle-export` beside the graphs; the runtime reads only this file, the graphs and
the tokenizer folder (it never imports the torch model).

`Manifest.load` returns typed, frozen records and validates everything it reads: a missing
key, a wrong type, a non-positive size, dims that contradict each other or the graphs' I/O
lists, a tree the draft graph cannot serve. Each problem is one `ManifestError` line naming
the field, what was expected and what was found, e.g.

    /x/manifest.json max_length: expected an integer >= 2, found -3

Reading is `manifest_schema`'s: pydantic models of the JSON layout, their errors turned into
that one line. `check_graph_io` compares a graph entry with the inputs/outputs an opened graph reports
(backends call it when they open a session).

JSON layout (format 1, unchanged): the draft record (`graph_top_k`, `trained`, ...) and the
quantisation record live under each graph's `"extra"` object; `engines` holds `"trt"`
(`TrtRecord`) and `"tuning"` (`TuningRecord`).
"""
from __future__ import annotations

import errno
import json
import os
import stat
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from . import manifest_schema as s
from . import onnx_io as c
from .manifest_schema import (  # noqa: F401 (the schema's constants, named here as before)
    DRAFT_VOCAB_SOURCES,
    FORMAT_VERSION,
    GRAPHS,
    HEAD_KINDS,
    QUANT_KINDS,
    SHARED_ROLES,
    ManifestError,
)
from .onnx_io import MANIFEST_FILE, TensorSpec
from .profiles import ProfileSpec
from .tree_config import TreeConfig

# `eagle-export --draft-quant`: quantisation of the draft graph's weights (MatMulNBits); the rule
# and its measurements are in exporter.export.draft_quant_for
DRAFT_QUANTS = ("auto", "none") + QUANT_KINDS
# a manifest note about the draft graph alone starts with this (Manifest.notes_for leaves it out
# of runs that never open that graph)
DRAFT_GRAPH_NOTE = "draft graph "

# ---------------------------------------------------------------------------------------------
# Records


@dataclass(frozen=True)
class Dims:
    """Static dimensions of the target model (all > 0). `num_kv_heads` divides `num_heads`;
    `head_dim` is explicit (Mistral-Nemo-style models have num_heads * head_dim != hidden)."""

    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    max_position_embeddings: int
    rms_norm_eps: float

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class HeadRecord:
    """What kind of draft head the draft graph runs (JSON: the draft's `extra.head`).

    kind "eagle": an EAGLE-1/2 head (arXiv 2401.15077 / 2406.16858), fed the target's final
    features, with the target's geometry (no sizes recorded). kind "eagle3" (arXiv
    2503.01840): fed the hidden states entering the target's decoder layers `feature_layers`
    (the target graph's `tapped_features`), with its own hidden width, heads and head dim
    (which may differ from the target's), its own norm, LM head and draft vocabulary.
    `layout`: the checkpoint layout it was read from (heads/eagle3_checkpoint.py), for the record."""

    kind: str
    hidden: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    feature_layers: tuple[int, ...] = ()
    layout: str | None = None

    def to_json(self) -> dict:
        if self.kind != "eagle3":
            return {"kind": self.kind}
        out = {"kind": self.kind, "hidden": self.hidden, "num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads,
               "head_dim": self.head_dim, "feature_layers": list(self.feature_layers)}
        if self.layout is not None:
            out["layout"] = self.layout
        return out

    def tapped_width(self, target_hidden: int) -> int | None:
        """Width of the draft graph's `tapped_features` input (taps x target hidden); None for
        EAGLE-1/2 heads."""
        return len(self.feature_layers) * target_hidden if self.kind == "eagle3" else None


@dataclass(frozen=True)
class QuantRecord:
    """How a graph was quantised (JSON: the graph's `extra.quant`). `settings`: the method's
    options (block_size, accuracy_level, symmetric | per_channel, reduce_range), stored flat
    beside the other keys. batch_invariant None: not recorded (exports before it was)."""

    kind: str  # "int4" | "int8"
    method: str  # "nbits" | "dynamic"
    tool: str = "onnxruntime.quantization"
    quantised_matmuls: int | None = None
    batch_invariant: bool | None = None
    settings: Mapping[str, bool | int | float | str | None] = field(default_factory=dict)

    def to_json(self) -> dict:
        out = {"kind": self.kind, "method": self.method, **self.settings, "tool": self.tool}
        if self.quantised_matmuls is not None:
            out["quantised_matmuls"] = self.quantised_matmuls
        if self.batch_invariant is not None:
            out["batch_invariant"] = self.batch_invariant
        return out


@dataclass(frozen=True)
class GraphEntry:
    """One exported graph: file (inside the export folder), activation/KV dtype (float32 |
    float16 | bfloat16), its inputs and outputs in graph order (the ONNX contract,
    `onnx_io.target_io` / `draft_io`), quantisation (quant: None | "int4" | "int8", details
    in quant_info) and the file's sha256."""

    path: str
    dtype: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    quant: str | None = None
    sha256: str | None = None
    quant_info: QuantRecord | None = None
    feature_layers: tuple[int, ...] | None = None  # target of an EAGLE-3 export: the tapped layers
    # rows of one batch may have different past lengths, each read from its own mask (contract
    # "Batched forwards"; fused graphs exported since batched decoding); False in older exports
    ragged_batch: bool = False

    def _extra(self) -> dict:
        out = {"quant": self.quant_info.to_json()} if self.quant_info else {}
        if self.feature_layers is not None:
            out["feature_layers"] = list(self.feature_layers)
        if self.ragged_batch:
            out["ragged_batch"] = True
        return out

    def to_json(self) -> dict:
        return {"path": self.path, "dtype": self.dtype, "inputs": [s.to_json() for s in self.inputs],
                "outputs": [s.to_json() for s in self.outputs], "quant": self.quant, "sha256": self.sha256,
                "extra": self._extra()}

    def num_kv_layers(self) -> int:
        """Layers whose KV this graph takes (its `past_key_values.*` inputs, two per layer)."""
        return sum(1 for s in self.inputs if s.name.startswith("past_key_values.")) // 2

    @property
    def kv_layout(self) -> str:
        """How this graph takes its KV (`onnx_io.KV_LAYOUTS`), read from its KV specs' shape:
        "seq_major" (standard ops) or "shared" (fused GroupQueryAttention, one buffer in and
        out). Manifest.load accepts only these two."""
        return c.kv_layout_of(self.inputs) or c.KV_SEQ_MAJOR


@dataclass(frozen=True, kw_only=True)
class DraftEntry(GraphEntry):
    """The draft graph and its head: graph_top_k (the top-k computed in-graph; trees may use
    any top_k up to it), trained (False: a random head), draft_vocab_size (tokens the head can
    propose; the vocabulary when not reduced), draft_vocab_file (those ids, .npy, when reduced),
    draft_vocab_source (how they were ranked: one of DRAFT_VOCAB_SOURCES; None when not
    reduced or not recorded), max_position_embeddings (the head's own position limit; None in
    exports made before it was recorded). JSON: the graph's `extra` object."""

    graph_top_k: int
    trained: bool = True
    draft_vocab_size: int | None = None
    draft_vocab_file: str | None = None
    draft_vocab_source: str | None = None
    max_position_embeddings: int | None = None
    head: HeadRecord | None = None  # None: an EAGLE-1/2 head with the target's geometry (older exports)

    @property
    def head_kind(self) -> str:
        """"eagle" (EAGLE-1/2) or "eagle3" (HeadRecord.kind)."""
        return self.head.kind if self.head is not None else "eagle"

    def _extra(self) -> dict:
        out = {"graph_top_k": self.graph_top_k, "draft_vocab_size": self.draft_vocab_size, "trained": self.trained}
        if self.head is not None:
            out["head"] = self.head.to_json()
        if self.draft_vocab_file is not None:
            out["draft_vocab_file"] = self.draft_vocab_file
        if self.draft_vocab_source is not None:
            out["draft_vocab_source"] = self.draft_vocab_source
        if self.max_position_embeddings is not None:
            out["max_position_embeddings"] = self.max_position_embeddings
        return {**out, **super()._extra()}


@dataclass(frozen=True)
class SharedTensor:
    """One weight tensor the target and draft graphs both use, stored once: `role` ("embedding":
    the token embedding; "lm_head": LM head weights, with a full draft vocabulary), its
    initializer name in each graph, dtype (contract name) and shape as stored, and where its
    bytes lie in the shared file (offset, length)."""

    role: str
    target_name: str
    draft_name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    length: int

    def to_json(self) -> dict:
        return {"role": self.role, "target_name": self.target_name, "draft_name": self.draft_name,
                "dtype": self.dtype, "shape": list(self.shape), "offset": self.offset, "length": self.length}


def unreadable(path: Path) -> str | None:
    """Why `path` cannot be read as a file, in words that follow its name ("is missing", "is a
    symlink loop ...", "is a symlink to X, which does not exist", "is a folder, not a file",
    "cannot be read (...)"), or None for a file (symlinks followed). Path.exists and
    Path.is_file say False for all of these alike, so a loop read as "missing"."""
    try:
        st = os.stat(path)
    except OSError as err:
        if err.errno == errno.ELOOP:
            return "is a symlink loop (a link that leads back to itself, not a file)"
        if os.path.islink(path):
            return f"is a symlink to {os.readlink(path)}, which does not exist"
        if isinstance(err, FileNotFoundError):
            return "is missing"
        return f"cannot be read ({err.strerror or err})"
    if stat.S_ISDIR(st.st_mode):
        return "is a folder, not a file"
    return None


@dataclass(frozen=True)
class SharedWeights:
    """The weights the draft graph takes from the target (JSON: `shared_weights`): one
    external-data file in the export folder (`onnx_io.SHARED_WEIGHTS_FILE`) that both graphs
    reference, so the folder holds them once and onnxruntime maps them once per graph without
    copying (see onnx_io). `size`: the file's length in bytes; `sha256`: its hash."""

    file: str
    size: int
    tensors: tuple[SharedTensor, ...]
    sha256: str | None = None

    def to_json(self) -> dict:
        return {"file": self.file, "size": self.size, "sha256": self.sha256,
                "tensors": [t.to_json() for t in self.tensors]}

    def check(self, folder: Path, which: str = "draft") -> None:
        """Raise ManifestError (one line) when the shared file is missing from `folder` or
        shorter than the tensors need: graph `which` cannot load without it."""
        path = Path(folder) / self.file
        words = {"embedding": "token embedding", "lm_head": "LM head"}
        roles = " and ".join(sorted({words.get(t.role, t.role) for t in self.tensors}, reverse=True)) or "weights"
        what = (f"the {which} graph needs the {roles} ({len(self.tensors)} tensor(s)) kept there once for the target "
                "and draft graphs")
        problem = unreadable(path)
        if problem is not None:
            raise ManifestError(f"{path} {problem}: {what}; copy the whole export folder or re-export")
        need = max((t.offset + t.length for t in self.tensors), default=0)
        found = path.stat().st_size
        if found < max(need, self.size):
            raise ManifestError(f"{path} is truncated ({found} bytes, expected {max(need, self.size)}): {what}; "
                                "copy the whole export folder or re-export")


@dataclass(frozen=True)
class FileRecord:
    """One file of the export folder (JSON: `files`, keyed by its '/'-separated path inside
    the folder): size in bytes, sha256, and for a file larger than `verify.SMALL_FILE` the
    sha256 of a sample of its blocks (`verify.sampled_digest`), which the runtime checks on
    every load (contract/verify.py). Written by eagle-export for every file but the manifest."""

    size: int
    sha256: str
    sampled_sha256: str | None = None

    def to_json(self) -> dict:
        out = {"size": self.size, "sha256": self.sha256}
        return out if self.sampled_sha256 is None else {**out, "sampled_sha256": self.sampled_sha256}


@dataclass(frozen=True)
class SourceRecord:
    """Where one model came from: the spec given to eagle-export, the resolved path, the
    sha256 of each weight file; `trained` for the draft head only (None for the target)."""

    spec: str | None = None
    path: str | None = None
    sha256: Mapping[str, str] = field(default_factory=dict)
    trained: bool | None = None

    def to_json(self) -> dict:
        out = {"spec": self.spec, "path": self.path, "sha256": dict(self.sha256)}
        return out if self.trained is None else {**out, "trained": self.trained}


@dataclass(frozen=True)
class Sources:
    target: SourceRecord = field(default_factory=SourceRecord)
    draft: SourceRecord = field(default_factory=SourceRecord)

    def to_json(self) -> dict:
        return {"target": self.target.to_json(), "draft": self.draft.to_json()}


@dataclass(frozen=True)
class TrtRecord:
    """TensorRT engines built from this export (`exporter.trt_build`): engine file and
    optimization profiles per graph ("target", "draft"), the TensorRT version they need, the
    timing cache, the capacities they were built for, the ONNX sha256 they came from, the GPU."""

    files: Mapping[str, str]
    profiles: Mapping[str, tuple[ProfileSpec, ...]]
    trt_version: str
    timing_cache: str | None = None
    strongly_typed: bool = True
    max_length: int | None = None
    draft_capacity: int | None = None
    onnx_sha256: Mapping[str, str | None] = field(default_factory=dict)
    device: str | None = None

    @classmethod
    def from_json(cls, data, source: str = "TensorRT record") -> "TrtRecord":
        """A validated TrtRecord from its JSON object; ManifestError names a bad field."""
        return _trt(s.read(s.TrtJSON, data, source))

    def to_json(self) -> dict:
        return {"files": dict(self.files),
                "profiles": {w: [p.to_json() for p in ps] for w, ps in self.profiles.items()},
                "trt_version": self.trt_version, "timing_cache": self.timing_cache,
                "strongly_typed": self.strongly_typed, "max_length": self.max_length,
                "draft_capacity": self.draft_capacity, "onnx_sha256": dict(self.onnx_sha256), "device": self.device}


@dataclass(frozen=True)
class TuningRecord:
    """The last `eagle-bench --tune` run: when, on which backend, the tree it chose (now the
    manifest's tree) and the one before, measured speeds. `details`: its measurements (cost
    curves, calibration runs, candidates, ...), stored flat beside these keys; informational,
    read by no tool."""

    date: str
    backend: str
    chosen: TreeConfig
    previous: TreeConfig | None = None
    chosen_measured_tokens_per_s: float | None = None
    vanilla_tokens_per_s: float | None = None
    speedup_vs_vanilla: float | None = None
    details: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data, source: str = "tuning record") -> "TuningRecord":
        """A validated TuningRecord from its JSON object; ManifestError names a bad field."""
        return _tuning(s.read(s.TuningJSON, data, source))

    def to_json(self) -> dict:
        return {"date": self.date, "backend": self.backend, **self.details,
                "previous": self.previous.to_json() if self.previous else None, "chosen": self.chosen.to_json(),
                "chosen_measured_tokens_per_s": self.chosen_measured_tokens_per_s,
                "vanilla_tokens_per_s": self.vanilla_tokens_per_s, "speedup_vs_vanilla": self.speedup_vs_vanilla}


@dataclass(frozen=True)
class Engines:
    """Records beside the ONNX graphs: TensorRT engines and the last tree tuning (each None
    until made)."""

    trt: TrtRecord | None = None
    tuning: TuningRecord | None = None

    def to_json(self) -> dict:
        return {k: v.to_json() for k, v in (("trt", self.trt), ("tuning", self.tuning)) if v is not None}


@dataclass(frozen=True)
class Manifest:
    """Everything the runtime needs about an export (see engines/README.md). Frozen: change
    a copy with `dataclasses.replace` and `save` it."""

    name: str
    dims: Dims
    max_length: int  # KV capacity in tokens (prompt + generated), 2..dims.max_position_embeddings
    target: GraphEntry
    draft: DraftEntry
    tree: TreeConfig  # the default draft tree, valid for draft.graph_top_k
    eos_token_ids: tuple[int, ...]
    tokenizer: str | None  # folder name inside the export, or None
    chat_template: bool
    sources: Sources = field(default_factory=Sources)
    tools: Mapping[str, str] = field(default_factory=dict)  # tool -> version that produced the export
    engines: Engines = field(default_factory=Engines)
    notes: tuple[str, ...] = ()
    format_version: int = FORMAT_VERSION
    shared_weights: SharedWeights | None = None  # weights both graphs use, stored once (None: each holds its own)
    # every file of the folder but the manifest (empty in exports made before it was recorded)
    files: Mapping[str, FileRecord] = field(default_factory=dict)

    def notes_for(self, draft_graph: bool) -> tuple[str, ...]:
        """The notes a run should print: all of them, or (draft_graph False: vanilla decoding,
        the lookup drafter) those not about the draft graph (they start DRAFT_GRAPH_NOTE)."""
        return self.notes if draft_graph else tuple(n for n in self.notes if not n.startswith(DRAFT_GRAPH_NOTE))

    @property
    def length_limit(self) -> int:
        """The largest max_length a re-export of this model and head may have (`eagle-export
        --max-length`): the target's max_position_embeddings, and the head's when recorded."""
        head = self.draft.max_position_embeddings
        return min(self.dims.max_position_embeddings, head) if head else self.dims.max_position_embeddings

    def to_json(self) -> dict:
        return {"name": self.name, "dims": self.dims.to_json(), "max_length": self.max_length,
                "target": self.target.to_json(), "draft": self.draft.to_json(), "tree": self.tree.to_json(),
                "eos_token_ids": list(self.eos_token_ids), "tokenizer": self.tokenizer,
                "chat_template": self.chat_template, "sources": self.sources.to_json(), "tools": dict(self.tools),
                "engines": self.engines.to_json(), "notes": list(self.notes), "format_version": self.format_version,
                **({"shared_weights": self.shared_weights.to_json()} if self.shared_weights else {}),
                **({"files": {k: v.to_json() for k, v in self.files.items()}} if self.files else {})}

    def graph_dims(self, which: str) -> Dims:
        """The dims graph `which` ("target" | "draft") runs with: the target's, except that an
        EAGLE-3 head has its own hidden width, heads and head dim (its KV buffer and
        `features` / `next_features` are sized by them)."""
        head = self.draft.head if which == "draft" else None
        if head is None or head.kind != "eagle3":
            return self.dims
        return replace(self.dims, hidden=head.hidden, num_heads=head.num_heads, num_kv_heads=head.num_kv_heads,
                       head_dim=head.head_dim)

    def save(self, folder: Path) -> Path:
        path = Path(folder) / MANIFEST_FILE
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=2) + "\n")
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
        """A validated Manifest from parsed JSON; `source` prefixes every error message."""
        return _manifest(s.read_manifest(data, source))


# ---------------------------------------------------------------------------------------------
# Validated JSON (manifest_schema) -> records


def _manifest(m: s.ManifestJSON) -> Manifest:
    """The records of a validated manifest, with the defaults of older exports filled in."""
    dims = Dims(**m.dims.model_dump())
    trained = True if m.sources.draft.trained is None else m.sources.draft.trained  # exports without extra.trained
    x = m.draft.extra
    head = None if x.head is None else HeadRecord("eagle") if x.head.kind == "eagle" else HeadRecord(
        x.head.kind, *(getattr(x.head, k) for k in s.HEAD_SIZES), tuple(x.head.feature_layers), x.head.layout)
    draft = DraftEntry(**_graph(m.draft), graph_top_k=x.graph_top_k,
                       trained=trained if x.trained is None else x.trained,
                       draft_vocab_size=dims.vocab if x.draft_vocab_size is None else x.draft_vocab_size,
                       draft_vocab_file=x.draft_vocab_file, draft_vocab_source=x.draft_vocab_source,
                       max_position_embeddings=x.max_position_embeddings, head=head)
    layers = m.target.extra.feature_layers
    target = GraphEntry(**_graph(m.target), feature_layers=None if layers is None else tuple(layers))
    sw = m.shared_weights
    shared = None if sw is None else SharedWeights(file=sw.file, size=sw.size, sha256=sw.sha256, tensors=tuple(
        SharedTensor(**{**t.model_dump(), "shape": tuple(t.shape)}) for t in sw.tensors))
    src, engines = m.sources, m.engines
    return Manifest(
        name=m.name, dims=dims, max_length=m.max_length, target=target, draft=draft, tree=m.tree.tree(),
        eos_token_ids=tuple(m.eos_token_ids), tokenizer=m.tokenizer, chat_template=m.chat_template,
        sources=Sources(SourceRecord(src.target.spec, src.target.path, dict(src.target.sha256)),
                        SourceRecord(src.draft.spec, src.draft.path, dict(src.draft.sha256), src.draft.trained)),
        tools=dict(m.tools), notes=tuple(m.notes), format_version=m.format_version, shared_weights=shared,
        engines=Engines(trt=engines.trt and _trt(engines.trt), tuning=engines.tuning and _tuning(engines.tuning)),
        files={k: FileRecord(f.size, f.sha256, f.sampled_sha256) for k, f in (m.files or {}).items()})


def _graph(g: s.GraphJSON) -> dict:
    """The GraphEntry fields target and draft share."""
    q = g.extra.quant
    quant = None if q is None else QuantRecord(kind=q.kind, method=q.method, tool=q.tool,
                                               quantised_matmuls=q.quantised_matmuls,
                                               batch_invariant=q.batch_invariant, settings=dict(q.model_extra))
    return dict(path=g.path, dtype=g.dtype, inputs=tuple(x.spec() for x in g.inputs),
                outputs=tuple(x.spec() for x in g.outputs), quant=g.quant, sha256=g.sha256, quant_info=quant,
                ragged_batch=g.extra.ragged_batch)


def _trt(t: s.TrtJSON) -> TrtRecord:
    profiles = {w: tuple(ProfileSpec.from_json({"name": p.name, "shapes": p.shapes}) for p in ps)
                for w, ps in t.profiles.items()}
    return TrtRecord(files=dict(t.files), profiles=profiles, trt_version=t.trt_version, timing_cache=t.timing_cache,
                     strongly_typed=t.strongly_typed, max_length=t.max_length, draft_capacity=t.draft_capacity,
                     onnx_sha256=dict(t.onnx_sha256), device=t.device)


def _tuning(t: s.TuningJSON) -> TuningRecord:
    return TuningRecord(date=t.date, backend=t.backend, chosen=t.chosen.tree(),
                        previous=t.previous.tree() if t.previous is not None else None,
                        chosen_measured_tokens_per_s=t.chosen_measured_tokens_per_s,
                        vanilla_tokens_per_s=t.vanilla_tokens_per_s, speedup_vs_vanilla=t.speedup_vs_vanilla,
                        details=dict(t.model_extra))


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
