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
| `attention_mask` | bool | [batch, seq, total_seq] | row i: may new token i attend to column j; columns 0..past_seq-1 are the cache rows in buffer order, then the new tokens (the tree mask) |
| `logits_indices` | int64 | [batch, num_logits] | which of the `seq` positions get logits |
| `past_key_values.{i}.key` / `.value` | T | [past_seq, batch, kv_heads, head_dim] | layer i cache, sequence-major so that every prefix of a preallocated buffer is contiguous |
| `logits` (out) | float32 | [batch, num_logits, vocab] | target logits at `logits_indices` |
| `features` (out) | T | [batch, seq, hidden] | final-norm hidden states, the LM-head input: the EAGLE feature |
| `present.{i}.key` / `.value` (out) | T | [seq, batch, kv_heads, head_dim] | KV of the new tokens only; the runtime binds them straight into its buffer at row `past_seq` |

Draft graph (`draft.onnx`): the EAGLE-1/2 draft head (arXiv 2401.15077 §3): FC over
[token embedding; feature], one decoder layer without input norm, the target's LM head.

| name | dtype | shape | meaning |
|---|---|---|---|
| `features` | T | [batch, seq, hidden] | feature at position p (target's, or the head's own prediction) |
| `input_ids` | int64 | [batch, seq] | the token at position p+1 (the shifted token) |
| `position_ids` | int64 | [batch, seq] | p, the position of the feature |
| `attention_mask` | bool | [batch, seq, total_seq] | as for the target |
| `logits_indices` | int64 | [batch, num_logits] | positions whose top-k is computed |
| `past_key_values.0.key` / `.value` | T | [past_seq, batch, kv_heads, head_dim] | the head's own cache |
| `next_features` (out) | T | [batch, seq, hidden] | predicted feature at position p+1 |
| `topk_logprobs` (out) | float32 | [batch, num_logits, top_k] | log-softmax of the head's next-token distribution, top-k, descending |
| `topk_ids` (out) | int64 | [batch, num_logits, top_k] | token ids of those entries (full target vocabulary) |
| `present.0.key` / `.value` (out) | T | [seq, batch, kv_heads, head_dim] | KV of the new rows |

No full-vocabulary logits leave the draft graph. `top_k` is fixed at export
(`Manifest.draft.graph_top_k`); trees may use any `top_k` up to it.
"""
from __future__ import annotations

from dataclasses import dataclass

TARGET_FILE = "target.onnx"
DRAFT_FILE = "draft.onnx"
MANIFEST_FILE = "manifest.json"
TOKENIZER_DIR = "tokenizer"

INPUT_IDS = "input_ids"
POSITION_IDS = "position_ids"
ATTENTION_MASK = "attention_mask"
LOGITS_INDICES = "logits_indices"
FEATURES = "features"
LOGITS = "logits"
NEXT_FEATURES = "next_features"
TOPK_LOGPROBS = "topk_logprobs"
TOPK_IDS = "topk_ids"

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


@dataclass(frozen=True)
class TensorSpec:
    """One graph input or output: name, dtype (numpy name) and shape (ints or symbols)."""

    name: str
    dtype: str
    shape: tuple

    def to_json(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_json(cls, data: dict) -> "TensorSpec":
        """{"name", "dtype", "shape": [int | str, ...]} -> TensorSpec (unchecked; Manifest.load validates)."""
        return cls(data["name"], data["dtype"], tuple(data["shape"]))


KV_SHAPE_PAST = ("past_seq", "batch", "kv_heads", "head_dim")
KV_SHAPE_PRESENT = ("seq", "batch", "kv_heads", "head_dim")
_MASK_SHAPE = ("batch", "seq", "total_seq")


def _common_inputs() -> list[TensorSpec]:
    return [
        TensorSpec(INPUT_IDS, "int64", ("batch", "seq")),
        TensorSpec(POSITION_IDS, "int64", ("batch", "seq")),
        TensorSpec(ATTENTION_MASK, "bool", _MASK_SHAPE),
        TensorSpec(LOGITS_INDICES, "int64", ("batch", "num_logits")),
    ]


def _kv_specs(num_layers: int, dtype: str) -> tuple[list[TensorSpec], list[TensorSpec]]:
    pairs = kv_names(num_layers)
    past = [TensorSpec(p, dtype, KV_SHAPE_PAST) for p, _ in pairs]
    present = [TensorSpec(q, dtype, KV_SHAPE_PRESENT) for _, q in pairs]
    return past, present


def target_io(num_layers: int, dtype: str) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """(inputs, outputs) of the target graph, in graph order."""
    past, present = _kv_specs(num_layers, dtype)
    outputs = [
        TensorSpec(LOGITS, "float32", ("batch", "num_logits", "vocab")),
        TensorSpec(FEATURES, dtype, ("batch", "seq", "hidden")),
    ]
    return _common_inputs() + past, outputs + present


def draft_io(dtype: str, top_k: int) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """(inputs, outputs) of the draft graph, in graph order."""
    past, present = _kv_specs(1, dtype)
    inputs = [TensorSpec(FEATURES, dtype, ("batch", "seq", "hidden"))] + _common_inputs()
    outputs = [
        TensorSpec(NEXT_FEATURES, dtype, ("batch", "seq", "hidden")),
        TensorSpec(TOPK_LOGPROBS, "float32", ("batch", "num_logits", top_k)),
        TensorSpec(TOPK_IDS, "int64", ("batch", "num_logits", top_k)),
    ]
    return inputs + past, outputs + present
