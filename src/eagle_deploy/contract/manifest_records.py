"""The records of `manifest.json` (`contract/manifest.py` holds the `Manifest` itself): frozen
pydantic models on `manifest_json.Record`, each field declared once with its type, default and
check (a new field is one line here), written by `model_dump(mode="json")`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Optional

from annotated_types import Gt
from pydantic import AfterValidator, ConfigDict, field_validator, model_validator

from . import onnx_io as c
from .dtypes import FLOAT_NAMES, NAMES
from .errors import ManifestError, unreadable
from .field_errors import Expect, JsonAt, failed
from .manifest_json import Number, Record, Sha256, Text, at_least, omitted
from .onnx_io import TensorSpec
from .profiles import ProfileSpec
from .tree_config import TreeConfig, TreeConfigError

QUANT_KINDS = ("int4", "int8")  # weight quantisation of a graph (`eagle-export --quant`)
GRAPHS = ("target", "draft")
# an export's optional graph beside them: the target's I/O contract with int8 weights and per-token
# int8 activations, run for prompt forwards only (`eagle-export --prefill-weights int8`, Manifest.prefill)
PREFILL_GRAPH = "prefill"
# how a reduced draft vocabulary was ranked: the head's token_counts.npy (response-token
# frequencies from eagle-train), the tokenizer's merge rank (BPE merge order; no data needed),
# or token id order (tokenizers without merges), see exporter/draft_vocab.py; or an EAGLE-3
# head's own draft vocabulary (its d2t table), see heads/eagle3_checkpoint.py
DRAFT_VOCAB_SOURCES = ("token_counts", "merge_rank", "token_id", "head_d2t")
SHARED_ROLES = ("embedding", "lm_head")  # SharedTensor.role
HEAD_KINDS = ("eagle", "eagle3")  # HeadRecord.kind: EAGLE-1/2 heads, EAGLE-3 heads
HEAD_SIZES = ("hidden", "num_heads", "num_kv_heads", "head_dim")

# ---------------------------------------------------------------------------------------------
# Field types


def _valid_tree(tree: TreeConfig) -> TreeConfig:
    try:
        return tree.validate(tree.top_k)
    except TreeConfigError as err:
        raise failed(text=str(err)) from None


GraphName = Annotated[Literal[GRAPHS], Expect(f"a graph name ({', '.join(GRAPHS)})")]
Spec = Annotated[TensorSpec, Expect("a tensor spec {name, dtype, shape}")]
Tree = Annotated[TreeConfig, AfterValidator(_valid_tree)]
LayerIds = tuple[at_least(0), ...]  # decoder layer ids (Manifest checks them against dims.num_layers)

# ---------------------------------------------------------------------------------------------
# The records


class Dims(Record):
    """Static dimensions of the target model (all > 0). `num_kv_heads` divides `num_heads`;
    `head_dim` is explicit (Mistral-Nemo-style models have num_heads * head_dim != hidden)."""

    num_layers: at_least(1)
    hidden: at_least(1)
    num_heads: at_least(1)
    num_kv_heads: at_least(1)
    head_dim: at_least(1)
    vocab: at_least(1)
    max_position_embeddings: at_least(1)
    rms_norm_eps: Annotated[float, Gt(0)]

    @model_validator(mode="after")
    def _heads_divide(self):
        if self.num_kv_heads > self.num_heads or self.num_heads % self.num_kv_heads:
            raise failed("num_kv_heads", expected=f"a divisor of dims.num_heads {self.num_heads}")
        return self


class HeadRecord(Record):
    """What kind of draft head the draft graph runs (JSON: the draft's `extra.head`).

    kind "eagle": an EAGLE-1/2 head (arXiv 2401.15077 / 2406.16858), fed the target's final
    features, with the target's geometry (nothing else recorded). kind "eagle3" (arXiv
    2503.01840): fed the hidden states entering the target's decoder layers `feature_layers`
    (the target graph's `tapped_features`), with its own hidden width, heads and head dim
    (which may differ from the target's), its own norm, LM head and draft vocabulary.
    `layout`: the checkpoint layout it was read from (heads/eagle3_checkpoint.py), for the record."""

    kind: Literal[HEAD_KINDS]
    hidden: Optional[at_least(1)] = omitted(None)
    num_heads: Optional[at_least(1)] = omitted(None)
    num_kv_heads: Optional[at_least(1)] = omitted(None)
    head_dim: Optional[at_least(1)] = omitted(None)
    feature_layers: LayerIds = omitted(())
    layout: Optional[Text] = omitted(None)

    @model_validator(mode="after")
    def _fields_of_its_kind(self):
        if self.kind == "eagle":  # the target's geometry: nothing else to record
            for key, f in type(self).model_fields.items():
                if key != "kind" and getattr(self, key) != f.default:
                    raise failed(key, expected="no such field (known: kind)")
            return self
        for key in HEAD_SIZES:
            if getattr(self, key) is None:
                raise failed(key, expected="an integer >= 1")
        if self.num_heads % self.num_kv_heads:
            raise failed("num_kv_heads", expected=f"a divisor of num_heads {self.num_heads}")
        if not self.feature_layers:
            raise failed("feature_layers", expected="a non-empty list of decoder layer ids")
        return self

    def tapped_width(self, target_hidden: int) -> int | None:
        """Width of the draft graph's `tapped_features` input (taps x target hidden); None for
        EAGLE-1/2 heads."""
        return len(self.feature_layers) * target_hidden if self.kind == "eagle3" else None


class QuantRecord(Record):
    """How a graph was quantised (JSON: the graph's `extra.quant`). `settings`: the method's
    options (block_size, accuracy_level, symmetric | per_channel, reduce_range), given as
    keywords and stored flat beside the other keys. batch_invariant: do a graph's rows stay
    independent of the batch (exporter.quantize.batch_invariant)."""

    model_config = ConfigDict(extra="allow")
    kind: Literal[QUANT_KINDS]
    method: Text  # "nbits" | "dynamic"
    tool: Text = "onnxruntime.quantization"
    quantised_matmuls: Optional[at_least(0)] = omitted(None)
    batch_invariant: bool

    @property
    def settings(self) -> dict[str, Any]:
        return dict(self.model_extra or {})

    @model_validator(mode="after")
    def _settings_are_plain(self):
        for key, value in self.settings.items():
            if value is not None and not isinstance(value, (bool, int, float, str)):
                raise failed(key, expected="a quantisation setting (number, string or boolean)")
        return self


def _extra(key: str) -> JsonAt:
    return JsonAt("extra", key)


class GraphEntry(Record):
    """One exported graph: file (inside the export folder), activation/KV dtype, its inputs
    and outputs in graph order (the ONNX contract, `onnx_io.target_io` / `draft_io`),
    quantisation (quant: None | "int4" | "int8", details in quant_info) and the file's sha256.
    `feature_layers`: a target graph of an EAGLE-3 export, the layers it taps. `ragged_batch`:
    rows of one batch may have different past lengths, each read from its own mask (contract
    "Batched forwards": the fused graphs). `repeats_one_row`: a fused target graph whose
    attention runs a one-token call as two rows itself, writing one spare KV row (contract
    "One-row queries"); False (older exports, standard graphs): runtimes that need a one-token
    forward's two-row bits run it as two rows."""

    path: Text
    dtype: Literal[FLOAT_NAMES]
    inputs: tuple[Spec, ...]
    outputs: tuple[Spec, ...]
    quant: Optional[Literal[QUANT_KINDS]] = None
    sha256: Optional[Text] = None
    quant_info: Annotated[Optional[QuantRecord], _extra("quant")] = omitted(None)
    feature_layers: Annotated[Optional[LayerIds], _extra("feature_layers")] = omitted(None)
    ragged_batch: Annotated[bool, _extra("ragged_batch")] = omitted(False)
    repeats_one_row: Annotated[bool, _extra("repeats_one_row")] = omitted(False)

    @field_validator("path")
    @classmethod
    def _a_file_name(cls, path: str) -> str:
        if "/" in path or "\\" in path or path in (".", ".."):
            raise failed(expected="a file name inside the export folder")
        return path

    @model_validator(mode="after")
    def _repeats_in_fused_graphs(self):
        if self.repeats_one_row and self.kv_layout != c.KV_SHARED:
            raise failed("repeats_one_row", expected=f"false for a graph of KV layout {self.kv_layout!r} (only fused "
                                                     f"graphs, KV layout {c.KV_SHARED!r}, repeat one-row queries)")
        return self

    def num_kv_layers(self) -> int:
        """Layers whose KV this graph takes (its `past_key_values.*` inputs, two per layer)."""
        return sum(1 for s in self.inputs if s.name.startswith("past_key_values.")) // 2

    @property
    def kv_layout(self) -> str:
        """How this graph takes its KV (`onnx_io.KV_LAYOUTS`), read from its KV specs' shape:
        "seq_major" (standard ops) or "shared" (fused GroupQueryAttention, one buffer in and
        out). Manifest.load accepts only these two."""
        return c.kv_layout_of(self.inputs) or c.KV_SEQ_MAJOR


class DraftEntry(GraphEntry):
    """The draft graph and its head: graph_top_k (the top-k computed in-graph; trees may use
    any top_k up to it), trained (False: a random head), draft_vocab_size (tokens the head can
    propose: the vocabulary when not reduced), draft_vocab_file (those ids, .npy, when reduced),
    draft_vocab_source (how they were ranked: one of DRAFT_VOCAB_SOURCES), max_position_embeddings
    (the head's own position limit), head (its kind and geometry), num_layers (the head's
    decoder layers, each with its KV in the graph's I/O; left out of the JSON when 1, so a
    manifest without it reads as 1). JSON: the graph's `extra`."""

    graph_top_k: Annotated[at_least(1), _extra("graph_top_k")]
    draft_vocab_size: Annotated[at_least(1), _extra("draft_vocab_size")]
    trained: Annotated[bool, _extra("trained")]
    head: Annotated[HeadRecord, _extra("head")]
    draft_vocab_file: Annotated[Optional[Text], _extra("draft_vocab_file")] = omitted(None)
    draft_vocab_source: Annotated[Optional[Literal[DRAFT_VOCAB_SOURCES]], _extra("draft_vocab_source")] = \
        omitted(None)
    max_position_embeddings: Annotated[at_least(2), _extra("max_position_embeddings")]
    num_layers: Annotated[at_least(1), _extra("num_layers")] = omitted(1)

    @property
    def head_kind(self) -> str:
        """"eagle" (EAGLE-1/2) or "eagle3" (HeadRecord.kind)."""
        return self.head.kind


class SharedTensor(Record):
    """One weight tensor the target and draft graphs both use, stored once: `role` ("embedding":
    the token embedding; "lm_head": LM head weights, with a full draft vocabulary), its
    initializer name in each graph, dtype (contract name) and shape as stored, and where its
    bytes lie in the shared file (offset, length). `prefill_name`: its initializer name in the
    prefill graph (Manifest.prefill) when that graph uses it too (the embedding; None: it does
    not, or the export has no prefill graph)."""

    role: Literal[SHARED_ROLES]
    target_name: Text
    draft_name: Text
    prefill_name: Optional[Text] = omitted(None)

    def name_in(self, which: str) -> str | None:
        """Its initializer name in graph `which` ("target", "draft" or "prefill"; None: that
        graph does not use it)."""
        return {"target": self.target_name, "draft": self.draft_name, PREFILL_GRAPH: self.prefill_name}[which]
    dtype: Literal[NAMES]
    shape: tuple[at_least(0), ...]
    offset: at_least(0)
    length: at_least(0)


class SharedWeights(Record):
    """The weights the draft graph takes from the target (JSON: `shared_weights`): one
    external-data file in the export folder (`onnx_io.SHARED_WEIGHTS_FILE`) that both graphs
    (and a prefill graph, for the embedding) reference, so the folder holds them once and
    onnxruntime maps them once per graph without copying (see onnx_io). `size`: the file's
    length in bytes; `sha256`: its hash."""

    file: Text
    size: at_least(0)
    sha256: Optional[Text] = None
    tensors: tuple[Annotated[SharedTensor, Expect("a shared tensor {role, target_name, draft_name, ...}")], ...]

    @model_validator(mode="after")
    def _within_the_file(self):
        for i, t in enumerate(self.tensors):
            if t.offset + t.length > self.size:
                raise failed("tensors", i, "length",
                             expected=f"at most {self.size - t.offset} (the shared file is {self.size} bytes)")
        return self

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


class FileRecord(Record):
    """One file of the export folder (JSON: `files`, keyed by its '/'-separated path inside
    the folder): size in bytes, sha256, and for a file larger than `verify.SMALL_FILE` the
    sha256 of a sample of its blocks (`verify.sampled_digest`), which the runtime checks on
    every load (contract/verify.py). Written by eagle-export for every file but the manifest."""

    size: at_least(0)
    sha256: Sha256
    sampled_sha256: Optional[Sha256] = omitted(None)


class SourceRecord(Record):
    """Where one model came from: the spec given to eagle-export, the resolved path, the
    sha256 of each weight file."""

    spec: Optional[Text] = None
    path: Optional[Text] = None
    sha256: dict[str, Text] = {}


class Sources(Record):
    target: SourceRecord = SourceRecord()
    draft: SourceRecord = SourceRecord()


class TrtRecord(Record):
    """TensorRT engines built from this export (`exporter.trt_build`): engine file and
    optimization profiles per graph ("target", "draft"), the TensorRT version they need, the
    timing cache, the capacities they were built for, the ONNX sha256 they came from, the GPU."""

    label: ClassVar[str] = "TensorRT record"
    files: dict[GraphName, Text]
    profiles: dict[GraphName, tuple[ProfileSpec, ...]] = {}
    trt_version: Text
    timing_cache: Optional[Text] = None
    strongly_typed: bool = True
    max_length: Optional[at_least(2)] = None
    draft_capacity: Optional[at_least(2)] = None
    onnx_sha256: dict[str, Optional[Text]] = {}
    device: Optional[Text] = None


class TuningRecord(Record):
    """The last `eagle-bench --tune` run: when, on which backend, the tree it chose (now the
    manifest's tree) and the one before, measured speeds. `details`: its measurements (cost
    curves, calibration runs, candidates, ...), given as keywords and stored flat beside these
    keys; read by the planner (runtime/planner.py CostModel.from_tuning)."""

    label: ClassVar[str] = "tuning record"
    model_config = ConfigDict(extra="allow")
    date: Text
    backend: Text
    chosen: Tree
    previous: Optional[Tree] = None
    chosen_measured_tokens_per_s: Optional[Number] = None
    vanilla_tokens_per_s: Optional[Number] = None
    speedup_vs_vanilla: Optional[Number] = None

    @property
    def details(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class Engines(Record):
    """Records beside the ONNX graphs: TensorRT engines and the last tree tuning (each None
    until made)."""

    trt: Optional[TrtRecord] = omitted(None)
    tuning: Optional[TuningRecord] = omitted(None)

