"""`manifest.json`: what an export folder holds, read by the runtime instead of guessing.

Written by `eagle-export` beside the graphs; the runtime reads only this file, the graphs and
the tokenizer folder (it never imports the torch model).

`Manifest.load` returns typed, frozen records and validates everything it reads: a missing
key, a wrong type, a non-positive size, dims that contradict each other or the graphs' I/O
lists, a tree the draft graph cannot serve. Each problem is one `ManifestError` line naming
the field, what was expected and what was found, e.g.

    /x/manifest.json max_length: expected an integer >= 2, found -3

`check_graph_io` compares a graph entry with the inputs/outputs an opened graph reports
(backends call it when they open a session).

JSON layout (format 1, unchanged): the draft record (`graph_top_k`, `trained`, ...) and the
quantisation record live under each graph's `"extra"` object; `engines` holds `"trt"`
(`TrtRecord`) and `"tuning"` (`TuningRecord`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Mapping, NoReturn, Sequence

from . import onnx_io as c
from .dtypes import FLOAT_NAMES, NAMES
from .onnx_io import MANIFEST_FILE, TensorSpec
from .profiles import ProfileSpec
from .tree_config import TreeConfig, TreeConfigError

FORMAT_VERSION = 1
QUANT_KINDS = ("int4", "int8")  # weight quantisation of a graph (`eagle-export --quant`)
# `eagle-export --draft-quant`: quantisation of the draft graph's weights (MatMulNBits); the rule
# and its measurements are in exporter.export.draft_quant_for
DRAFT_QUANTS = ("auto", "none") + QUANT_KINDS
GRAPHS = ("target", "draft")
# how a reduced draft vocabulary was ranked: the head's token_counts.npy (response-token
# frequencies from eagle-train), the tokenizer's merge rank (BPE merge order; no data needed),
# or token id order (tokenizers without merges), see exporter/draft_vocab.py; or an EAGLE-3
# head's own draft vocabulary (its d2t table), see exporter/eagle3.py
DRAFT_VOCAB_SOURCES = ("token_counts", "merge_rank", "token_id", "head_d2t")
SHARED_ROLES = ("embedding", "lm_head")  # SharedTensor.role
HEAD_KINDS = ("eagle", "eagle3")  # HeadRecord.kind: EAGLE-1/2 heads, EAGLE-3 heads


class ManifestError(ValueError):
    """An export folder or its manifest is missing, malformed or of another format version."""


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
    `layout`: the checkpoint layout it was read from (exporter/eagle3.py), for the record."""

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
        if not path.is_file():
            raise ManifestError(f"{path} is missing: {what}; copy the whole export folder or re-export")
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
        return _read_trt(_Obj(source, "", data))

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

    _TYPED = ("date", "backend", "chosen", "previous", "chosen_measured_tokens_per_s", "vanilla_tokens_per_s",
              "speedup_vs_vanilla")

    @classmethod
    def from_json(cls, data, source: str = "tuning record") -> "TuningRecord":
        """A validated TuningRecord from its JSON object; ManifestError names a bad field."""
        return _read_tuning(_Obj(source, "", data), None)

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
        if not path.exists():
            raise ManifestError(f"{folder} is not an export folder (no {MANIFEST_FILE}); run eagle-export first")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ManifestError(f"{path} is not valid JSON: {err}") from None
        except (OSError, UnicodeDecodeError) as err:
            raise ManifestError(f"{path} cannot be read ({type(err).__name__}: {err}); re-export") from None
        return cls.from_json(data, str(path))

    @classmethod
    def from_json(cls, data, source: str = MANIFEST_FILE) -> "Manifest":
        """A validated Manifest from parsed JSON; `source` prefixes every error message."""
        return _read_manifest(data, source)


# ---------------------------------------------------------------------------------------------
# Reading with one-line errors

_MISSING = object()


class _Said(str):
    """A found value already described in words (shown as is, not quoted)."""


def _shown(value) -> str:
    if value is _MISSING:
        return "nothing (the key is missing)"
    if isinstance(value, _Said):
        return str(value)
    text = repr(value) if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


class _Obj:
    """One JSON object of the manifest; every accessor names its field in the error."""

    def __init__(self, source: str, where: str, data, what: str = "a JSON object"):
        self.source, self.where = source, where
        if not isinstance(data, dict):
            _fail(source, where or "(top level)", what, data)
        self.data = data

    def name(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def fail(self, key: str, expected: str, found=_MISSING) -> NoReturn:
        _fail(self.source, self.name(key), expected, found)

    def only(self, keys: Sequence[str]) -> None:
        unknown = [k for k in self.data if k not in keys]
        if unknown:
            key = unknown[0]
            _fail(self.source, self.name(key), f"no such field (known: {', '.join(keys)})", self.data[key])

    def integer(self, key: str, minimum: int | None = None, default=_MISSING, optional: bool = False):
        value = self.data.get(key, default)
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
            expected = "an integer" if minimum is None else f"an integer >= {minimum}"
            self.fail(key, expected + (" or null" if optional else ""), value)
        return value

    def number(self, key: str, default=_MISSING, optional: bool = False, positive: bool = False):
        value = self.data.get(key, default)
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (positive and not value > 0):
            self.fail(key, ("a positive number" if positive else "a number") + (" or null" if optional else ""), value)
        return value

    def string(self, key: str, default=_MISSING, optional: bool = False, choices: Sequence | None = None):
        value = self.data.get(key, default)
        if value is None and (optional or (choices and None in choices)):
            return None
        bad = choices is not None and value not in choices or choices is None and not value
        if not isinstance(value, str) or bad:
            expected = (f"one of {', '.join('null' if x is None else str(x) for x in choices)}" if choices
                        else "a non-empty string")
            self.fail(key, expected + (" or null" if optional else ""), value)
        return value

    def boolean(self, key: str, default=_MISSING, optional: bool = False):
        value = self.data.get(key, default)
        if value is None and optional:
            return None
        if not isinstance(value, bool):
            self.fail(key, "true or false" + (" or null" if optional else ""), value)
        return value

    def obj(self, key: str, default=_MISSING, what: str = "a JSON object") -> "_Obj":
        value = self.data.get(key, default)
        if not isinstance(value, dict):
            self.fail(key, what, value)
        return _Obj(self.source, self.name(key), value)

    def array(self, key: str, default=_MISSING) -> list:
        value = self.data.get(key, default)
        if not isinstance(value, list):
            self.fail(key, "a JSON list", value)
        return value

    def str_map(self, key: str, default=_MISSING, nullable: bool = False) -> dict:
        o = self.obj(key, default)
        return {k: o.string(k, optional=nullable) for k in o.data}


def _is_size(d) -> bool:
    return isinstance(d, int) and not isinstance(d, bool) and d >= 0


def _fail(source: str, name: str, expected: str, found=_MISSING) -> NoReturn:
    raise ManifestError(f"{source} {name}: expected {expected}, found {_shown(found)}")


def _read_manifest(data, source: str) -> Manifest:
    if not isinstance(data, dict):
        raise ManifestError(f"{source} is malformed: expected a JSON object, found {type(data).__name__}; re-export")
    top = _Obj(source, "", data)
    version = data.get("format_version", _MISSING)
    if version != FORMAT_VERSION:
        raise ManifestError(f"{source} format_version: expected {FORMAT_VERSION} (what this runtime reads), found "
                            f"{_shown(version)}; re-export")
    top.only([f.name for f in fields(Manifest)])
    dims = _read_dims(top.obj("dims"))
    max_length = top.integer("max_length", minimum=2)
    if max_length > dims.max_position_embeddings:
        top.fail("max_length", f"at most dims.max_position_embeddings {dims.max_position_embeddings}", max_length)
    sources = _read_sources(top.obj("sources"))
    target = _read_graph(top.obj("target", what="a graph entry (JSON object)"), dims, draft=False)
    trained = True if sources.draft.trained is None else sources.draft.trained  # exports without draft.extra.trained
    draft = _read_graph(top.obj("draft", what="a graph entry (JSON object)"), dims, draft=True, trained=trained)
    taps = draft.head.feature_layers if draft.head is not None and draft.head.kind == "eagle3" else None
    if target.feature_layers != taps:
        top.fail("target.extra.feature_layers", f"{_shown(list(taps) if taps else None)} (the draft head's "
                                                "draft.extra.head.feature_layers)",
                 list(target.feature_layers) if target.feature_layers else None)
    if draft.max_position_embeddings is not None and max_length > draft.max_position_embeddings:
        top.fail("max_length", f"at most draft.extra.max_position_embeddings {draft.max_position_embeddings} "
                               "(the draft head's position limit)", max_length)
    tree = _read_tree(top.obj("tree"), draft.graph_top_k)
    shared = _read_shared(top.obj("shared_weights"), target, draft) if "shared_weights" in data else None
    eos = top.array("eos_token_ids")
    for i, e in enumerate(eos):
        if isinstance(e, bool) or not isinstance(e, int) or e < 0:
            top.fail(f"eos_token_ids[{i}]", "a token id (integer >= 0)", e)
    notes = top.array("notes", default=[])
    for i, n in enumerate(notes):
        if not isinstance(n, str):
            top.fail(f"notes[{i}]", "a string", n)
    return Manifest(
        name=top.string("name"), dims=dims, max_length=max_length, target=target, draft=draft, tree=tree,
        eos_token_ids=tuple(eos), tokenizer=top.string("tokenizer", optional=True),
        chat_template=top.boolean("chat_template"), sources=sources,
        tools=top.str_map("tools"), engines=_read_engines(top.obj("engines", default={}), draft.graph_top_k),
        notes=tuple(notes), format_version=version, shared_weights=shared,
        files=_read_files(top.obj("files")) if "files" in data else {})


def _read_files(o: _Obj) -> dict[str, FileRecord]:
    records = {}
    for path in o.data:
        parts = path.split("/")
        if path == MANIFEST_FILE or "\\" in path or any(p in ("", ".", "..") for p in parts):
            _fail(o.source, f"{o.where}[{path!r}]", "a relative file path inside the export folder ('/'-separated)",
                  path)
        f = o.obj(path)
        f.only([x.name for x in fields(FileRecord)])
        records[path] = FileRecord(size=f.integer("size", minimum=0), sha256=_hex(f, "sha256"),
                                   sampled_sha256=_hex(f, "sampled_sha256") if "sampled_sha256" in f.data else None)
    return records


def _hex(o: _Obj, key: str) -> str:
    value = o.data.get(key, _MISSING)
    if not (isinstance(value, str) and len(value) == 64 and all(ch in "0123456789abcdef" for ch in value)):
        o.fail(key, "a sha256 (64 lowercase hex digits)", value)
    return value


def _read_shared(o: _Obj, target: GraphEntry, draft: GraphEntry) -> SharedWeights:
    o.only([f.name for f in fields(SharedWeights)])
    file = o.string("file")
    if "/" in file or "\\" in file or file in (".", "..") or file in (target.path, draft.path):
        o.fail("file", "a data file name inside the export folder", file)
    size = o.integer("size", minimum=0)
    tensors = []
    for i, raw in enumerate(o.array("tensors")):
        t = _Obj(o.source, f"{o.name('tensors')}[{i}]", raw, "a shared tensor {role, target_name, draft_name, ...}")
        t.only([f.name for f in fields(SharedTensor)])
        shape = t.array("shape")
        for axis, d in enumerate(shape):
            if not _is_size(d):
                t.fail(f"shape[{axis}]", "an integer >= 0", d)
        tensor = SharedTensor(role=t.string("role", choices=SHARED_ROLES), target_name=t.string("target_name"),
                              draft_name=t.string("draft_name"), dtype=t.string("dtype", choices=NAMES),
                              shape=tuple(shape), offset=t.integer("offset", minimum=0),
                              length=t.integer("length", minimum=0))
        if tensor.offset + tensor.length > size:
            t.fail("length", f"at most {size - tensor.offset} (the shared file is {size} bytes)", tensor.length)
        tensors.append(tensor)
    return SharedWeights(file=file, size=size, tensors=tuple(tensors), sha256=o.string("sha256", default=None,
                                                                                          optional=True))


def _read_dims(o: _Obj) -> Dims:
    o.only([f.name for f in fields(Dims)])
    ints = {f.name: o.integer(f.name, minimum=1) for f in fields(Dims) if f.name != "rms_norm_eps"}
    dims = Dims(**ints, rms_norm_eps=float(o.number("rms_norm_eps", positive=True)))
    if dims.num_kv_heads > dims.num_heads or dims.num_heads % dims.num_kv_heads:
        o.fail("num_kv_heads", f"a divisor of dims.num_heads {dims.num_heads}", dims.num_kv_heads)
    return dims


def _read_specs(o: _Obj, key: str) -> tuple[TensorSpec, ...]:
    specs = []
    for i, raw in enumerate(o.array(key)):
        s = _Obj(o.source, f"{o.name(key)}[{i}]", raw, "a tensor spec {name, dtype, shape}")
        s.only(["name", "dtype", "shape"])
        shape = s.array("shape")
        for axis, d in enumerate(shape):
            if isinstance(d, bool) or not (isinstance(d, str) and d or isinstance(d, int) and d >= 0):
                s.fail(f"shape[{axis}]", "a dimension (integer >= 0 or a symbol)", d)
        s.string("name")
        s.string("dtype", choices=NAMES)
        specs.append(TensorSpec.from_json(raw))
    return tuple(specs)


def _read_quant(o: _Obj) -> QuantRecord:
    typed = ("kind", "method", "tool", "quantised_matmuls", "batch_invariant")
    settings = {k: v for k, v in o.data.items() if k not in typed}
    for k, v in settings.items():
        if v is not None and not isinstance(v, (bool, int, float, str)):
            o.fail(k, "a quantisation setting (number, string or boolean)", v)
    return QuantRecord(kind=o.string("kind", choices=QUANT_KINDS), method=o.string("method"),
                       tool=o.string("tool", default="onnxruntime.quantization"),
                       quantised_matmuls=o.integer("quantised_matmuls", minimum=0, default=None, optional=True),
                       batch_invariant=o.boolean("batch_invariant", default=None, optional=True), settings=settings)


def _read_graph(o: _Obj, dims: Dims, draft: bool, trained: bool = True) -> GraphEntry:
    o.only([f.name for f in fields(GraphEntry) if f.name != "quant_info"] + ["extra"])
    path = o.string("path")
    if "/" in path or "\\" in path or path in (".", ".."):
        o.fail("path", "a file name inside the export folder", path)
    dtype = o.string("dtype", choices=FLOAT_NAMES)
    inputs, outputs = _read_specs(o, "inputs"), _read_specs(o, "outputs")
    quant = o.string("quant", default=None, choices=QUANT_KINDS + (None,))
    sha = o.string("sha256", default=None, optional=True)
    extra = o.obj("extra", default={})
    extra.only(["graph_top_k", "draft_vocab_size", "trained", "draft_vocab_file", "draft_vocab_source",
                "max_position_embeddings", "quant", "head", "ragged_batch"] if draft
               else ["quant", "feature_layers", "ragged_batch"])
    quant_info = _read_quant(extra.obj("quant")) if "quant" in extra.data else None
    if quant_info is not None and quant_info.kind != quant:
        o.fail("quant", f"{quant_info.kind!r} (as {extra.name('quant')}.kind says)", quant)
    common = dict(path=path, dtype=dtype, inputs=inputs, outputs=outputs, quant=quant, sha256=sha,
                  quant_info=quant_info, ragged_batch=extra.boolean("ragged_batch", default=False))
    if not draft:
        layers = _read_layers(extra, dims.num_layers) if "feature_layers" in extra.data else None
        entry = GraphEntry(**common, feature_layers=layers)
        _check_layers(o, entry, dims.num_layers)
        _check_contract(o, entry, *c.target_io(dims.num_layers, dtype, entry.kv_layout,
                                               len(layers) * dims.hidden if layers else None))
        return entry
    top_k = extra.integer("graph_top_k", minimum=1)
    vocab_size = extra.integer("draft_vocab_size", minimum=1, default=dims.vocab)
    if not top_k <= vocab_size <= dims.vocab:
        extra.fail("draft_vocab_size", f"an integer in [graph_top_k {top_k}, dims.vocab {dims.vocab}]", vocab_size)
    entry = DraftEntry(**common, graph_top_k=top_k, trained=extra.boolean("trained", default=trained),
                       draft_vocab_size=vocab_size,
                       draft_vocab_file=extra.string("draft_vocab_file", default=None, optional=True),
                       draft_vocab_source=extra.string("draft_vocab_source", default=None,
                                                       choices=DRAFT_VOCAB_SOURCES + (None,)),
                       max_position_embeddings=extra.integer("max_position_embeddings", minimum=2, default=None,
                                                             optional=True),
                       head=_read_head(extra.obj("head"), dims) if "head" in extra.data else None)
    found_k = next((s.shape[-1] for s in outputs if s.name == c.TOPK_IDS and s.shape), top_k)
    if isinstance(found_k, int) and found_k != top_k:
        extra.fail("graph_top_k", f"{found_k} (the last dimension of draft.outputs {c.TOPK_IDS!r})", top_k)
    tapped = entry.head.tapped_width(dims.hidden) if entry.head is not None else None
    _check_contract(o, entry, *c.draft_io(dtype, top_k, entry.kv_layout, tapped))
    return entry


def _read_layers(o: _Obj, num_layers: int) -> tuple[int, ...]:
    """`feature_layers`: distinct layer ids in [0, num_layers), ascending."""
    layers = o.array("feature_layers")
    for i, v in enumerate(layers):
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < num_layers:
            o.fail(f"feature_layers[{i}]", f"a decoder layer id in [0, dims.num_layers {num_layers})", v)
    if not layers or list(layers) != sorted(set(layers)):
        o.fail("feature_layers", "distinct layer ids in ascending order", layers)
    return tuple(layers)


def _read_head(o: _Obj, dims: Dims) -> HeadRecord:
    kind = o.string("kind", choices=HEAD_KINDS)
    if kind == "eagle":  # the target's geometry: nothing else to record
        o.only(["kind"])
        return HeadRecord(kind)
    o.only([f.name for f in fields(HeadRecord)])
    sizes = {k: o.integer(k, minimum=1) for k in ("hidden", "num_heads", "num_kv_heads", "head_dim")}
    if sizes["num_heads"] % sizes["num_kv_heads"]:
        o.fail("num_kv_heads", f"a divisor of num_heads {sizes['num_heads']}", sizes["num_kv_heads"])
    return HeadRecord(kind=kind, **sizes, feature_layers=_read_layers(o, dims.num_layers),
                      layout=o.string("layout", default=None, optional=True))


def _check_layers(o: _Obj, entry: GraphEntry, num_layers: int) -> None:
    """dims.num_layers against the layers whose KV the (well-named) inputs hold; misnamed KV
    inputs are left to _check_contract, which names the first one."""
    found = entry.num_kv_layers()
    past = [s.name for s in entry.inputs if s.name.startswith("past_key_values.")]
    if found != num_layers and past == [p for p, _ in c.kv_names(found)]:
        _fail(o.source, "dims.num_layers", f"{found} ({o.name('inputs')} holds the KV of {found} layers)", num_layers)


def _check_contract(o: _Obj, entry: GraphEntry, inputs: list[TensorSpec], outputs: list[TensorSpec]) -> None:
    """The entry's I/O lists are the ONNX contract's for its dims, dtype and top-k."""
    for key, declared, expected in (("inputs", entry.inputs, inputs), ("outputs", entry.outputs, outputs)):
        for i, (d, e) in enumerate(zip(declared, expected)):
            if d != e:
                part = "name" if d.name != e.name else "dtype" if d.dtype != e.dtype else "shape"
                want, got = {"name": (e.name, d.name), "dtype": (e.dtype, d.dtype),
                             "shape": (list(e.shape), list(d.shape))}[part]
                of = "" if part == "name" else f" for {e.name!r}"
                _fail(o.source, f"{o.name(key)}[{i}].{part}", f"{_shown(want)} (the ONNX I/O contract{of})", got)
        if len(declared) != len(expected):
            _fail(o.source, o.name(key), f"{len(expected)} tensors (the ONNX I/O contract)",
                  _Said(f"{len(declared)} tensors"))


def _read_tree(o: _Obj, graph_top_k: int | None) -> TreeConfig:
    o.only([f.name for f in fields(TreeConfig)])
    choices = o.data.get("choices")
    if choices is not None:
        if not isinstance(choices, list) or not all(
                isinstance(p, list) and p and all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in p)
                for p in choices):
            o.fail("choices", "null or a list of paths (non-empty lists of child ranks >= 0)", choices)
        choices = tuple(tuple(p) for p in choices)
    tree = TreeConfig(kind=o.string("kind", choices=("dynamic", "static")),
                      total_tokens=o.integer("total_tokens", minimum=1), depth=o.integer("depth", minimum=1),
                      top_k=o.integer("top_k", minimum=1), choices=choices)
    if graph_top_k is not None and tree.top_k > graph_top_k:
        o.fail("top_k", f"at most draft.extra.graph_top_k {graph_top_k}", tree.top_k)
    try:
        return tree.validate(tree.top_k if graph_top_k is None else graph_top_k)
    except TreeConfigError as err:
        raise ManifestError(f"{o.source} {o.where}: {err}") from None


def _read_source(o: _Obj, draft: bool) -> SourceRecord:
    o.only(["spec", "path", "sha256", "trained"] if draft else ["spec", "path", "sha256"])
    return SourceRecord(spec=o.string("spec", default=None, optional=True),
                        path=o.string("path", default=None, optional=True), sha256=o.str_map("sha256", default={}),
                        trained=o.boolean("trained", default=None, optional=True) if draft else None)


def _read_sources(o: _Obj) -> Sources:
    o.only(list(GRAPHS))
    return Sources(target=_read_source(o.obj("target", default={}), False),
                   draft=_read_source(o.obj("draft", default={}), True))


def _read_engines(o: _Obj, graph_top_k: int) -> Engines:
    o.only(["trt", "tuning"])
    trt = _read_trt(o.obj("trt")) if "trt" in o.data else None
    tuning = _read_tuning(o.obj("tuning"), graph_top_k) if "tuning" in o.data else None
    return Engines(trt=trt, tuning=tuning)


def _read_trt(o: _Obj) -> TrtRecord:
    o.only([f.name for f in fields(TrtRecord)])
    files = o.str_map("files")
    profiles_obj = o.obj("profiles", default={})
    profiles = {}
    for which in profiles_obj.data:
        specs = []
        for i, raw in enumerate(profiles_obj.array(which)):
            p = _Obj(o.source, f"{profiles_obj.name(which)}[{i}]", raw)
            shapes = p.obj("shapes")
            for name, mom in shapes.data.items():
                if not (isinstance(mom, list) and len(mom) == 3 and all(
                        isinstance(s, list) and all(_is_size(d) for d in s) for s in mom)):
                    shapes.fail(name, "[min, opt, max] shapes (lists of integers >= 0)", mom)
            specs.append(ProfileSpec.from_json({"name": p.string("name"), "shapes": shapes.data}))
        profiles[which] = tuple(specs)
    for key, mapping in (("files", files), ("profiles", profiles)):
        for which in mapping:
            if which not in GRAPHS:
                _fail(o.source, f"{o.name(key)}.{which}", f"a graph name ({', '.join(GRAPHS)})", which)
    return TrtRecord(files=files, profiles=profiles, trt_version=o.string("trt_version"),
                     timing_cache=o.string("timing_cache", default=None, optional=True),
                     strongly_typed=o.boolean("strongly_typed", default=True),
                     max_length=o.integer("max_length", minimum=2, default=None, optional=True),
                     draft_capacity=o.integer("draft_capacity", minimum=2, default=None, optional=True),
                     onnx_sha256=o.str_map("onnx_sha256", default={}, nullable=True),
                     device=o.string("device", default=None, optional=True))


def _read_tuning(o: _Obj, graph_top_k: int | None) -> TuningRecord:
    details = {k: v for k, v in o.data.items() if k not in TuningRecord._TYPED}
    previous = _read_tree(o.obj("previous"), graph_top_k) if o.data.get("previous") is not None else None
    return TuningRecord(date=o.string("date"), backend=o.string("backend"),
                        chosen=_read_tree(o.obj("chosen"), graph_top_k), previous=previous,
                        chosen_measured_tokens_per_s=o.number("chosen_measured_tokens_per_s", default=None,
                                                              optional=True),
                        vanilla_tokens_per_s=o.number("vanilla_tokens_per_s", default=None, optional=True),
                        speedup_vs_vanilla=o.number("speedup_vs_vanilla", default=None, optional=True), details=details)


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
