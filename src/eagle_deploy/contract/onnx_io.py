"""The ONNX I/O contract: every graph input and output, with shape and dtype, in one place.

Both the exporter (which writes graphs that follow it) and the runtime (which binds buffers
by these names) import this module; it imports nothing heavy. `T` below is the export dtype
recorded in the manifest (`float32` by default, `float16`/`bfloat16` with `--dtype`).
Symbolic dimensions: `batch`, `seq` (new tokens this call), `past_seq` (rows already in the
KV cache), `total_seq` = `past_seq + seq`, `num_logits` (positions whose logits or top-k are
computed).

Target graph (`target.onnx`): one graph serves prefill, one-token decode and tree
verification.

| name | dtype | shape | meaning |
|---|---|---|---|
| `input_ids` | int64 | [batch, seq] | new tokens (tree nodes in tree order) |
| `position_ids` | int64 | [batch, seq] | absolute positions (depth-based for a tree) |
| `attention_mask` | bool | [batch, seq, total_seq] | row i: may new token i attend to column j |
| `logits_indices` | int64 | [batch, num_logits] | which of the `seq` positions get logits |
| `past_key_values.{i}.key` / `.value` | T | [past_seq, batch, kv_heads, head_dim] | layer i cache, sequence-major |
| `logits` (out) | float32 | [batch, num_logits, vocab] | target logits at `logits_indices` |
| `features` (out) | T | [batch, seq, hidden] | final-norm hidden states, the LM-head input: the EAGLE feature |
| `present.{i}.key` / `.value` (out) | T | [seq, batch, kv_heads, head_dim] | KV of the new tokens only |

`attention_mask` columns 0..past_seq-1 are the cache rows in buffer order, then the new
tokens (the tree mask). The cache is sequence-major so that every prefix of a preallocated
buffer is contiguous; the runtime binds each `present` output straight into its buffer at
row `past_seq`.

Draft graph (`draft.onnx`): the EAGLE-1/2 draft head (arXiv 2401.15077 §3): FC over
[token embedding; feature], the head's decoder layers (the first without input norm, any
later ones ordinary pre-norm layers: heads/eagle12.py), the target's LM head. The head has
`draft.extra.num_layers` layers (`DraftEntry.num_layers`; 1 when the manifest leaves it
out, as every published EAGLE-1/2 head and every EAGLE-3 head has), each with its own cache.

| name | dtype | shape | meaning |
|---|---|---|---|
| `features` | T | [batch, seq, hidden] | feature at position p (target's, or the head's own prediction) |
| `input_ids` | int64 | [batch, seq] | the token at position p+1 (the shifted token) |
| `position_ids` | int64 | [batch, seq] | p, the position of the feature |
| `attention_mask` | bool | [batch, seq, total_seq] | as for the target |
| `logits_indices` | int64 | [batch, num_logits] | positions whose top-k is computed |
| `past_key_values.{i}.key` / `.value` | T | [past_seq, batch, kv_heads, head_dim] | the head's own cache, layer i |
| `next_features` (out) | T | [batch, seq, hidden] | predicted feature at position p+1 |
| `topk_logprobs` (out) | float32 | [batch, num_logits, top_k] | head's next-token log-softmax, top-k, descending |
| `topk_ids` (out) | int64 | [batch, num_logits, top_k] | token ids of those entries (full target vocabulary) |
| `present.{i}.key` / `.value` (out) | T | [seq, batch, kv_heads, head_dim] | KV of the new rows, layer i |

No full-vocabulary logits leave the draft graph.

EAGLE-3 exports (`Manifest.draft.head.kind == "eagle3"`, arXiv 2503.01840 §3). The target
graph has one more output, after `features`:

| name | dtype | shape | meaning |
|---|---|---|---|
| `tapped_features` (out) | T | [batch, seq, taps * hidden] | hidden states entering the tapped layers |

The tapped layers are `target.extra.feature_layers` (low, middle, high; concatenated in that
order).

"The hidden state of layer i" is the residual stream *entering* decoder layer i (layer 0's is
the token embedding): transformers' `output_hidden_states[i]`, which is the output of layer
i - 1. EAGLE-1/2 exports have no such output and pay nothing for it.

The EAGLE-3 draft graph takes the head's input rows from two inputs, concatenated along the
sequence axis (seq = tapped_rows + own_rows; the rows of `input_ids`, `position_ids`,
`attention_mask` follow that order):

| name | dtype | shape | meaning |
|---|---|---|---|
| `tapped_features` | T | [batch, tapped_rows, taps * target hidden] | target taps at p, fused by `fc` |
| `features` | T | [batch, own_rows, head hidden] | the head's own `next_features` fed back |

then the rest of the draft table, with `hidden` the head's own width (`head.hidden`, which may
differ from the target's; so may its KV heads and head dim). Either input may have 0 rows: the
runtime sends the target's taps alone (extension) or the head's own features alone (tree
expansion). The head applies its own final norm and LM head over its draft vocabulary, and
`topk_ids` are mapped to target ids inside the graph (target id = draft index + d2t[draft
index]), so the runtime only ever sees target token ids. `top_k` is fixed at export
(`Manifest.draft.graph_top_k`); trees may use any `top_k` up to it.

KV layouts (`KV_LAYOUTS`; each graph's is the shape of its KV specs in the manifest,
`kv_layout_of`). The tables above show `seq_major`, the standard-op graph (`--backend trt`:
TensorRT cannot run onnxruntime's contrib operators). The default onnxruntime export is
`shared` (`KV_SHAPE_SHARED`): attention is onnxruntime's fused `GroupQueryAttention`
(com.microsoft, rotary inside, `past_present_share_buffer`), so both `past_key_values.{i}.*`
and `present.{i}.*` are [batch, kv_heads, kv_capacity, head_dim] and are bound to the *same*
buffer (the whole KV buffer, `kv_capacity` = its rows). The graph reads rows
[0, past_seq), with past_seq = total_seq - seq taken from `attention_mask`'s shape, writes the
new tokens' rows [past_seq, total_seq) in place and leaves every other row untouched. On top
of `attention_mask` the fused operator applies its own causal mask over the new tokens: new
token i can see new token j only if j <= i, so tree nodes must follow their ancestors (tree
order, which DraftTree and the drafter always produce; backends check it). Needs
past_seq + seq <= kv_capacity. Rotary embedding comes from a constant table in the graph
(exports since 2026-12-01) of max_position_embeddings + 1024 positions (the graph's own
max_position_embeddings: the target's, or the draft head's), so position ids and total_seq
must stay below that; onnxruntime refuses a forward past it with an error naming the position.

Batched forwards (fused graphs whose manifest entry has `extra.ragged_batch`, all fused graphs
exported since batched decoding). The rows of a batch of two or more may have different past
lengths. Row b's past length is read from its own mask: its last new token's last visible
column is past_b + seq - 1 (so in such a batch every row's last token must see itself, and
no later column). So `attention_mask` is [batch, seq, total_seq] with total_seq = max past_b + seq; row
b's columns 0..past_b-1 are its cache rows, past_b..past_b+seq-1 its new tokens, later columns
unused (False). The graph writes row b's new KV at rows [past_b, past_b + seq) of that row's
block of the shared buffer and reads nothing beyond past_b + seq. Rows with fewer real tokens
are padded after them with tokens that see only themselves; their KV lands past what that row
holds and their outputs are ignored (runtime/batch.py). A lone row (batch 1) is the case
above, past = total_seq - seq, whatever its mask (its rows may see nothing at all). The
standard-op graph takes one past for all rows.

One-row queries (fused target graphs whose manifest entry has `extra.repeats_one_row`: the
target graphs of quantised exports since 2026-12-07). onnxruntime's CPU attention computes a
one-row query with another kernel than a query of several rows, and the two round differently
in the last bit (which a quantised graph's int8 activation rounding turns into different
logits). So these graphs run a call of seq = 1 as two rows inside attention, and only there
(the matmuls and norms run one row): the second row repeats the token's q/k/v one position on,
seeing what the first row sees, and its KV is written at row past_seq + 1, which the shared
buffer must hold (a spare row: `rows_written`; what it holds is unspecified, and the next
forward overwrites it). Attention then computes the one row as row 0 of a two-row call
[token, token] at positions [p, p + 1] under a causal mask computes it; where the matmuls also
give a row the same bits alone (a CPU property: runtime/row_exact.py), every output and KV row
past_seq are that row 0's, bit for bit, and runtimes that need those bits (row-exact decoding)
run the call as one row; elsewhere they run it as two rows, as with any other graph. Calls of
seq >= 2 compute exactly what they compute without it. A batch of one-token rows repeats each
row at its own past.

Shared weights (`shared.data`, `SHARED_WEIGHTS_FILE`): the tensors the draft graph takes
from the target are stored once, in one ONNX external-data file that both graphs reference
(each keeps its own initializer name; offsets are 64 KiB-aligned). Always the token
embedding [vocab, hidden] (the target's `Gather` table, in the target's dtype: fp32 in
int4/int8 exports too, whose embedding is not quantised); with a full draft vocabulary
(`--draft-vocab full`) also the LM head weights, byte-identical in both graphs (the same
MatMulNBits blobs and scales in a quantised export). A reduced draft vocabulary's LM head rows
are the draft graph's own (vocab' x hidden, quantised with the draft). `Manifest.shared_weights`
lists each shared tensor (role, name in each graph, dtype, shape, offset, length) and the
file's size and sha256. onnxruntime maps external data read-only instead of copying it, so
the shared tensors occupy memory once (only the embedding rows actually gathered become
resident). Neither graph loads without the file: the runtime checks it before opening a
session (ManifestError naming the file and the tensors).

Prefill graph (`prefill.onnx`, `PREFILL_FILE`; `Manifest.prefill`, optional: `eagle-export
--quant int4 --prefill-weights int8`). The target graph again, built from the same fp32 graph
before the target was quantised, with the same inputs and outputs (every name, dtype, shape and
KV layout above, `extra.repeats_one_row` included), so a runtime runs it in the target graph's
place, on the same KV buffer. Every constant-weight MatMul is int8 weights (one scale per output
column) times int8 activations quantised per token (one scale per row: max |x| / 127 of that
row), accumulated exactly in int32: a row's result depends on that row alone, so a prompt run
in chunks computes the same bits as one forward, as with the target graph. Runtimes use it for
a prompt's rows only (their prefill forwards, and the rows a prefix cache stores); decoding and
tree verification stay on `target.onnx`. It reads the token embedding from `shared.data` (its
`SharedTensor.prefill_name`). Its logits, features and KV differ from the target graph's (other
weights): greedy output after a prompt it prefilled is the quantised target's continuation of
that KV, the same in EAGLE and vanilla decoding.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal, Union

from annotated_types import Ge, MinLen

from .dtypes import NAMES
from .field_errors import Expect

TARGET_FILE = "target.onnx"
DRAFT_FILE = "draft.onnx"
PREFILL_FILE = "prefill.onnx"  # the optional int8 prefill graph (see "Prefill graph" above)
MANIFEST_FILE = "manifest.json"
TOKENIZER_DIR = "tokenizer"
SHARED_WEIGHTS_FILE = "shared.data"  # the tensors both graphs use (see "Shared weights" above)
SHARED_ALIGNMENT = 1 << 16  # byte alignment of each tensor in it (mmap-able on every OS)

INPUT_IDS = "input_ids"
POSITION_IDS = "position_ids"
ATTENTION_MASK = "attention_mask"
LOGITS_INDICES = "logits_indices"
FEATURES = "features"
LOGITS = "logits"
NEXT_FEATURES = "next_features"
TOPK_LOGPROBS = "topk_logprobs"
TOPK_IDS = "topk_ids"
TAPPED_FEATURES = "tapped_features"  # EAGLE-3: the target's tapped hidden states

# Additive attention bias for masked positions: finite in fp16 and fp32, so a fully masked
# (padded) row gives a uniform softmax instead of NaN.
MASK_VALUE = -65504.0


def past_name(layer: int, kind: str) -> str:
    """Graph input name of layer `layer`'s cache; `kind` is "key" or "value"."""
    return f"past_key_values.{layer}.{kind}"


def present_name(layer: int, kind: str) -> str:
    """Graph output name of layer `layer`'s new KV rows; `kind` is "key" or "value"."""
    return f"present.{layer}.{kind}"


def kv_names(num_layers: int) -> list[tuple[str, str]]:
    """[(past input, present output)] for keys then values of every layer, in graph order."""
    return [(past_name(i, k), present_name(i, k)) for i in range(num_layers) for k in ("key", "value")]


# a shape dimension: a size or a symbol (`batch`, `seq`, ...)
Dim = Annotated[Union[Annotated[int, Ge(0)], Annotated[str, MinLen(1)]],
                Expect("a dimension (integer >= 0 or a symbol)", whole=True)]


@dataclass(frozen=True)
class TensorSpec:
    """One graph input or output: name, dtype (numpy name) and shape (ints or symbols). The
    field types are what the manifest may hold (pydantic reads them; no check on construction)."""

    __pydantic_config__ = {"extra": "forbid"}
    name: Annotated[str, MinLen(1)]
    dtype: Literal[NAMES]
    shape: tuple[Dim, ...]

    def to_json(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_json(cls, data: dict) -> "TensorSpec":
        """{"name", "dtype", "shape": [int | str, ...]} -> TensorSpec (unchecked; Manifest.load validates)."""
        return cls(data["name"], data["dtype"], tuple(data["shape"]))


KV_SHAPE_PAST = ("past_seq", "batch", "kv_heads", "head_dim")
KV_SHAPE_PRESENT = ("seq", "batch", "kv_heads", "head_dim")
KV_SHAPE_SHARED = ("batch", "kv_heads", "kv_capacity", "head_dim")  # past and present: one buffer

KV_SEQ_MAJOR = "seq_major"  # standard ops: past prefix in, new rows out (bound at row past_seq)
KV_SHARED = "shared"  # fused GroupQueryAttention: one [batch, kv_heads, capacity, head_dim] buffer in and out
KV_LAYOUTS = (KV_SEQ_MAJOR, KV_SHARED)
KV_SEQ_AXIS = {KV_SEQ_MAJOR: 0, KV_SHARED: 2}  # the sequence (row) axis of a KV buffer in each layout
_KV_SHAPES = {KV_SEQ_MAJOR: (KV_SHAPE_PAST, KV_SHAPE_PRESENT), KV_SHARED: (KV_SHAPE_SHARED, KV_SHAPE_SHARED)}


def rows_written(seq: int, repeats_one_row: bool = False) -> int:
    """KV rows a forward of `seq` new tokens writes from row past_seq on: seq, or 2 for a
    one-token call of a graph that repeats one-row queries ("One-row queries" above)."""
    return 2 if repeats_one_row and seq == 1 else seq


def kv_layout_of(inputs) -> str | None:
    """The KV layout a graph's input specs declare (by the shape of its first
    `past_key_values.*` input), or None when it has none or an unknown shape."""
    past = next((s for s in inputs if s.name.startswith("past_key_values.")), None)
    return next((k for k, (shape, _) in _KV_SHAPES.items() if past is not None and tuple(past.shape) == shape), None)
_MASK_SHAPE = ("batch", "seq", "total_seq")


def _common_inputs() -> list[TensorSpec]:
    return [
        TensorSpec(INPUT_IDS, "int64", ("batch", "seq")),
        TensorSpec(POSITION_IDS, "int64", ("batch", "seq")),
        TensorSpec(ATTENTION_MASK, "bool", _MASK_SHAPE),
        TensorSpec(LOGITS_INDICES, "int64", ("batch", "num_logits")),
    ]


def _kv_specs(num_layers: int, dtype: str, kv_layout: str) -> tuple[list[TensorSpec], list[TensorSpec]]:
    if kv_layout not in _KV_SHAPES:
        raise ValueError(f"kv_layout {kv_layout!r} is not one of {', '.join(KV_LAYOUTS)}")
    pairs = kv_names(num_layers)
    shape_past, shape_present = _KV_SHAPES[kv_layout]
    past = [TensorSpec(p, dtype, shape_past) for p, _ in pairs]
    present = [TensorSpec(q, dtype, shape_present) for _, q in pairs]
    return past, present


def target_io(num_layers: int, dtype: str, kv_layout: str = KV_SEQ_MAJOR,
              tapped_width: int | None = None) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """(inputs, outputs) of the target graph, in graph order. tapped_width: taps x hidden of
    an EAGLE-3 export (adds the `tapped_features` output); None for EAGLE-1/2."""
    past, present = _kv_specs(num_layers, dtype, kv_layout)
    outputs = [
        TensorSpec(LOGITS, "float32", ("batch", "num_logits", "vocab")),
        TensorSpec(FEATURES, dtype, ("batch", "seq", "hidden")),
    ]
    if tapped_width:
        outputs.append(TensorSpec(TAPPED_FEATURES, dtype, ("batch", "seq", tapped_width)))
    return _common_inputs() + past, outputs + present


def draft_io(dtype: str, top_k: int, kv_layout: str = KV_SEQ_MAJOR, tapped_width: int | None = None,
             num_layers: int = 1) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """(inputs, outputs) of the draft graph, in graph order. tapped_width: taps x target
    hidden of an EAGLE-3 head (inputs `tapped_features` then `features`, rows concatenated);
    None for EAGLE-1/2 (`features` only). `hidden` here is the head's own width. num_layers:
    the head's decoder layers (a past/present pair of key and value each). ValueError for an
    unknown kv_layout."""
    past, present = _kv_specs(num_layers, dtype, kv_layout)
    if tapped_width:
        head = [TensorSpec(TAPPED_FEATURES, dtype, ("batch", "tapped_rows", tapped_width)),
                TensorSpec(FEATURES, dtype, ("batch", "own_rows", "hidden"))]
    else:
        head = [TensorSpec(FEATURES, dtype, ("batch", "seq", "hidden"))]
    inputs = head + _common_inputs()
    outputs = [
        TensorSpec(NEXT_FEATURES, dtype, ("batch", "seq", "hidden")),
        TensorSpec(TOPK_LOGPROBS, "float32", ("batch", "num_logits", top_k)),
        TensorSpec(TOPK_IDS, "int64", ("batch", "num_logits", top_k)),
    ]
    return inputs + past, outputs + present
