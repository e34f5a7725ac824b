"""What batched decoding accepts and what each of its slots holds: the exports and settings a
`BatchRuntime` (runtime/batch.py) can serve, the KV rows and bytes of one slot, how many slots
fit in memory, and the tree each slot drafts while others are busy.

Accepted (`check_batchable`, raised as `BatchError` when the batch runtime is built): the fused graphs
(KV layout "shared", manifest `extra.ragged_batch`: the default onnxruntime export; each slot's
rows are one contiguous block, so a prefill binds that block alone), a backend whose
`allocate_kv` takes a batch (onnxruntime CPU), and graphs whose rows round independently of
each other (not int8 dynamic quantisation). KV is allocated once per graph for all slots:
[slots, kv_heads, capacity + margin, head_dim], the margin being the padding rows a batched
forward may write past a slot's own capacity (`margin_rows`); `check_kv_fits` refuses slots
whose KV would not fit in the memory available.

Trees under load (`tree_under_load`): every busy slot adds its tree to each verification
forward, and on a CPU a forward's cost grows with its rows, so by default each round a slot
drafts the smaller tree `tree_under_load` gives for the number of busy slots (about twice the
configured tree's rows per batched verification in all). Output does not depend on the tree.
"""
from __future__ import annotations

import numpy as np

from eagle_deploy.contract.dtypes import numpy_dtype
from eagle_deploy.contract.manifest import Manifest
from eagle_deploy.contract.onnx_io import KV_SHARED
from eagle_deploy.contract.profiles import draft_kv_capacity
from eagle_deploy.contract.tree_config import TreeConfig

from .memory import available_mb
from .row_exact import target_kv_capacity


class BatchError(ValueError):
    """An export or setting batched decoding cannot serve (raised when the batch runtime is built)."""


def check_batchable(manifest: Manifest, slots: int, backend: str) -> None:
    """Raise BatchError unless `slots` sequences can be decoded in batched forwards of this
    export: slots >= 1, backend "ort", both graphs fused ("shared" KV layout, ragged_batch),
    and graphs whose rows round independently of each other (not int8 dynamic quantisation;
    the default int4 / int8 MatMulNBits graphs are, bit for bit)."""
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise BatchError(f"slots must be a whole number >= 1, got {slots!r}")
    if slots == 1:
        return
    if backend != "ort":
        raise BatchError(f"batched decoding (slots {slots}) runs on the onnxruntime CPU backend only, not {backend!r}; "
                         "use slots 1")
    for which in ("target", "draft"):
        graph = getattr(manifest, which)
        if graph.kv_layout != KV_SHARED:
            raise BatchError(f"batched decoding needs the fused graph (KV layout {KV_SHARED!r}); this export's {which} "
                             f"graph has {graph.kv_layout!r} (--graph standard): use slots 1 or re-export without it")
        if not graph.ragged_batch:
            raise BatchError(f"this export's {which} graph predates batched decoding (its manifest lacks "
                             f"{which}.extra.ragged_batch): re-export it with this version, or use slots 1")
    for which in ("target", "draft"):
        info = getattr(manifest, which).quant_info
        if info is not None and info.method == "dynamic":
            raise BatchError(f"batched decoding of this export would change its output: its {which} graph uses "
                             "dynamic int8 quantisation, which scales each batched activation tensor by its largest "
                             "value, so one request's tokens would depend on the others'; use slots 1, or re-export "
                             "with the default quantisation (MatMulNBits, whose rows are independent)")


def margin_rows(tree: TreeConfig, row_exact: bool) -> int:
    """KV rows a batched forward may write past one slot's own capacity: the largest number of
    new tokens a batched forward carries (a verification tree, a draft expansion of top_k^2
    frontier nodes, an extension of depth + 1 accepted tokens), with a spare row for row-exact
    one-token forwards (`row_exact`: or one-token forwards of a graph that repeats one-row
    queries, which write a spare row too)."""
    return tree.total_tokens + tree.depth + 2 + (tree.top_k or 1) ** 2 + int(row_exact)


def tree_under_load(tree: TreeConfig, busy: int) -> TreeConfig:
    """The dynamic tree each of `busy` slots drafts when they share every verification forward:
    per-slot total_tokens = 2 * tree.total_tokens // busy, clamped to [2, tree.total_tokens]
    (about twice the configured tree's rows per batched verification), depth at most half of
    it and top_k below it (8/4/2: 3 busy 5/2/2, 4 busy 4/2/2, 8 busy 2/1/1). One or two busy
    slots keep `tree`; so do static (EAGLE-1) and root-only trees. Sized so because the smaller
    trees were faster than the configured one at 4 and 8 busy slots, and than vanilla
    (docs/decisions.md, 'Trees under load, measured'). The output does not depend on the tree
    (lossless); a seed's tokens do."""
    if tree.kind != "dynamic" or tree.total_tokens <= 2:
        return tree
    total = max(2, min(tree.total_tokens, 2 * tree.total_tokens // max(busy, 1)))
    if total == tree.total_tokens:
        return tree
    return TreeConfig("dynamic", total_tokens=total, depth=min(tree.depth, max(1, total // 2)),
                      top_k=min(tree.top_k, total - 1))


def kv_bytes_per_slot(manifest: Manifest, tree: TreeConfig, row_exact: bool) -> int:
    """Bytes of target + draft KV one slot holds in a BatchRuntime (capacities as the decoder
    and drafter ask for them, plus margin_rows)."""
    repeats = manifest.target.repeats_one_row
    margin = margin_rows(tree, row_exact or repeats)
    total = 0
    for which, rows in (("target", target_kv_capacity(manifest.max_length, row_exact, repeats)),
                        ("draft", draft_kv_capacity(manifest.max_length, tree))):
        graph, dims = getattr(manifest, which), manifest.graph_dims(which)
        itemsize = np.dtype(numpy_dtype(graph.dtype)).itemsize
        per_row = 2 * graph.num_kv_layers() * dims.num_kv_heads * dims.head_dim * itemsize
        total += (rows + margin) * per_row
    return total


def check_kv_fits(manifest: Manifest, tree: TreeConfig, slots: int, row_exact: bool,
                  available_mib: float | None = None) -> None:
    """Raise BatchError when the KV of `slots` slots would take more than 80% of the memory the
    system has available (available_mib: default the system's, psutil; no check without it),
    naming how many slots fit."""
    available_mib = available_mb() if available_mib is None else available_mib
    if available_mib is None or slots <= 1:
        return
    per_slot = kv_bytes_per_slot(manifest, tree, row_exact) / 2**20
    if slots * per_slot > 0.8 * available_mib:
        fit = int(0.8 * available_mib // per_slot)
        raise BatchError(f"{slots} slots need {slots * per_slot:,.0f} MiB of KV ({per_slot:,.0f} MiB each at "
                         f"max_length {manifest.max_length}) but {available_mib:,.0f} MiB is available: "
                         f"at most {fit} slots fit")


__all__ = ["BatchError", "check_batchable", "check_kv_fits", "kv_bytes_per_slot", "margin_rows", "tree_under_load"]
