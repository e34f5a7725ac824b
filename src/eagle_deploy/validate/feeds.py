"""Realistic graph feeds, shaped as the runtime makes them (eagle-validate).

Target: a prefill (past 0, causal), a one-token decode step and a tree verification (past
from that prefill; a 10-node tree with three branches at the root, its tree mask and
depth-based positions). Draft: the extension over the prompt's (feature, shifted token)
pairs, then two frontier expansions in scratch rows with the tree mask over their
ancestors (depth 1, then depth 2), exactly as `runtime.drafter.EagleDrafter` feeds them.
The past KV and features come from a reference forward (`forward(feeds) -> (outputs,
presents)`), run in float32 and cast to the graph dtype.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from eagle_deploy.contract import onnx_io as c
from eagle_deploy.contract.manifest import Dims
from eagle_deploy.runtime.backends.base import feature_inputs
from eagle_deploy.runtime.drafter import causal_mask, expansion_mask
from eagle_deploy.runtime.text import encode_user
from eagle_deploy.runtime.tree import DraftTree

# node i's parent; depths 0 1 1 1 2 2 2 3 3 4: three branches at the root, two under node 1
VERIFY_PARENTS = (-1, 0, 0, 0, 1, 1, 2, 4, 4, 7)
PROMPT_TEXT = ("Write a Python function that returns the n-th Fibonacci number, "
               "then explain how it works in two sentences.")

Forward = Callable[[dict], tuple[dict, list]]  # feeds (incl. past by name) -> (outputs, presents)


@dataclass
class Feed:
    """One named graph input set (every input of the graph, by contract name)."""

    label: str
    inputs: dict[str, np.ndarray]


def in_kv_layout(feeds: list[Feed], layout: str) -> list[Feed]:
    """`feeds` (past KV sequence-major, [P, 1, kvh, hd]) as a graph of KV layout `layout` takes
    them without IO binding. "shared": [1, kvh, P, hd], a buffer of exactly the past rows, for
    which the fused operator returns present [1, kvh, P + S, hd] (past rows, then the new ones)
    instead of writing in place."""
    if layout != c.KV_SHARED:
        return feeds
    return [Feed(f.label, {k: np.ascontiguousarray(v.transpose(1, 2, 0, 3)) if k.startswith("past_key_values.") else v
                           for k, v in f.inputs.items()}) for f in feeds]


def reference_forward(backend) -> Forward:
    """Adapter over TorchBackend.forward: feeds with the past by name -> (outputs, presents)."""
    def forward(feeds: dict) -> tuple[dict, list]:
        f32 = {k: v.astype(np.float32) if v.dtype.kind == "f" else v for k, v in feeds.items()}
        return backend.forward(f32, [f32[p] for p, _ in backend.kv_names])
    return forward


def prompt_ids(tokenizer, n: int, vocab: int, chat: bool) -> list[int]:
    """n prompt token ids: PROMPT_TEXT through the chat template (when the export has one),
    repeated or cut to n; deterministic pseudo-random ids without a tokenizer."""
    if tokenizer is None:
        return np.random.default_rng(0).integers(3, vocab, n).tolist()
    ids = encode_user(tokenizer, PROMPT_TEXT, chat)
    while len(ids) < n:
        ids += ids
    return [int(t) % vocab for t in ids[-n:]]  # the end keeps the template's assistant header


def _kv(arrays, dtype) -> list[np.ndarray]:
    return [np.ascontiguousarray(a, dtype=dtype) for a in arrays]


def _step(ids, pos, mask, logits_at) -> dict[str, np.ndarray]:
    return {c.INPUT_IDS: np.asarray(ids, np.int64)[None], c.POSITION_IDS: np.asarray(pos, np.int64)[None],
            c.ATTENTION_MASK: mask, c.LOGITS_INDICES: np.asarray(logits_at, np.int64)[None]}


def _with_past(feed: dict, kv_pairs, past: list[np.ndarray]) -> dict:
    feed = dict(feed)
    for (name, _), arr in zip(kv_pairs, past):
        feed[name] = arr
    return feed


def verify_tree(root: int, vocab: int, rng) -> DraftTree:
    tokens = [root] + rng.integers(3, vocab, len(VERIFY_PARENTS) - 1).tolist()
    return DraftTree(np.array(tokens), np.array(VERIFY_PARENTS), -np.arange(len(tokens), dtype=np.float32))


def target_feeds(forward: Forward, prompt: list[int], dims: Dims, dtype) -> tuple[list[Feed], dict]:
    """[prefill, decode, tree verification] feeds and the reference prefill state
    {"features" [n, H] fp32, "root": int, "present": fp32 KV arrays}."""
    n, kv_pairs = len(prompt), c.kv_names(dims.num_layers)
    empty = [np.zeros((0, 1, dims.num_kv_heads, dims.head_dim), dtype) for _ in kv_pairs]
    prefill = _with_past(_step(prompt, np.arange(n), causal_mask(0, n), np.arange(n)), kv_pairs, empty)
    outs, present = forward(prefill)
    root = int(np.argmax(outs[c.LOGITS][0, -1]))
    past = _kv(present, dtype)
    decode = _with_past(_step([root], [n], np.ones((1, 1, n + 1), bool), [0]), kv_pairs, past)
    tree = verify_tree(root, dims.vocab, np.random.default_rng(0))
    verify = _with_past(_step(tree.tokens, tree.positions(n), tree.attention_mask(n), np.arange(tree.size)), kv_pairs,
                        past)
    feeds = [Feed(f"prefill (S={n}, past 0)", prefill), Feed(f"decode (S=1, past {n})", decode),
             Feed(f"tree verify (S={tree.size}, past {n}, depth {int(tree.depths.max())})", verify)]
    features = outs[c.TAPPED_FEATURES] if c.TAPPED_FEATURES in outs else outs[c.FEATURES]  # what the head is fed
    return feeds, {"features": features[0], "root": root, "present": present}


def _with_features(feed: dict, features: np.ndarray, from_target: bool, widths: tuple[int, int] | None) -> dict:
    """`feed` plus its feature rows [1, S, F], as the runtime's drafter sends them
    (backends.base.feature_inputs)."""
    feed = dict(feed)
    feed[c.FEATURES], tapped = feature_inputs(features, from_target, widths)
    if tapped is not None:
        feed[c.TAPPED_FEATURES] = tapped
    return feed


def draft_feeds(forward: Forward, prompt: list[int], state: dict, dtype, frontier: int = 4,
                draft_dims: Dims | None = None, eagle3: bool = False) -> list[Feed]:
    """[extension, expansion at depth 1, expansion at depth 2 (tree mask)] feeds for the
    draft graph, from the target's prefill `state` (see target_feeds). draft_dims: the draft
    graph's (Manifest.graph_dims("draft"): the head's decoder layers and KV geometry; without
    it one layer of the target's KV geometry); eagle3: an EAGLE-3 draft graph (tapped features
    in the extension)."""
    n = len(prompt)
    kv_pairs = c.kv_names(draft_dims.num_layers if draft_dims is not None else 1)
    kvh, hd = ((draft_dims.num_kv_heads, draft_dims.head_dim) if draft_dims is not None
               else state["present"][0].shape[2:])
    empty = [np.zeros((0, 1, kvh, hd), dtype) for _ in kv_pairs]
    feats = state["features"].astype(dtype)[None]  # (1, n, F)
    widths = (draft_dims.hidden, feats.shape[-1]) if eagle3 else None
    ext = _with_past(_step(list(prompt[1:]) + [state["root"]], np.arange(n), causal_mask(0, n), [n - 1]),
                     kv_pairs, empty)
    ext = _with_features(ext, feats, True, widths)
    outs, present = forward(ext)
    H = outs[c.NEXT_FEATURES].shape[-1]
    K = min(frontier, outs[c.TOPK_IDS].shape[-1])
    root_feature = outs[c.NEXT_FEATURES][0, -1]
    d1 = _with_past(_step(outs[c.TOPK_IDS][0, 0, :K], np.full(K, n), expansion_mask(n, n, [[]] * K), np.arange(K)),
                    kv_pairs, _kv(present, dtype))
    d1 = _with_features(d1, np.repeat(root_feature[None, None], K, axis=1).astype(dtype).reshape(1, K, H), False,
                        widths)
    outs1, present1 = forward(d1)
    # depth-2 frontier: two children of scratch node 0, one each of nodes 1 and 2
    picks = [(0, 0), (0, 1), (1, 0), (2 % K, 0)]
    ids = [int(outs1[c.TOPK_IDS][0, p, r]) for p, r in picks]
    past2 = [np.concatenate([a, b]).astype(dtype) for a, b in zip(present, present1)]
    mask2 = expansion_mask(n, n + K, [[n + p] for p, _ in picks])  # each pick's parent: scratch row n + p
    d2 = _with_past(_step(ids, np.full(len(picks), n + 1), mask2, np.arange(len(picks))), kv_pairs, past2)
    d2 = _with_features(d2, np.stack([outs1[c.NEXT_FEATURES][0, p] for p, _ in picks])[None].astype(dtype), False,
                        widths)
    return [Feed(f"draft extend (S={n}, past 0)", ext), Feed(f"draft expand d1 (S={K}, past {n})", d1),
            Feed(f"draft expand d2 (S={len(picks)}, past {n + K}, tree mask)", d2)]
