"""Batched decoding: several requests in flight, their forwards run as one batched forward.

A `BatchEngine` holds `slots` sequences. Each slot is an ordinary `EagleRuntime` (its own
`Decoder`, drafter, stop strings, sampling RNG and stats) whose target and draft backends are
`SlotBackend`s: a slot's forward is handed to the engine, which waits until every busy slot
has handed in its next forward and then runs them together:

1. a prefill (a prompt's rows, `StepInputs.prefill`: from row 0, or from the rows a prefix-cache
   hit copied in, or an answer being settled) and any other forward with an empty past (the
   drafter's first extension) runs alone, on the slot's own rows (large and rare; batching it
   would pad every other slot to its length);
2. otherwise the draft forwards first (those with the same feature inputs together: an
   EAGLE-3 extension and an expansion fill different inputs), so every slot finishes drafting
   its tree, then all the target forwards (tree verifications, vanilla steps) as one.

Slots join and leave between forwards (continuous batching): a finished request frees its slot
at once and the next queued request takes it with a prefill. Each slot is driven by its own
thread (`generate_many`, or eagle-serve's workers); the decode loop itself is unchanged.

Chunked prefill (`prefill_chunk` > 0; eagle-serve's `--prefill-chunk`): a prompt of
prefill_chunk + 2 tokens or more is run in chunks of
prefill_chunk rows ([a, b) at past a on its own slot's rows; the last one 2 to
prefill_chunk + 1 rows, never one), with one forward of the other slots between two chunks,
so a ~1k-token prompt no longer stalls every stream for its whole prefill (vLLM, SGLang and
TensorRT-LLM chunk prefills for the same reason; a prefill after a prefix-cache hit is chunked
from its first uncached row). Prefills waiting together go shortest
remaining first, so a short prompt (one chunk or less, run whole) never waits for a long one's
chunks. A long prompt with no other slot decoding is chunked too: its chunks run back to
back, which on a CPU is also faster than one forward (attention over fewer query rows at
once: docs/decisions.md, 2026-12-06; EagleRuntime's Decoder chunks the same way). Each
chunk's rows are computed as the same rows of the whole prefill are (tests/runtime/test_batch.py: tokens, logits and KV
bit-identical); the request's outputs are its chunks' joined. An EAGLE-3 draft's first
extension (tapped and own features mixed) always runs whole.

Trees under load: every busy slot adds its tree to each verification forward, and on a CPU a
forward's cost grows with its rows, so by default each round a slot drafts the smaller tree
`tree_under_load` gives for the number of busy slots (about twice the configured tree's rows
per batched verification in all). Output does not depend on the tree; `shrink_trees=False`
keeps the configured tree (then a seed gives the same tokens batched as alone).

Padding (contract "Batched forwards"): one batched forward covers the slots [lo, hi) from the
lowest to the highest slot in it (eagle-serve hands each request the lowest free slot, so busy
slots stay packed and idle ones in between are rare); every row keeps its own past. Row b of
a slot in the group carries its S_b new tokens then padding up to S = the largest S_b, at
past_b = its own rows; a slot in that range that is not in the group gets S padding tokens at
past = the rows it holds. Row b's mask is its own mask, [S_b, past_b + S_b], with padding rows
seeing only themselves; the graph reads each row's past from its mask (its last token's last
visible column is past_b + S - 1) and writes row b's new KV at [past_b, past_b + S) of slot
b's block, where padding rows land beyond what the slot holds.
Nothing is copied afterwards: each slot's KV is exactly what its solo forward would write.

Guarantees (measured on onnxruntime 1.32's CPU kernels; tests/runtime/test_batch.py): a row
of a batched forward computes the same bits as the same row of that slot's solo forward
whenever the solo forward has two or more tokens (attention reads only the row's own
columns; matrix products are per row). A one-token solo forward runs onnxruntime's one-row
kernel and can differ in the last bit. So: row-exact decoding (the default for quantised
exports: one-token forwards run as two rows, or as one row whose attention the graph repeats
itself, manifest `target.extra.repeats_one_row`) is bit-identical batched and alone; fp32 greedy
output is token-identical except at exact near-ties, as EAGLE vs vanilla already is;
sampling follows the target distribution, and with a `seed` gives the tokens the request gets
alone whenever the bits agree (each slot owns its RNG). Graphs whose rounding mixes rows (int8
dynamic quantisation, `quantize_graph(method="dynamic")`: one activation scale per batched
tensor) are refused (`check_batchable`); the default int4 and int8 exports (MatMulNBits) are
row-exact.
Seeded tokens also need the same tree: they match alone with `shrink_trees=False`, or while at
most two slots are busy.

Prefix cache (`prefix_cache_mb`, runtime/prefix_cache.py): one cache for all slots, so a
conversation's next turn reuses its KV on whichever slot it lands. A hit's rows are copied into
the slot's block by the slot's thread before its first forward, while no forward runs (every
busy slot must hand one in first); a request is settled inside its busy() block, and on exit
what was not is dropped (the slot's rows are released).

Needs the fused graphs (KV layout "shared", manifest `extra.ragged_batch`: the default
onnxruntime export; each slot's rows are one contiguous block, so a prefill binds that block
alone) and a backend whose `allocate_kv` takes a batch (onnxruntime CPU). KV is allocated once
per graph for all slots: [slots, kv_heads, capacity + margin, head_dim], the margin being the
padding rows a batched forward may write past a slot's own capacity (`margin_rows`); a forward
that would not fit runs alone.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from eagle_deploy.contract.dtypes import numpy_dtype
from eagle_deploy.contract.manifest import Manifest
from eagle_deploy.contract.onnx_io import KV_SHARED, rows_written
from eagle_deploy.contract.profiles import draft_kv_capacity
from eagle_deploy.contract.tree_config import TreeConfig
from eagle_deploy.contract.verify import verify_export

from .api import EagleRuntime, load_tokenizer, row_exact_default
from .backends import load_backend
from .backends.base import StepInputs, StepOutputs
from .costs import device_costs
from .decode import RoundObserver, chunk_end
from .drafter import Drafter, EagleDrafter
from .hybrid import LOOKUP_ROWS, make_drafter, uses_draft_graph
from .kv import KVBuffer
from .memory import available_mb
from .options import EngineOptions
from .prefix_cache import PrefixCache
from .request import Prompt
from .row_exact import matmuls_row_exact, step_rows, target_kv_capacity

# output fields whose axis 1 follows logits_indices (N); every other output follows the new tokens (S)
_PER_LOGIT = {"logits", "topk_logprobs", "topk_ids"}


class BatchError(ValueError):
    """An export or setting batched decoding cannot serve (raised when the engine is built)."""


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
    slots keep `tree`; so do static (EAGLE-1) and root-only trees. Measured on SmolLM2 fp32
    (tree 8/4/2, fp32 draft graph, 2 cores, 96 tokens, 4 / 8 code prompts): 4 slots 8/4/2 138 tokens/s
    -> 4/2/2 163 (vanilla 131); 8 slots 126 -> 2/1/1 179 (vanilla 155). The output does not
    depend on the tree (lossless); a seed's tokens do."""
    if tree.kind != "dynamic" or tree.total_tokens <= 2:
        return tree
    total = max(2, min(tree.total_tokens, 2 * tree.total_tokens // max(busy, 1)))
    if total == tree.total_tokens:
        return tree
    return TreeConfig("dynamic", total_tokens=total, depth=min(tree.depth, max(1, total // 2)),
                      top_k=min(tree.top_k, total - 1))


class _LoadTrees:
    """Slot drafter wrapper: each round drafts `tree_under_load` of the slots busy right now."""

    def __init__(self, inner: EagleDrafter, engine: "BatchEngine"):
        self.inner, self.engine, self.base = inner, engine, inner.tree

    @property
    def forwards(self) -> int:
        return self.inner.forwards

    def reset(self) -> None:
        self.inner.reset()

    def propose(self, request):
        self.inner.tree = tree_under_load(self.base, self.engine.busy_slots)
        return self.inner.propose(request)

    def __getattr__(self, name: str):  # the EAGLE drafter's other attributes (backend, kv, length)
        return getattr(self.inner, name)


def kv_bytes_per_slot(manifest: Manifest, tree: TreeConfig, row_exact: bool) -> int:
    """Bytes of target + draft KV one slot holds in a BatchEngine (capacities as the decoder
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


@dataclass
class _Call:
    """One slot's forward waiting for the engine."""

    slot: int
    role: str  # "target" | "draft"
    inputs: StepInputs
    past: int
    result: StepOutputs | BaseException | None = None
    done: bool = False
    rows_done: int = 0  # a chunked prefill: rows already run
    parts: list = field(default_factory=list)  # a chunked prefill: (first row, last row + 1, outputs, logit rows)

    @property
    def seq(self) -> int:
        return int(self.inputs.input_ids.shape[1])

    @property
    def signature(self) -> tuple:
        """Forwards with equal signatures can share one batched forward."""
        rows = tuple(a is not None and a.shape[1] > 0 for a in (self.inputs.features, self.inputs.tapped_features))
        return (self.role, rows)


class SlotBackend:
    """Slot `slot`'s view of graph `role` in a BatchEngine (a `Backend`): `allocate_kv` returns
    the slot's block of the engine's batched buffer, `run` hands the forward to the engine and
    returns this slot's rows of the batched result (batch 1, as a solo forward would)."""

    def __init__(self, engine: "BatchEngine", role: str, slot: int):
        self.engine, self.role, self.slot = engine, role, slot
        inner = engine.backends[role]
        self.name = f"{inner.name}-batched"
        self.kv_names = inner.kv_names

    def allocate_kv(self, capacity: int) -> KVBuffer:
        return self.engine.slot_kv(self.role, self.slot, capacity)

    def run(self, inputs: StepInputs, kv: KVBuffer, past: int) -> StepOutputs:
        return self.engine.forward(_Call(self.slot, self.role, inputs, past))


class BatchEngine:
    """`slots` EagleRuntimes over one pair of backends, their forwards batched (module doc).

    runtimes[b]: slot b's runtime; drive each from its own thread inside `busy(b)`:

        engine = BatchEngine.load("engines/smollm2-135m", slots=4)
        results = engine.generate_many(["Hi", "Write a haiku", ...], max_new_tokens=64)

    Counters: batched_forwards (forwards of two or more slots), solo_forwards (of one slot).
    """

    def __init__(self, folder: Path, manifest: Manifest, backends: dict, tokenizer, slots: int,
                 options: EngineOptions | None = None,
                 round_observers: Callable[[int], Sequence[RoundObserver]] | None = None,
                 drafters: Callable[[int, EagleDrafter], Drafter] | None = None, shrink_trees: bool = True):
        """backends: {"target": Backend, "draft": Backend} (batch-capable, see check_batchable);
        options: how every slot decodes (EngineOptions: the drafter kind and planning as for
        EagleRuntime, the slots sharing one CostModel; its tree None: the manifest's; its
        prefill_chunk: a prompt of prefill_chunk + 2 tokens or more is prefilled in chunks of
        that size, one chunk per forward of the other slots while they decode, back to back
        while none does (module doc, "Chunked prefill"); 0: in one forward).
        round_observers(b): slot b's round observers (see Decoder); drafters(b, drafter): the
        drafter slot b uses, given its EAGLE drafter over the batched draft graph (tests wrap
        it to force trees); shrink_trees: draft `tree_under_load` of the busy slots each round
        (False: the tree always, so a seed gives the same tokens batched as alone).
        Raises BatchError."""
        options = EngineOptions.of(options)
        check_batchable(manifest, slots, options.backend)
        tree = (options.tree or manifest.tree).validate(manifest.draft.graph_top_k)
        drafter_kind, planned = options.drafter_kind, options.planned
        self.prefill_chunk = options.prefill_chunk
        self._row_exact = row_exact_default(manifest) if options.row_exact is None else options.row_exact
        slot_options = options.replace(tree=tree, row_exact=self._row_exact, prefill_chunk=0)  # chunked here
        check_kv_fits(manifest, tree, slots, self._row_exact)
        self.backends, self.slots, self.tree = backends, slots, tree
        self._repeats = manifest.target.repeats_one_row  # the target graph writes a spare row (contract)
        self._cond = threading.Condition()
        self._buffers: dict[str, KVBuffer] = {}
        self._views: dict[tuple, KVBuffer] = {}  # (role, lo, hi) -> view of slots [lo, hi), made once
        self._busy: set[int] = set()
        self._pending: dict[int, _Call] = {}
        self._held = {role: [0] * slots for role in backends}  # rows each slot still holds, per graph
        self._capacity: dict[str, int] = {}  # rows per slot each graph's buffer was allocated for
        self._session = [0] * slots  # busy() sessions per slot
        self._started = [-1] * slots  # the session in which each slot's current request was prefilled
        self.batched_forwards = self.solo_forwards = self.prefill_chunks = 0
        self._decode_turn = False  # with prefill_chunk: the decoding slots run next (a prefill ran last)
        rows = step_rows(self._row_exact, self._repeats, matmuls_row_exact(manifest.target))  # as each Decoder's
        observers = round_observers or (lambda b: ())
        wrap = drafters or (lambda b, drafter: drafter)

        self.costs = None
        if planned:
            self.costs = device_costs(manifest, tree, backends["target"], backends.get("draft")
                                      if uses_draft_graph(drafter_kind) else None, folder,
                                      getattr(backends["target"], "threads", None), LOOKUP_ROWS)

        def drafter(b: int) -> Drafter:
            eagle = None
            if uses_draft_graph(drafter_kind):
                eagle = EagleDrafter.for_export(SlotBackend(self, "draft", b), tree, manifest)
                eagle = _LoadTrees(eagle, self) if shrink_trees else eagle
            return wrap(b, make_drafter(drafter_kind, eagle, tree, planned, self.costs, self._row_exact, rows))

        self.prefix_cache = PrefixCache.of_mb(options.prefix_cache_mb)  # one for every slot (module doc)
        self.runtimes = [EagleRuntime(folder, manifest, SlotBackend(self, "target", b), None, tokenizer, slot_options,
                                      drafter(b), observers(b), self.costs,  # prefills chunked here (_run_chunk)
                                      prefix_cache=self.prefix_cache)
                         for b in range(slots)]

    @classmethod
    def load(cls, folder, slots: int, options: EngineOptions | None = None, *,
             round_observers: Callable[[int], Sequence[RoundObserver]] | None = None,
             drafters: Callable[[int, EagleDrafter], Drafter] | None = None, shrink_trees: bool = True,
             **changes) -> "BatchEngine":
        """Load `folder` once for `slots` sequences, decoded as `options` say with `changes`
        on top (as for EagleRuntime.load; the other arguments as for __init__). Raises
        BatchError (check_batchable, check_kv_fits: before any graph is opened), and what
        EagleRuntime.load raises."""
        options = EngineOptions.of(options, **changes)
        folder = Path(folder)
        manifest = Manifest.load(folder)
        verify_export(folder, manifest, options.verify)  # as for EagleRuntime.load
        check_batchable(manifest, slots, options.backend)
        tree = (options.tree or manifest.tree).validate(manifest.draft.graph_top_k)
        options = options.replace(tree=tree)
        check_kv_fits(manifest, tree, slots, row_exact_default(manifest) if options.row_exact is None
                      else options.row_exact)
        backends = {which: load_backend(options.backend, folder, manifest, which, options.threads, tree=tree)
                    for which in ("target", "draft")}
        return cls(folder, manifest, backends, load_tokenizer(folder, manifest), slots, options, round_observers,
                   drafters, shrink_trees)

    # -- KV ------------------------------------------------------------------------------------

    def slot_kv(self, role: str, slot: int, capacity: int) -> KVBuffer:
        """Slot `slot`'s block of graph `role`'s batched buffer, allocated on first use with
        `capacity` + margin_rows rows for every slot. Raises BatchError when a slot asks for more
        rows than the buffer was allocated for."""
        with self._cond:
            buf = self._buffers.get(role)
            if buf is None:
                rows = capacity + margin_rows(self.tree, self._row_exact or self._repeats)
                buf = self._buffers[role] = self.backends[role].allocate_kv(rows, batch=self.slots)
                self._capacity[role] = capacity
            if capacity > self._capacity[role]:
                raise BatchError(f"slot {slot} asks for {capacity} {role} KV rows; the batched buffer holds "
                                 f"{self._capacity[role]} per slot")
            return self._view(role, slot, slot + 1)

    def _view(self, role: str, lo: int, hi: int) -> KVBuffer:
        """Graph `role`'s buffer restricted to the slots [lo, hi) (KVBuffer.slots: one contiguous
        block in the shared layout), made once, so a backend's bindings of it stay valid."""
        key = (role, lo, hi)
        if key not in self._views:
            self._views[key] = self._buffers[role].slots(lo, hi)
        return self._views[key]

    @property
    def buffers(self) -> dict[str, KVBuffer]:
        """The batched KV buffer of each graph ({"target", "draft"}), allocated once."""
        return dict(self._buffers)

    @property
    def kv_bytes(self) -> int:
        """Bytes of every KV buffer the engine holds (all slots, both graphs)."""
        return sum(buf.nbytes for buf in self._buffers.values())

    # -- slots ---------------------------------------------------------------------------------

    @property
    def busy_slots(self) -> int:
        """Slots decoding a request now."""
        return len(self._busy)

    @contextmanager
    def busy(self, slot: int) -> Iterator[EagleRuntime]:
        """Mark `slot` busy while its thread decodes a request with the yielded runtime; the
        engine waits for a forward from every busy slot before it runs a batch, so a busy slot
        must be driven without pause. On exit the slot's rows are released (and a request
        not settled into the prefix cache by then is dropped: module doc)."""
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.slots:
            raise IndexError(f"slot {slot!r}: this engine has slots 0 .. {self.slots - 1}")
        with self._cond:
            if slot in self._busy:
                raise RuntimeError(f"slot {slot} is already busy")
            self._busy.add(slot)
            self._session[slot] += 1
        try:
            yield self.runtimes[slot]
        finally:
            self.runtimes[slot].decoder.unsettled = None  # its rows may hold other slots' padding from now on
            with self._cond:
                self._busy.discard(slot)
                self._pending.pop(slot, None)
                for held in self._held.values():
                    held[slot] = 0
                self._dispatch()

    def forward(self, call: _Call) -> StepOutputs:
        """Run `call` in the next batch (called by SlotBackend.run in the slot's thread).
        Raises RuntimeError outside busy(), and for a request started in an earlier busy()
        session of the slot (its rows were released and may hold other requests' padding)."""
        with self._cond:
            if call.slot not in self._busy:
                raise RuntimeError(f"slot {call.slot} ran a forward outside BatchEngine.busy()")
            if call.role == "target" and (call.past == 0 or call.inputs.prefill):  # a prefill starts the request
                self._started[call.slot] = self._session[call.slot]
            elif self._started[call.slot] != self._session[call.slot]:
                raise RuntimeError(f"slot {call.slot}'s request was started in an earlier busy() session and its KV "
                                   "rows have been released since: finish a request inside one busy() block")
            # the call reads rows [0, past) of its slot (a prefix-cache hit copied some in): a
            # batched forward without it pads the slot from there on
            self._held[call.role][call.slot] = call.past
            self._pending[call.slot] = call
            self._dispatch()
            while not call.done:
                self._cond.wait()
        if isinstance(call.result, BaseException):
            raise call.result
        return call.result

    def _dispatch(self) -> None:
        """With the lock held: while every busy slot waits on a forward, run the next group
        (or the next chunk of a chunked prefill, which leaves its slot waiting)."""
        while self._pending and len(self._pending) >= len(self._busy):
            self._step()

    def _step(self) -> None:
        calls = sorted(self._pending.values(), key=lambda c: c.slot)
        first = [c for c in calls if c.past == 0 or c.inputs.prefill]
        rest = [c for c in calls if not (c.past == 0 or c.inputs.prefill)]
        if not first or (rest and self._decode_turn):  # decoding slots' turn (after a prefill chunk)
            self._decode_turn = False
            self._run_group(self._group(rest))
        elif not self.prefill_chunk:
            self._run_group(first[:1])
        else:  # shortest remaining prefill first: a short prompt never waits for a long one's chunks
            call = min(first, key=lambda c: (c.seq - c.rows_done, c.slot))
            if call.rows_done == 0 and not self._chunked(call):
                self._run_group([call])  # whole: one chunk or less
            else:
                self._run_chunk(call)
            self._decode_turn = bool(rest)
        self._cond.notify_all()

    @staticmethod
    def _group(calls: list[_Call]) -> list[_Call]:
        """The forwards that run next as one batch: the draft forwards with the first one's
        inputs (every slot finishes drafting before any verifies), else all of them."""
        pool = [c for c in calls if c.role == "draft"] or calls
        return [c for c in pool if c.signature == pool[0].signature]

    def _run_group(self, group: list[_Call]) -> None:
        """Run `group` (one forward, or each alone) and complete its calls; lock held."""
        try:
            if len(group) == 1:
                self._run_solo(group[0])
            elif not self._run_batched(group):  # too wide for the buffer: one by one
                self._run_each(group)
        except Exception:  # the batched forward failed: run each alone, so only the request at fault fails
            self._run_each(group)
        except BaseException as err:  # KeyboardInterrupt and the like: everyone in the group stops
            for c in group:
                c.result = err
        for c in group:
            c.done = True
            del self._pending[c.slot]

    def _chunked(self, call: _Call) -> bool:
        """Whether a prefill is split into chunks: prefill_chunk + 2 tokens or more, its rows
        aligned with its inputs (an EAGLE-3 draft's first extension mixes tapped and own
        features and always runs whole)."""
        x = call.inputs
        return (self.prefill_chunk > 0 and call.seq >= self.prefill_chunk + 2
                and (x.tapped_features is None or x.tapped_features.shape[1] == 0)
                and (x.features is None or x.features.shape[1] == call.seq))

    def _run_chunk(self, call: _Call) -> None:
        """The next chunk of a chunked prefill on its slot's rows: its rows [a, a + prefill_chunk)
        at past call.past + a, or the rest at once when at most prefill_chunk + 1 rows remain,
        so no chunk is one row (onnxruntime's one-row kernels round differently). The call
        completes with its chunks' outputs joined (`_join_chunks`) after the last. Lock held."""
        a, S = call.rows_done, call.seq
        b = chunk_end(a, S, self.prefill_chunk)
        x = call.inputs
        want = x.logits_indices[0]
        inside = [int(i) for i in want if a <= i < b]
        chunk = StepInputs(x.input_ids[:, a:b], x.position_ids[:, a:b], x.attention_mask[:, a:b, :call.past + b],
                           np.array([[i - a for i in inside] or [0]], np.int64),
                           None if x.features is None else x.features[:, a:b], x.tapped_features, x.prefill)
        try:
            part = _Call(call.slot, call.role, chunk, call.past + a)
            self._run_solo(part)
            call.parts.append((a, b, _copied(part.result), inside))
            self.prefill_chunks += 1
            call.rows_done = b
            if b == S:
                call.result = _join_chunks(call.parts, want)
        except BaseException as err:  # this request fails (KeyboardInterrupt and the like reach its thread)
            call.result, b = err, S
        if b == S:
            call.done = True
            del self._pending[call.slot]

    def _run_each(self, group: list[_Call]) -> None:
        """Each call alone, its outputs copied (the backend reuses its output arrays, and every
        thread reads its result only after this dispatch); a call that raises gets its error."""
        for c in group:
            try:
                self._run_solo(c)
                c.result = _copied(c.result)
            except Exception as err:
                c.result = err

    def _run_solo(self, call: _Call) -> None:
        kv = self._view(call.role, call.slot, call.slot + 1)
        call.result = self.backends[call.role].run(call.inputs, kv, call.past)
        self._held[call.role][call.slot] = call.past + call.seq
        self.solo_forwards += 1

    def _run_batched(self, group: list[_Call]) -> bool:
        """One forward over slots [lo, hi) for `group`, each row at its own past (module doc,
        "Padding"); False (nothing run) when a row would not fit in the buffer."""
        role = group[0].role
        lo, hi = group[0].slot, group[-1].slot + 1
        calls = {c.slot - lo: c for c in group}  # by row of the batched forward
        held = self._held[role]
        pasts = [calls[r].past if r in calls else held[lo + r] for r in range(hi - lo)]
        S = max(c.seq for c in group)
        kv = self._view(role, lo, hi)
        if max(pasts) + rows_written(S, role == "target" and self._repeats) > kv.capacity:
            return False
        out = self.backends[role].run(_pad(calls, pasts, S), kv, max(pasts))
        for r, c in calls.items():
            held[c.slot] = c.past + c.seq
            n = c.inputs.logits_indices.shape[1]
            c.result = type(out)(**{f.name: _rows(getattr(out, f.name), r, n if f.name in _PER_LOGIT else c.seq)
                                    for f in fields(out)})
        self.batched_forwards += 1
        return True

    # -- convenience ---------------------------------------------------------------------------

    def generate_many(self, prompts: Sequence[Prompt], per_request: Sequence[dict] | None = None,
                      return_exceptions: bool = False, **kw) -> list:
        """Generate every prompt, up to `slots` at a time, each slot driven by its own thread;
        results (GenerationResult) in prompt order. kw: EagleRuntime.generate's keywords for
        all requests, per_request[i]: more for request i. A request that raises fails alone:
        its exception is returned in its place with return_exceptions, else the first one is
        raised after every request has ended."""
        per_request = per_request or [{}] * len(prompts)
        if len(per_request) != len(prompts):
            raise ValueError(f"{len(per_request)} per-request settings for {len(prompts)} prompts")
        results: list = [None] * len(prompts)
        todo = iter(range(len(prompts)))
        lock = threading.Lock()

        def worker(slot: int) -> None:
            while True:
                with lock:
                    i = next(todo, None)
                if i is None:
                    return
                try:
                    with self.busy(slot) as rt:
                        results[i] = rt.generate(prompts[i], **{**kw, **per_request[i]})
                except Exception as err:  # reported after the others finish
                    results[i] = err

        threads = [threading.Thread(target=worker, args=(b,), daemon=True)
                   for b in range(min(self.slots, len(prompts)))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        errors = [r for r in results if isinstance(r, Exception)]
        if errors and not return_exceptions:
            raise errors[0]
        return results


def _copied(out: StepOutputs) -> StepOutputs:
    """`out` with its arrays copied (a backend reuses its output arrays on the next call)."""
    return type(out)(**{f.name: None if getattr(out, f.name) is None else getattr(out, f.name).copy()
                        for f in fields(out)})


def _join_chunks(parts: list, want: np.ndarray) -> StepOutputs:
    """One prefill's outputs from its chunks [(a, b, outputs, logit rows)]: the per-token
    outputs concatenated along the rows, the per-logit ones (_PER_LOGIT) taken at `want` (the
    prefill's logits_indices) from the chunk holding each row."""
    kind = type(parts[0][2])
    joined = {}
    for f in fields(kind):
        if getattr(parts[0][2], f.name) is None:
            joined[f.name] = None
        elif f.name in _PER_LOGIT:
            picks = []
            for i in (int(i) for i in want):
                _, _, out, rows = next(p for p in parts if p[0] <= i < p[1])
                picks.append(getattr(out, f.name)[:, rows.index(i)])
            joined[f.name] = np.stack(picks, axis=1)
        else:
            joined[f.name] = np.concatenate([getattr(out, f.name) for _, _, out, _ in parts], axis=1)
    return kind(**joined)


def _rows(a: np.ndarray | None, slot: int, n: int) -> np.ndarray | None:
    """Slot `slot`'s first n rows of a batched output, as batch 1 (a view)."""
    return None if a is None else a[slot:slot + 1, :n]


def _pad(calls: dict[int, _Call], pasts: list[int], S: int) -> StepInputs:
    """The batched StepInputs for len(pasts) rows (`calls` by row): row b at past pasts[b] with
    S new tokens, its call's tokens first and padding after them (module doc, "Padding")."""
    B, T = len(pasts), max(pasts) + S
    group = list(calls.values())
    N = max(c.inputs.logits_indices.shape[1] for c in group)
    ids = np.zeros((B, S), np.int64)
    pos = np.full((B, S), min(int(c.inputs.position_ids.min()) for c in group), np.int64)
    mask = np.zeros((B, S, T), bool)
    for b, past in enumerate(pasts):
        mask[b, np.arange(S), past + np.arange(S)] = True  # padding rows see themselves only
    logits_at = np.zeros((B, N), np.int64)
    first = group[0].inputs
    feats = {name: None if a is None else np.zeros((B, S if a.shape[1] else 0, a.shape[2]), a.dtype)
             for name, a in (("features", first.features), ("tapped_features", first.tapped_features))}
    for b, c in calls.items():
        s, x, past = c.seq, c.inputs, c.past
        ids[b, :s], pos[b, :s] = x.input_ids[0], x.position_ids[0]
        mask[b, :s, :past + s] = x.attention_mask[0]
        logits_at[b, :x.logits_indices.shape[1]] = x.logits_indices[0]
        for name, buf in feats.items():
            if buf is not None and buf.shape[1]:
                buf[b, :s] = getattr(x, name)[0]
    return StepInputs(ids, pos, mask, logits_at, feats["features"], feats["tapped_features"])


__all__ = ["BatchEngine", "BatchError", "SlotBackend", "check_batchable", "check_kv_fits", "kv_bytes_per_slot",
           "margin_rows", "tree_under_load"]
