"""The `manifest.json` layout (format 1) as pydantic models, and one-line errors.

`read(model, data, source)` validates parsed JSON against one of the models below and returns
it, or raises `ManifestError`: one line naming `source`, the field path, what was expected and
what was found, e.g.

    /x/manifest.json dims.hidden: expected an integer >= 1, found "x"

The models mirror the JSON exactly (lists stay lists); `contract/manifest.py` turns them into
its frozen records. Types, ranges, choices, unknown and missing keys are pydantic's work (strict:
`true` is no integer, `"2"` no number). The checks across fields (the graphs' I/O against the
ONNX contract for the dims, the layer count, the draft vocabulary against top-k, a tree's top_k
against the draft graph's) are `ManifestJSON`'s model validator. What a field must be, in
words, is its type's `_Expect`, or one derived from the type (`_describe`).
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Optional, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, WrapValidator, field_validator, model_validator
from pydantic_core import PydanticCustomError

from . import onnx_io as c
from .dtypes import FLOAT_NAMES, NAMES
from .onnx_io import MANIFEST_FILE, TensorSpec
from .tree_config import TreeConfig, TreeConfigError

FORMAT_VERSION = 1
QUANT_KINDS = ("int4", "int8")  # weight quantisation of a graph (`eagle-export --quant`)
GRAPHS = ("target", "draft")
# how a reduced draft vocabulary was ranked: the head's token_counts.npy (response-token
# frequencies from eagle-train), the tokenizer's merge rank (BPE merge order; no data needed),
# or token id order (tokenizers without merges), see exporter/draft_vocab.py; or an EAGLE-3
# head's own draft vocabulary (its d2t table), see heads/eagle3_checkpoint.py
DRAFT_VOCAB_SOURCES = ("token_counts", "merge_rank", "token_id", "head_d2t")
SHARED_ROLES = ("embedding", "lm_head")  # SharedTensor.role
HEAD_KINDS = ("eagle", "eagle3")  # HeadRecord.kind: EAGLE-1/2 heads, EAGLE-3 heads
HEAD_SIZES = ("hidden", "num_heads", "num_kv_heads", "head_dim")


class ManifestError(ValueError):
    """An export folder or its manifest is missing, malformed or of another format version."""


# ---------------------------------------------------------------------------------------------
# Field types, each with what it must be in words

class _Expect:
    """Annotation metadata: the error's "expected ..." text. whole: an error anywhere inside
    the value is reported at this field, with the whole value as found."""

    def __init__(self, text: str, whole: bool = False):
        self.text, self.whole = text, whole


def _int(minimum: int, what: str | None = None):
    return Annotated[int, Field(ge=minimum), _Expect(what or f"an integer >= {minimum}")]


def _as_given(value, handler):
    handler(value)  # validated as a number, kept as written (an int stays an int)
    return value


_Str = Annotated[str, Field(min_length=1), _Expect("a non-empty string")]
_Number = Annotated[float, WrapValidator(_as_given), _Expect("a number")]
_Hex = Annotated[str, Field(min_length=64, max_length=64, pattern="^[0-9a-f]+$"),
                 _Expect("a sha256 (64 lowercase hex digits)")]
_Dim = Annotated[Union[_int(0), _Str], _Expect("a dimension (integer >= 0 or a symbol)", whole=True)]
_Graph = Annotated[Literal[GRAPHS], _Expect(f"a graph name ({', '.join(GRAPHS)})")]
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


def _bad(at: str, expected: str, found=_MISSING) -> PydanticCustomError:
    """A failed check of field `at` (a path below the model that raises it)."""
    return PydanticCustomError("manifest", "{expected}", {"at": at, "expected": expected, "found": found})


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


# ---------------------------------------------------------------------------------------------
# The JSON objects (fields in the order of the records they become, as "known:" lists them)

class _DimsJSON(_Model):
    num_layers: _int(1)
    hidden: _int(1)
    num_heads: _int(1)
    num_kv_heads: _int(1)
    head_dim: _int(1)
    vocab: _int(1)
    max_position_embeddings: _int(1)
    rms_norm_eps: Annotated[float, Field(gt=0), _Expect("a positive number")]

    @model_validator(mode="after")
    def _heads_divide(self):
        if self.num_kv_heads > self.num_heads or self.num_heads % self.num_kv_heads:
            raise _bad("num_kv_heads", f"a divisor of dims.num_heads {self.num_heads}", self.num_kv_heads)
        return self


class _SpecJSON(_Model):
    name: _Str
    dtype: Literal[NAMES]
    shape: list[_Dim]

    def spec(self) -> TensorSpec:
        return TensorSpec(self.name, self.dtype, tuple(self.shape))


_Specs = list[Annotated[_SpecJSON, _Expect("a tensor spec {name, dtype, shape}")]]


class _QuantJSON(_Model):
    """Typed keys; the method's settings lie flat beside them (`model_extra`)."""

    model_config = ConfigDict(extra="allow")
    kind: Literal[QUANT_KINDS]
    method: _Str
    tool: _Str = "onnxruntime.quantization"
    quantised_matmuls: Optional[_int(0)] = None
    batch_invariant: Optional[bool] = None

    @model_validator(mode="after")
    def _settings(self):
        for key, value in self.model_extra.items():
            if value is not None and not isinstance(value, (bool, int, float, str)):
                raise _bad(key, "a quantisation setting (number, string or boolean)", value)
        return self


class _HeadJSON(_Model):
    """kind "eagle" holds nothing else; the other keys (`model_extra` too) are checked by
    `ManifestJSON`, which knows the target's layer count."""

    model_config = ConfigDict(extra="allow")
    kind: Literal[HEAD_KINDS]
    hidden: _int(1) = None
    num_heads: _int(1) = None
    num_kv_heads: _int(1) = None
    head_dim: _int(1) = None
    feature_layers: list[Any] = None
    layout: Optional[_Str] = None


class _TargetExtraJSON(_Model):
    quant: _QuantJSON = None
    feature_layers: list[Any] = None
    ragged_batch: bool = False


class _DraftExtraJSON(_Model):
    graph_top_k: _int(1)
    draft_vocab_size: _int(1) = None
    trained: bool = None
    draft_vocab_file: Optional[_Str] = None
    draft_vocab_source: Optional[Literal[DRAFT_VOCAB_SOURCES]] = None
    max_position_embeddings: Optional[_int(2)] = None
    quant: _QuantJSON = None
    head: _HeadJSON = None
    ragged_batch: bool = False


class GraphJSON(_Model):
    path: _Str
    dtype: Literal[FLOAT_NAMES]
    inputs: _Specs
    outputs: _Specs
    quant: Optional[Literal[QUANT_KINDS]] = None
    sha256: Optional[_Str] = None
    extra: _TargetExtraJSON = _TargetExtraJSON()

    @field_validator("path")
    @classmethod
    def _a_file_name(cls, path: str) -> str:
        if "/" in path or "\\" in path or path in (".", ".."):
            raise _bad("", "a file name inside the export folder", path)
        return path


class _DraftJSON(GraphJSON):
    extra: _DraftExtraJSON = Field(default_factory=dict, validate_default=True)  # so a missing one names graph_top_k


_Entry = _Expect("a graph entry (JSON object)")


class _TreeJSON(_Model):
    kind: Literal["dynamic", "static"]
    total_tokens: _int(1)
    depth: _int(1)
    top_k: _int(1)
    choices: Annotated[Optional[list[Annotated[list[_int(0)], Field(min_length=1)]]],
                       _Expect("null or a list of paths (non-empty lists of child ranks >= 0)", whole=True)] = None

    def tree(self) -> TreeConfig:
        return TreeConfig.from_json(self.model_dump())

    @model_validator(mode="after")
    def _valid(self):
        try:
            self.tree().validate(self.top_k)
        except TreeConfigError as err:
            raise PydanticCustomError("said", "{text}", {"text": str(err)}) from None
        return self


class _SourceJSON(_Model):
    spec: Optional[_Str] = None
    path: Optional[_Str] = None
    sha256: dict[str, _Str] = {}


class _DraftSourceJSON(_SourceJSON):
    trained: Optional[bool] = None


class _SourcesJSON(_Model):
    target: _SourceJSON = _SourceJSON()
    draft: _DraftSourceJSON = _DraftSourceJSON()


class _ProfileJSON(BaseModel):
    model_config = ConfigDict(strict=True)  # other keys are ignored, as ProfileSpec.from_json does
    name: _Str
    shapes: dict[str, Annotated[list[list[_int(0)]], Field(min_length=3, max_length=3),
                                _Expect("[min, opt, max] shapes (lists of integers >= 0)", whole=True)]]


class TrtJSON(_Model):
    files: dict[_Graph, _Str]
    profiles: dict[_Graph, list[_ProfileJSON]] = {}
    trt_version: _Str
    timing_cache: Optional[_Str] = None
    strongly_typed: bool = True
    max_length: Optional[_int(2)] = None
    draft_capacity: Optional[_int(2)] = None
    onnx_sha256: dict[str, Optional[_Str]] = {}
    device: Optional[_Str] = None


class TuningJSON(_Model):
    """Typed keys; its measurements lie flat beside them (`model_extra`)."""

    model_config = ConfigDict(extra="allow")
    date: _Str
    backend: _Str
    chosen: _TreeJSON
    previous: Optional[_TreeJSON] = None
    chosen_measured_tokens_per_s: Optional[_Number] = None
    vanilla_tokens_per_s: Optional[_Number] = None
    speedup_vs_vanilla: Optional[_Number] = None


class _EnginesJSON(_Model):
    trt: TrtJSON = None
    tuning: TuningJSON = None


class _SharedTensorJSON(_Model):
    role: Literal[SHARED_ROLES]
    target_name: _Str
    draft_name: _Str
    dtype: Literal[NAMES]
    shape: list[_int(0)]
    offset: _int(0)
    length: _int(0)


class _SharedJSON(_Model):
    file: _Str
    size: _int(0)
    tensors: list[Annotated[_SharedTensorJSON, _Expect("a shared tensor {role, target_name, draft_name, ...}")]]
    sha256: Optional[_Str] = None

    @model_validator(mode="after")
    def _within_the_file(self):
        for i, t in enumerate(self.tensors):
            if t.offset + t.length > self.size:
                raise _bad(f"tensors[{i}].length", f"at most {self.size - t.offset} (the shared file is {self.size} "
                                                   "bytes)", t.length)
        return self


class _FileJSON(_Model):
    size: _int(0)
    sha256: _Hex
    sampled_sha256: _Hex = None


class ManifestJSON(_Model):
    name: _Str
    dims: _DimsJSON
    max_length: _int(2)
    target: Annotated[GraphJSON, _Entry]
    draft: Annotated[_DraftJSON, _Entry]
    tree: _TreeJSON
    eos_token_ids: list[_int(0, "a token id (integer >= 0)")]
    tokenizer: Optional[_Str]
    chat_template: bool
    sources: _SourcesJSON
    tools: dict[str, _Str]
    engines: _EnginesJSON = _EnginesJSON()
    notes: list[Annotated[str, _Expect("a string")]] = []
    format_version: Literal[FORMAT_VERSION]
    shared_weights: _SharedJSON = None
    files: dict[str, _FileJSON] = None

    @model_validator(mode="after")
    def _consistent(self):
        """The checks across fields, in the order a reader meets them."""
        dims = self.dims
        if self.max_length > dims.max_position_embeddings:
            raise _bad("max_length", f"at most dims.max_position_embeddings {dims.max_position_embeddings}",
                       self.max_length)
        _check_target(self.target, dims)
        _check_draft(self.draft, dims)
        head = self.draft.extra.head
        taps = head.feature_layers if head is not None and head.kind == "eagle3" else None
        if (self.target.extra.feature_layers or None) != (taps or None):
            raise _bad("target.extra.feature_layers", f"{_shown(taps or None)} (the draft head's "
                                                      "draft.extra.head.feature_layers)",
                       self.target.extra.feature_layers or None)
        limit = self.draft.extra.max_position_embeddings
        if limit is not None and self.max_length > limit:
            raise _bad("max_length", f"at most draft.extra.max_position_embeddings {limit} (the draft head's "
                                     "position limit)", self.max_length)
        tuning = self.engines.tuning
        for at, tree in (("tree", self.tree), ("engines.tuning.previous", tuning and tuning.previous),
                         ("engines.tuning.chosen", tuning and tuning.chosen)):
            if tree is not None and tree.top_k > self.draft.extra.graph_top_k:
                raise _bad(f"{at}.top_k", f"at most draft.extra.graph_top_k {self.draft.extra.graph_top_k}",
                           tree.top_k)
        file = self.shared_weights.file if self.shared_weights is not None else None
        if file is not None and ("/" in file or "\\" in file or file in (".", "..", self.target.path, self.draft.path)):
            raise _bad("shared_weights.file", "a data file name inside the export folder", file)
        for path in self.files or {}:
            if path == MANIFEST_FILE or "\\" in path or any(p in ("", ".", "..") for p in path.split("/")):
                raise _bad(f"files[{path!r}]", "a relative file path inside the export folder ('/'-separated)", path)
        return self


def _check_quant(graph: GraphJSON, which: str) -> None:
    quant = graph.extra.quant
    if quant is not None and quant.kind != graph.quant:
        raise _bad(f"{which}.quant", f"{quant.kind!r} (as {which}.extra.quant.kind says)", graph.quant)


def _check_layers(layers: list, at: str, num_layers: int) -> None:
    """`feature_layers`: distinct layer ids in [0, num_layers), ascending."""
    for i, v in enumerate(layers):
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < num_layers:
            raise _bad(f"{at}[{i}]", f"a decoder layer id in [0, dims.num_layers {num_layers})", v)
    if not layers or layers != sorted(set(layers)):
        raise _bad(at, "distinct layer ids in ascending order", layers)


def _check_target(graph: GraphJSON, dims: _DimsJSON) -> None:
    _check_quant(graph, "target")
    layers = graph.extra.feature_layers
    if layers is not None:
        _check_layers(layers, "target.extra.feature_layers", dims.num_layers)
    inputs = [s.spec() for s in graph.inputs]
    past = [s.name for s in inputs if s.name.startswith("past_key_values.")]
    found = len(past) // 2
    if found != dims.num_layers and past == [p for p, _ in c.kv_names(found)]:
        raise _bad("dims.num_layers", f"{found} (target.inputs holds the KV of {found} layers)", dims.num_layers)
    layout = c.kv_layout_of(inputs) or c.KV_SEQ_MAJOR
    _check_contract(graph, "target", *c.target_io(dims.num_layers, graph.dtype, layout,
                                                  len(layers) * dims.hidden if layers else None))


def _check_draft(graph: _DraftJSON, dims: _DimsJSON) -> None:
    _check_quant(graph, "draft")
    extra, top_k = graph.extra, graph.extra.graph_top_k
    vocab_size = dims.vocab if extra.draft_vocab_size is None else extra.draft_vocab_size
    if not top_k <= vocab_size <= dims.vocab:
        raise _bad("draft.extra.draft_vocab_size", f"an integer in [graph_top_k {top_k}, dims.vocab {dims.vocab}]",
                   vocab_size)
    tapped = _check_head(extra.head, dims) if extra.head is not None else None
    found_k = next((s.shape[-1] for s in graph.outputs if s.name == c.TOPK_IDS and s.shape), top_k)
    if isinstance(found_k, int) and found_k != top_k:
        raise _bad("draft.extra.graph_top_k", f"{found_k} (the last dimension of draft.outputs {c.TOPK_IDS!r})",
                   top_k)
    layout = c.kv_layout_of([s.spec() for s in graph.inputs]) or c.KV_SEQ_MAJOR
    _check_contract(graph, "draft", *c.draft_io(graph.dtype, top_k, layout, tapped))


def _check_head(head: _HeadJSON, dims: _DimsJSON) -> int | None:
    """The head's own fields; returns the width of its tapped features (None: EAGLE-1/2)."""
    at, eagle = "draft.extra.head", head.kind == "eagle"
    unknown = [k for k in _HeadJSON.model_fields if k != "kind" and k in head.model_fields_set and eagle]
    for key in unknown + list(head.model_extra):
        known = ["kind"] if eagle else list(_HeadJSON.model_fields)
        raise _bad(f"{at}.{key}", f"no such field (known: {', '.join(known)})", getattr(head, key))
    if eagle:  # the target's geometry: nothing else to record
        return None
    for key in HEAD_SIZES:
        if key not in head.model_fields_set:
            raise _bad(f"{at}.{key}", "an integer >= 1")
    if head.num_heads % head.num_kv_heads:
        raise _bad(f"{at}.num_kv_heads", f"a divisor of num_heads {head.num_heads}", head.num_kv_heads)
    if head.feature_layers is None:
        raise _bad(f"{at}.feature_layers", "a JSON list")
    _check_layers(head.feature_layers, f"{at}.feature_layers", dims.num_layers)
    return len(head.feature_layers) * dims.hidden


def _check_contract(graph: GraphJSON, which: str, inputs: list[TensorSpec], outputs: list[TensorSpec]) -> None:
    """The entry's I/O lists are the ONNX contract's for its dims, dtype and top-k."""
    for key, declared, expected in (("inputs", graph.inputs, inputs), ("outputs", graph.outputs, outputs)):
        declared = [s.spec() for s in declared]
        for i, (d, e) in enumerate(zip(declared, expected)):
            if d != e:
                part = "name" if d.name != e.name else "dtype" if d.dtype != e.dtype else "shape"
                want, got = {"name": (e.name, d.name), "dtype": (e.dtype, d.dtype),
                             "shape": (list(e.shape), list(d.shape))}[part]
                of = "" if part == "name" else f" for {e.name!r}"
                raise _bad(f"{which}.{key}[{i}].{part}", f"{_shown(want)} (the ONNX I/O contract{of})", got)
        if len(declared) != len(expected):
            raise _bad(f"{which}.{key}", f"{len(expected)} tensors (the ONNX I/O contract)",
                       _Said(f"{len(declared)} tensors"))


# ---------------------------------------------------------------------------------------------
# ValidationError -> one line

def read_manifest(data, source: str) -> ManifestJSON:
    """A whole manifest: a JSON object of this format version, then `read`."""
    if not isinstance(data, dict):
        raise ManifestError(f"{source} is malformed: expected a JSON object, found {type(data).__name__}; re-export")
    version = data.get("format_version", _MISSING)
    if version != FORMAT_VERSION or isinstance(version, bool):
        raise ManifestError(f"{source} format_version: expected {FORMAT_VERSION} (what this runtime reads), found "
                            f"{_shown(version)}; re-export")
    return read(ManifestJSON, data, source)


def read(model: type[BaseModel], data, source: str) -> BaseModel:
    """`data` validated as `model`; ManifestError (one line, the first problem) otherwise."""
    try:
        return model.model_validate(data)
    except ValidationError as err:
        lines = list(dict.fromkeys(_explain(model, data, e, source) for e in _unknown_first(err.errors())))
        more = f" (and {len(lines) - 1} more)" if len(lines) > 1 else ""
        raise ManifestError(lines[0] + more) from None


def _unknown_first(errors: list[dict]) -> list[dict]:
    """An object's unknown keys before the problems of its fields (a misspelt key explains
    the missing one)."""
    for e in [e for e in errors if e["type"] == "extra_forbidden"]:
        errors.remove(e)
        parent = e["loc"][:-1]
        errors.insert(next((i for i, o in enumerate(errors) if o["loc"][:len(parent)] == parent), len(errors)), e)
    return errors


def _explain(model: type[BaseModel], data, error: dict, source: str) -> str:
    """One pydantic error as "{source} {field}: expected ..., found ..."."""
    path, tp, value, parent = _walk(model, data, error["loc"])
    kind, ctx = error["type"], error.get("ctx") or {}
    if kind == "manifest":
        at = ctx["at"]
        path = path + at if at.startswith("[") or not path else f"{path}.{at}" if at else path
        return f"{source} {path}: expected {ctx['expected']}, found {_shown(ctx['found'])}"
    if kind == "said":
        return f"{source} {path}: {ctx['text']}"
    if kind == "extra_forbidden":
        expected = f"no such field (known: {', '.join(parent.model_fields)})"
    else:
        expected = _describe(tp)
    return f"{source} {path or '(top level)'}: expected {expected}, found {_shown(value)}"


def _walk(model, data, loc) -> tuple[str, Any, Any, type | None]:
    """Follow `loc` through the models' types and the data: (field path, type there, value
    there, the last model passed). Stops early at a `whole` field."""
    path, tp, value, parent = "", model, data, None
    loc = list(loc)
    while loc:
        if any(e.whole for e in _expects(tp)):
            break
        key = loc.pop(0)
        base = _base(tp)
        if isinstance(base, type) and issubclass(base, BaseModel):
            parent = base
            info = base.model_fields.get(key)
            tp = Annotated[(info.annotation, *info.metadata)] if info and info.metadata else (
                info.annotation if info else Any)
        elif get_origin(base) is dict:
            if loc and loc[0] == "[key]":
                tp, loc = get_args(base)[0], []
                path, value = f"{path}.{key}" if path else key, key
                break
            tp = get_args(base)[1]
        elif get_origin(base) is list:
            tp = get_args(base)[0]
        elif get_origin(base) is Union:
            continue  # a union member's tag: not a field
        path = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else key
        if isinstance(value, dict):
            value = value.get(key, _MISSING)
        elif isinstance(value, list) and isinstance(key, int) and key < len(value):
            value = value[key]
        else:
            value = _MISSING
    return path, tp, value, parent


def _expects(tp) -> list[_Expect]:
    return [m for m in get_args(tp)[1:] if isinstance(m, _Expect)] if get_origin(tp) is Annotated else []


def _base(tp):
    """`tp` without Annotated and Optional."""
    while True:
        if get_origin(tp) is Annotated:
            tp = get_args(tp)[0]
        elif get_origin(tp) is Union and type(None) in get_args(tp) and len(get_args(tp)) == 2:
            tp = next(a for a in get_args(tp) if a is not type(None))
        else:
            return tp


def _describe(tp) -> str:
    """What a value of type `tp` must be, in words."""
    said = _expects(tp)
    if said:
        return said[0].text
    if get_origin(tp) is Annotated:
        return _describe(get_args(tp)[0])
    args = get_args(tp)
    if get_origin(tp) is Union and type(None) in args:
        inner = _describe(next(a for a in args if a is not type(None)))
        return f"{inner}, null" if inner.startswith("one of ") else f"{inner} or null"
    if get_origin(tp) is Literal:
        return f"one of {', '.join(str(a) for a in args)}"
    words = {bool: "true or false", int: "an integer", float: "a number", str: "a string", list: "a JSON list"}
    return words.get(get_origin(tp) or tp, "a JSON object")
