"""Batched decoding: several requests in flight, their forwards run as one batched forward.

A `BatchRuntime` holds `slots` sequences. Each slot is an ordinary `EagleRuntime` (its own
`Decoder`, drafter, stop strings, sampling RNG and stats) whose target and draft backends are
`SlotBackend`s: a slot's forward is handed to the batch runtime, which waits until every busy slot
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
once: docs/decisions.md, 'chunked prefill in the Decoder, and the attention kernels
measured'; EagleRuntime's Decoder chunks the same way). Each
chunk's rows are computed as the same rows of the whole prefill are (tests/runtime/test_batch.py: tokens, logits and KV
bit-identical); the request's outputs are its chunks' joined. An EAGLE-3 draft's first
extension (tapped and own features mixed) always runs whole.

Trees under load: by default each round a slot drafts the smaller tree `tree_under_load`
gives for the number of busy slots (runtime/batch_limits.py). Output does not depend on the
tree; `shrink_trees=False` keeps the configured tree (then a seed gives the same tokens batched
as alone).

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

Prefill graph (an export's `prefill.onnx`, RuntimeOptions.prefill_graph): every target forward
flagged `StepInputs.prefill` (a prompt, whole or a chunk, and an answer being settled) runs on
it, on the slot's own rows of the target's KV buffer, as EagleRuntime's Decoder runs them, so a
request gets the same tokens batched as from eagle-run; those forwards always run alone.

Prefix cache (`prefix_cache_mb`, runtime/prefix_cache.py): one cache for all slots, so a
conversation's next turn reuses its KV on whichever slot it lands. A hit's rows are copied into
the slot's block by the slot's thread before its first forward, while no forward runs (every
busy slot must hand one in first); a request is settled inside its busy() block, and on exit
what was not is dropped (the slot's rows are released).

What it needs (the fused graphs, onnxruntime CPU, row-independent rounding) and how KV is
sized ([slots, kv_heads, capacity + margin, head_dim] per graph, allocated once):
runtime/batch_limits.py. A forward that would not fit runs alone.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import fields
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from eagle_deploy.contract.manifest import Manifest
from eagle_deploy.contract.onnx_io import rows_written
from eagle_deploy.contract.verify import verify_export

from .api import EagleRuntime, load_tokenizer, row_exact_default
from .backends import load_backend
from .backends.base import StepInputs, StepOutputs
from .batch_limits import BatchError, check_batchable, check_kv_fits, margin_rows, tree_under_load
from .batch_rows import _PER_LOGIT, _Call, _copied, _join_chunks, _pad, _rows
from .costs import device_costs
from .decode import RoundObserver, chunk_end
from .drafter import Drafter, EagleDrafter
from .hybrid import LOOKUP_ROWS, make_drafter, uses_draft_graph
from .kv import KVBuffer
from .options import RuntimeOptions
from .prefix_cache import PrefixCache
from .request import Prompt
from .row_exact import matmuls_row_exact, step_rows


class _LoadTrees:
    """Slot drafter wrapper: each round drafts `tree_under_load` of the slots busy right now."""

    def __init__(self, inner: EagleDrafter, runtime: "BatchRuntime"):
        self.inner, self.runtime, self.base = inner, runtime, inner.tree

    @property
    def forwards(self) -> int:
        return self.inner.forwards

    def reset(self) -> None:
        self.inner.reset()

    def propose(self, request):
        self.inner.tree = tree_under_load(self.base, self.runtime.busy_slots)
        return self.inner.propose(request)

    def __getattr__(self, name: str):  # the EAGLE drafter's other attributes (backend, kv, length)
        return getattr(self.inner, name)


class SlotBackend:
    """Slot `slot`'s view of graph `role` in a BatchRuntime (a `Backend`): `allocate_kv` returns
    the slot's block of the batch runtime's buffer, `run` hands the forward to the batch runtime and
    returns this slot's rows of the batched result (batch 1, as a solo forward would)."""

    def __init__(self, runtime: "BatchRuntime", role: str, slot: int):
        self.runtime, self.role, self.slot = runtime, role, slot
        inner = runtime.backends[role]
        self.name = f"{inner.name}-batched"
        self.kv_names = inner.kv_names

    def allocate_kv(self, capacity: int) -> KVBuffer:
        return self.runtime.slot_kv(self.role, self.slot, capacity)

    def run(self, inputs: StepInputs, kv: KVBuffer, past: int) -> StepOutputs:
        return self.runtime.forward(_Call(self.slot, self.role, inputs, past))


class BatchRuntime:
    """`slots` EagleRuntimes over one pair of backends, their forwards batched (module doc).

    runtimes[b]: slot b's runtime; drive each from its own thread inside `busy(b)`:

        batch = BatchRuntime.load("engines/smollm2-135m", slots=4)
        results = batch.generate_many(["Hi", "Write a haiku", ...], max_new_tokens=64)

    Counters: batched_forwards (forwards of two or more slots), solo_forwards (of one slot).
    """

    def __init__(self, folder: Path, manifest: Manifest, backends: dict, tokenizer, slots: int,
                 options: RuntimeOptions | None = None,
                 round_observers: Callable[[int], Sequence[RoundObserver]] | None = None,
                 drafters: Callable[[int, EagleDrafter], Drafter] | None = None, shrink_trees: bool = True):
        """backends: {"target": Backend, "draft": Backend} (batch-capable, see check_batchable),
        and "prefill": the export's prefill graph, which then runs every prefill forward (each
        alone, on its slot's target KV: module doc, "Prefill graph");
        options: how every slot decodes (RuntimeOptions: the drafter kind and planning as for
        EagleRuntime, the slots sharing one CostModel; its tree None: the manifest's; its
        prefill_chunk: a prompt of prefill_chunk + 2 tokens or more is prefilled in chunks of
        that size, one chunk per forward of the other slots while they decode, back to back
        while none does (module doc, "Chunked prefill"); 0: in one forward).
        round_observers(b): slot b's round observers (see Decoder); drafters(b, drafter): the
        drafter slot b uses, given its EAGLE drafter over the batched draft graph (tests wrap
        it to force trees); shrink_trees: draft `tree_under_load` of the busy slots each round
        (False: the tree always, so a seed gives the same tokens batched as alone).
        Raises BatchError."""
        options = RuntimeOptions.of(options)
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
        self._held = {role: [0] * slots for role in ("target", "draft")}  # rows each slot still holds, per graph
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
    def load(cls, folder, slots: int, options: RuntimeOptions | None = None, *,
             round_observers: Callable[[int], Sequence[RoundObserver]] | None = None,
             drafters: Callable[[int, EagleDrafter], Drafter] | None = None, shrink_trees: bool = True,
             **changes) -> "BatchRuntime":
        """Load `folder` once for `slots` sequences, decoded as `options` say with `changes`
        on top (as for EagleRuntime.load; the other arguments as for __init__). Raises
        BatchError (check_batchable, check_kv_fits: before any graph is opened), and what
        EagleRuntime.load raises."""
        options = RuntimeOptions.of(options, **changes)
        folder = Path(folder)
        manifest = Manifest.load(folder)
        verify_export(folder, manifest, options.verify)  # as for EagleRuntime.load
        check_batchable(manifest, slots, options.backend)
        tree = (options.tree or manifest.tree).validate(manifest.draft.graph_top_k)
        options = options.replace(tree=tree)
        check_kv_fits(manifest, tree, slots, row_exact_default(manifest) if options.row_exact is None
                      else options.row_exact)
        graphs = ("target", "draft") + (("prefill",) if options.uses_prefill_graph(manifest) else ())
        backends = {which: load_backend(options.backend, folder, manifest, which, options.threads, tree=tree)
                    for which in graphs}
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
        """Bytes of every KV buffer the batch runtime holds (all slots, both graphs)."""
        return sum(buf.nbytes for buf in self._buffers.values())

    # -- slots ---------------------------------------------------------------------------------

    @property
    def busy_slots(self) -> int:
        """Slots decoding a request now."""
        return len(self._busy)

    @contextmanager
    def busy(self, slot: int) -> Iterator[EagleRuntime]:
        """Mark `slot` busy while its thread decodes a request with the yielded runtime; the
        batch runtime waits for a forward from every busy slot before it runs a batch, so a busy slot
        must be driven without pause. On exit the slot's rows are released (and a request
        not settled into the prefix cache by then is dropped: module doc)."""
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.slots:
            raise IndexError(f"slot {slot!r}: this batch runtime has slots 0 .. {self.slots - 1}")
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
                raise RuntimeError(f"slot {call.slot} ran a forward outside BatchRuntime.busy()")
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
        role = "prefill" if call.role == "target" and call.inputs.prefill and "prefill" in self.backends else call.role
        call.result = self.backends[role].run(call.inputs, kv, call.past)
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
                      return_exceptions: bool = False, on_done: Callable[[int], None] | None = None,
                      **kw) -> list:
        """Generate every prompt, up to `slots` at a time, each slot driven by its own thread;
        results (GenerationResult) in prompt order. kw: EagleRuntime.generate's keywords for
        all requests, per_request[i]: more for request i. on_done(i): called as request i ends
        (raised or not), one call at a time (a progress bar's update). A request that raises
        fails alone: its exception is returned in its place with return_exceptions, else the
        first one is raised after every request has ended."""
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
                if on_done is not None:
                    with lock:
                        on_done(i)

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


__all__ = ["BatchRuntime", "BatchError", "SlotBackend"]
