"""Batched decoding (runtime.batch.BatchRuntime): several requests share each target and draft
forward, and every request gets exactly what it gets alone.

Levels: bit-identical logits rows and KV against solo runs (row-exact decoding, NaN-poisoned
neighbouring slots); greedy token identity with forced multi-token acceptance on every tiny
export kind and on an int4 export; sampling with a seed; continuous batching with more
requests than slots; one request's failure or over-long prompt failing alone; the exports and
settings it refuses."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from eagle_deploy.contract.manifest import Manifest
from eagle_deploy.contract.profiles import draft_kv_capacity
from eagle_deploy.contract.tree_config import TreeConfig
from eagle_deploy.runtime.api import EagleRuntime
from eagle_deploy.runtime.batch import BatchRuntime
from eagle_deploy.runtime.batch_limits import (
    BatchError,
    check_batchable,
    check_kv_fits,
    kv_bytes_per_slot,
    margin_rows,
    tree_under_load,
)
from eagle_deploy.runtime.drafter import EagleDrafter
from tests.conftest import HEAD_TREE, PROMPTS, THREADS
from tests.helpers import ForcingDrafter, clone_runtime_export, wrong_token

N = 40
MORE = PROMPTS + [[40, 41, 42], [9, 200, 31, 7, 7, 12, 90, 3, 4, 5, 6, 7, 8, 9, 10, 11], [250],
                  [17, 18, 19, 20, 21, 22]]


def reference_script(refs: dict[tuple, list[int]]):
    """Trees for ForcingDrafter: for a request still on its reference, the next 4 reference
    tokens, a branch that leaves it after one token and a wrong first token (so rounds accept
    0-4 tokens and compaction moves rows); nothing otherwise."""
    def script(committed):
        for prompt, ref in refs.items():
            n = len(prompt)
            if tuple(committed[:n]) == prompt and list(committed[n:]) == ref[:len(committed) - n]:
                good = ref[len(committed) - n:][:4]
                if not good:
                    return []
                return [good, good[:1] + [wrong_token(*good[1:2])], [wrong_token(good[0])]]
        return []
    return script


def forced(model, prompts, n=N):
    """drafters= factory for BatchRuntime, and the script (shared with solo runs)."""
    script = reference_script({tuple(p): model.expected(p, n) for p in prompts})
    return (lambda slot, inner: ForcingDrafter(inner, script)), script


def solo_runtime(model, script=None, **kw) -> EagleRuntime:
    m = model.manifest
    drafter = None
    if script is not None:
        drafter = ForcingDrafter(EagleDrafter.for_export(model.backend("draft"), m.tree, m), script)
    return model.runtime(drafter=drafter, **kw)


def engine(model, slots: int, **kw) -> BatchRuntime:
    return BatchRuntime.load(model.export_dir, slots, **{**HEAD_TREE, "threads": THREADS, **kw})


def run_pinned(eng: BatchRuntime, jobs: dict[int, tuple], kv: dict | None = None, **kw) -> dict:
    """{slot: (prompt, extra kw)} run at once, each in its own slot's thread -> {slot: result}.
    kv: filled with {slot: copies of the slot's target KV arrays} taken as its request ends,
    while the slot still holds them (a released slot's rows are free for padding)."""
    results = {}

    def one(slot, prompt, extra):
        try:
            with eng.busy(slot) as rt:
                results[slot] = rt.generate(prompt, **{**kw, **extra})
                if kv is not None:
                    kv[slot] = [a.copy() for a in rt.decoder.kv.arrays]
        except Exception as err:  # checked by the caller
            results[slot] = err

    threads = [threading.Thread(target=one, args=(b, p, x)) for b, (p, x) in jobs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


class LogitsLog:
    """Round observer keeping a copy of every verification round's logits."""

    def __init__(self):
        self.rows: list[np.ndarray] = []

    def __call__(self, tree, logits, verification) -> None:
        self.rows.append(np.array(logits, copy=True))


def test_batched_rows_are_bit_identical_to_solo_and_isolated(model):
    """Row-exact decoding, 4 slots with requests pinned to slots 0, 1 and 2 and slot 3 idle; every
    KV row of both graphs NaN before the run. Each request's logits (every round), tokens and
    committed KV rows equal its solo run's bit for bit, nothing NaN leaks in, and the idle slot
    (outside every batched forward) is never written."""
    prompts = {0: PROMPTS[0], 1: PROMPTS[1], 2: PROMPTS[2]}
    factory, script = forced(model, prompts.values())
    logs = [LogitsLog() for _ in range(4)]
    eng = engine(model, 4, row_exact=True, drafters=factory, round_observers=lambda b: [logs[b]])
    for buf in eng.buffers.values():
        for a in buf.arrays:
            a[...] = np.nan
    kv = {}
    got = run_pinned(eng, {b: (p, {}) for b, p in prompts.items()}, kv, max_new_tokens=N)
    assert eng.batched_forwards > 0
    for b, prompt in prompts.items():
        solo_log = LogitsLog()
        solo = solo_runtime(model, script, row_exact=True, round_observers=[solo_log])
        want = solo.generate(prompt, max_new_tokens=N)
        assert got[b].token_ids == want.token_ids == model.expected(prompt, N)
        assert got[b].stats.mean_accept_len > 1.5  # multi-token rounds: compaction really ran
        assert len(logs[b].rows) == len(solo_log.rows)
        for mine, theirs in zip(logs[b].rows, solo_log.rows):
            assert np.isfinite(mine).all()
            assert np.array_equal(mine, theirs)
        committed = len(prompt) + len(want.token_ids) - 1  # the last token is not in the KV yet
        for mine, theirs in zip(kv[b], solo.decoder.kv.arrays):
            assert np.array_equal(mine[:, :, :committed], theirs[:, :, :committed])
    for buf in eng.buffers.values():
        assert all(np.isnan(a[3]).all() for a in buf.arrays)


@pytest.mark.parametrize("mode", ["eagle", "vanilla"])
def test_continuous_batching_greedy_equals_reference(model, mode):
    """8 requests with different lengths through 3 slots: every output is the greedy reference;
    KV is allocated once (same buffers, same bytes) however requests come and go."""
    factory, _ = forced(model, MORE)
    eng = engine(model, 3, drafters=factory)
    buffers = {k: [id(a) for a in v.arrays] for k, v in eng.buffers.items()}
    nbytes = eng.kv_bytes
    lengths = [N - 3 * i for i in range(len(MORE))]
    results = eng.generate_many(MORE, per_request=[{"max_new_tokens": n} for n in lengths], mode=mode)
    for prompt, n, r in zip(MORE, lengths, results):
        assert r.token_ids == model.expected(prompt, n)
        assert r.stats.mode == mode
    assert eng.batched_forwards > 0 and eng.solo_forwards >= len(MORE)  # every prefill alone, the rest batched
    assert {k: [id(a) for a in v.arrays] for k, v in eng.buffers.items()} == buffers and eng.kv_bytes == nbytes


def test_own_head_batched_equals_reference(gqa):
    """No forcing: the export's own (random) head drafts batched; output is still the reference."""
    results = engine(gqa, 3).generate_many(MORE, max_new_tokens=N)
    assert [r.token_ids for r in results] == [gqa.expected(p, N) for p in MORE]


def test_sampling_with_a_seed_matches_solo(gqa):
    """Sampled requests (T 0.9, top_p 0.95, a seed each): the same tokens batched as alone (at
    the configured tree: shrink_trees=False)."""
    per = [{"seed": 100 + i} for i in range(len(MORE))]
    kw = dict(max_new_tokens=N, temperature=0.9, top_p=0.95)
    batched = engine(gqa, 3, row_exact=True, shrink_trees=False).generate_many(MORE, per_request=per, **kw)
    solo = gqa.runtime(row_exact=True)
    for prompt, extra, r in zip(MORE, per, batched):
        assert r.token_ids == solo.generate(prompt, **kw, **extra).token_ids


@pytest.mark.parametrize("kind,mode", [("int4", "eagle"), ("int8", "eagle"), ("int8", "vanilla")])
def test_quantised_export_batched_equals_solo(quant_exports, kind, mode):
    """A quantised export (row-exact by default; its target graph repeats one-row queries, so
    batched vanilla steps are one-token rows each repeated at its own past): each request's
    greedy output batched equals its output alone."""
    folder = quant_exports[kind]
    eng = BatchRuntime.load(folder, 3, threads=THREADS)
    solo = EagleRuntime.load(folder, threads=THREADS)
    results = eng.generate_many(MORE, max_new_tokens=N, mode=mode)
    assert [r.token_ids for r in results] == [solo.generate(p, max_new_tokens=N, mode=mode).token_ids for p in MORE]
    assert eng.batched_forwards > 0


def test_a_failing_request_fails_alone(gqa):
    """One slot's request raises at its second round and another's prompt is over the export's
    capacity: both fail with their own error, the others complete with their reference output,
    and the failed slot serves its next request correctly."""
    class Boom:
        def __init__(self):
            self.armed, self.rounds = True, 0

        def __call__(self, tree, logits, verification):
            self.rounds += 1
            if self.armed and self.rounds == 2:
                raise RuntimeError("injected fault")

    boom = Boom()
    eng = engine(gqa, 3, round_observers=lambda b: [boom] if b == 1 else [])
    too_long = [3 + i % 200 for i in range(gqa.manifest.max_length)]
    got = run_pinned(eng, {0: (PROMPTS[0], {}), 1: (PROMPTS[1], {}), 2: (too_long, {})}, max_new_tokens=N)
    assert got[0].token_ids == gqa.expected(PROMPTS[0], N)
    assert isinstance(got[1], RuntimeError) and "injected fault" in str(got[1])
    assert isinstance(got[2], ValueError) and "prompt has" in str(got[2]) and "shorten the prompt" in str(got[2])
    boom.armed = False
    again = run_pinned(eng, {1: (PROMPTS[2], {}), 0: (PROMPTS[1], {})}, max_new_tokens=N)
    assert again[1].token_ids == gqa.expected(PROMPTS[2], N)
    assert again[0].token_ids == gqa.expected(PROMPTS[1], N)
    done: list[int] = []
    results = eng.generate_many([PROMPTS[0], too_long], return_exceptions=True, max_new_tokens=8,
                                on_done=done.append)
    assert results[0].token_ids == gqa.expected(PROMPTS[0], 8) and isinstance(results[1], ValueError)
    assert sorted(done) == [0, 1]  # the failed request is reported done too (a progress bar reaches its end)


def test_misuse_of_slots_is_refused(gqa):
    """A forward outside busy(), a slot busy twice, a slot number out of range, and a stream
    resumed in a later busy() session (its rows were released meanwhile) all raise."""
    eng = engine(gqa, 2)
    with pytest.raises(RuntimeError, match="outside BatchRuntime.busy"):
        eng.runtimes[0].generate(PROMPTS[0], max_new_tokens=4)
    with eng.busy(0):
        with pytest.raises(RuntimeError, match="already busy"):
            with eng.busy(0):
                pass
    for bad in (2, -1, True):
        with pytest.raises(IndexError, match="slots 0 .. 1"):
            with eng.busy(bad):
                pass
    with eng.busy(1) as rt:
        stream = rt.stream(PROMPTS[1], max_new_tokens=20)
        next(stream)  # the prefill ran in this session
    assert eng.busy_slots == 0
    eng.generate_many([PROMPTS[0]], max_new_tokens=8)  # someone else uses the engine meanwhile
    with eng.busy(1):
        with pytest.raises(RuntimeError, match="earlier busy\\(\\) session"):
            list(stream)
    assert eng.generate_many([PROMPTS[2]], max_new_tokens=N)[0].token_ids == gqa.expected(PROMPTS[2], N)


def test_forwards_too_wide_for_the_buffer_run_one_by_one(gqa):
    """A tree wider than the engine's margin rows next to a long prompt: the batched
    verification does not fit, so the group runs one forward at a time; each slot still gets
    its own outputs (they are copied before the next forward reuses the backend's arrays)."""
    m = gqa.manifest
    wide = TreeConfig("dynamic", total_tokens=40, depth=2, top_k=min(4, m.draft.graph_top_k))  # up to 21 nodes
    assert draft_kv_capacity(m.max_length, wide) <= draft_kv_capacity(m.max_length, m.tree)
    assert 1 + wide.top_k + wide.top_k ** 2 > margin_rows(m.tree, True)  # its verification overflows the margin
    eng = engine(gqa, 2, shrink_trees=False)
    for rt in eng.runtimes:
        rt.set_tree(wide)
    long_prompt = [(7 * i) % 250 + 3 for i in range(m.max_length - 20)]
    jobs = {0: (long_prompt, {}), 1: (PROMPTS[0], {})}
    got = run_pinned(eng, jobs, max_new_tokens=16)
    solo = gqa.runtime(tree=wide)
    for b, (prompt, _) in jobs.items():
        assert got[b].token_ids == solo.generate(prompt, max_new_tokens=16).token_ids
    assert eng.solo_forwards > 4  # more than the prefills and first extensions ran alone


def test_a_failing_forward_fails_only_its_request(gqa):
    """Slot 1's drafter proposes a token id outside the vocabulary from its third round: the
    batched verification fails, each forward is retried alone, and only slot 1's request fails."""
    from eagle_deploy.runtime.tree import DraftTree

    class BadTree:
        def __init__(self, inner):
            self.inner, self.rounds = inner, 0

        @property
        def forwards(self):
            return self.inner.forwards

        def reset(self):
            self.inner.reset()

        def propose(self, request):
            tree = self.inner.propose(request)
            self.rounds += 1
            return DraftTree.from_paths(int(request.committed[-1]), [[10**6]]) if self.rounds >= 3 else tree

    eng = engine(gqa, 3, drafters=lambda b, d: BadTree(d) if b == 1 else d)
    got = run_pinned(eng, {b: (PROMPTS[b], {}) for b in range(3)}, max_new_tokens=N)
    assert isinstance(got[1], Exception)
    assert got[0].token_ids == gqa.expected(PROMPTS[0], N) and got[2].token_ids == gqa.expected(PROMPTS[2], N)


def test_refused_exports_and_settings(gqa, gqa_standard, quant_exports, tmp_path):
    m = gqa.manifest
    check_batchable(m, 4, "ort")
    check_batchable(gqa_standard.manifest, 1, "trt")  # one slot: anything goes
    for slots in (0, -1, True, 2.0):
        with pytest.raises(BatchError, match="slots must be"):
            check_batchable(m, slots, "ort")
    with pytest.raises(BatchError, match="onnxruntime CPU backend only"):
        check_batchable(m, 2, "trt")
    with pytest.raises(BatchError, match="needs the fused graph"):
        check_batchable(gqa_standard.manifest, 2, "ort")
    int8 = Manifest.load(quant_exports["int8"])
    check_batchable(int8, 2, "ort")  # the default int8 and int4 (MatMulNBits) graphs have independent rows
    check_batchable(Manifest.load(quant_exports["int4"]), 2, "ort")
    dynamic = int8.replace(target=int8.target.replace(quant_info=int8.target.quant_info.replace(method="dynamic")))
    with pytest.raises(BatchError, match="dynamic int8 quantisation"):
        check_batchable(dynamic, 2, "ort")
    old = clone_runtime_export(gqa.export_dir, tmp_path / "old")
    manifest = (old / "manifest.json").read_text().replace('"ragged_batch": true', '"ragged_batch": false')
    (old / "manifest.json").write_text(manifest)
    with pytest.raises(BatchError, match="predates batched decoding"):
        BatchRuntime.load(old, 2, threads=THREADS)


def test_tree_under_load():
    base = TreeConfig("dynamic", total_tokens=8, depth=4, top_k=2)
    got = {busy: tree_under_load(base, busy) for busy in (1, 2, 3, 4, 8, 16)}
    assert got[1] == got[2] == base
    assert [(t.total_tokens, t.depth, t.top_k) for t in (got[3], got[4], got[8], got[16])] == [
        (5, 2, 2), (4, 2, 2), (2, 1, 1), (2, 1, 1)]
    for tree in (TreeConfig.static("eagle1"), TreeConfig("dynamic", total_tokens=2, depth=1, top_k=1)):
        assert tree_under_load(tree, 8) == tree


def test_trees_shrink_with_busy_slots(gqa):
    """Each round a slot drafts the tree for the slots busy then (4 busy: at most 8 of the
    configured 16 nodes); the output stays the reference."""
    base = TreeConfig("dynamic", total_tokens=16, depth=4, top_k=4)
    used = []

    class Record:
        def __init__(self, inner):
            self.inner, self.forwards = inner, 0

        def reset(self):
            self.inner.reset()

        def propose(self, request):
            tree = self.inner.propose(request)
            used.append((self.inner.tree.total_tokens, tree.size))  # the tree this round drafted
            return tree

    eng = engine(gqa, 4, tree=base, drafters=lambda b, d: Record(d))
    lengths = [N, N // 2, N // 4, N // 8]  # the longest request ends alone
    results = eng.generate_many(MORE[:4], per_request=[{"max_new_tokens": n} for n in lengths])
    assert [r.token_ids for r in results] == [gqa.expected(p, n) for p, n in zip(MORE[:4], lengths)]
    assert all(size <= total for total, size in used)
    assert {total for total, _ in used} >= {8, 16}  # 4 busy: 8 nodes; alone at the end: the configured 16


def test_kv_per_slot_is_what_the_engine_allocates_and_too_many_slots_are_refused(gqa):
    m = gqa.manifest
    eng = engine(gqa, 3)
    assert eng.kv_bytes == 3 * kv_bytes_per_slot(m, m.tree, row_exact=False)
    per_slot_mib = kv_bytes_per_slot(m, m.tree, row_exact=False) / 2**20
    check_kv_fits(m, m.tree, 8, False, available_mib=8 * per_slot_mib / 0.8 + 1)
    with pytest.raises(BatchError, match="at most 7 slots fit"):
        check_kv_fits(m, m.tree, 8, False, available_mib=7.5 * per_slot_mib / 0.8)


def test_backends_without_batched_forwards_refuse_a_batch(gqa):
    """StepInputs take a batch now; the PyTorch reference (like TensorRT and ort-cuda) runs one
    sequence per forward and says so instead of mis-writing its KV."""
    from eagle_deploy.runtime.backends.base import StepInputs
    from eagle_deploy.validate.torch_backend import TorchBackend

    ref = TorchBackend.draft(gqa.head(), top_k=gqa.manifest.draft.graph_top_k)
    kv = ref.allocate_kv(8)
    two = StepInputs(np.array([[5], [6]]), np.zeros((2, 1), np.int64), np.ones((2, 1, 1), bool),
                     np.zeros((2, 1), np.int64), np.zeros((2, 1, gqa.manifest.dims.hidden), np.float32))
    with pytest.raises(ValueError, match="one sequence per forward"):
        ref.run(two, kv, 0)


LONG = [(7 * i + 3) % 250 + 1 for i in range(61)]  # 61 tokens, no EOS


def test_a_long_prefill_runs_in_chunks_between_other_slots_forwards(model):
    """Chunked prefill (prefill_chunk 8): a 61-token prompt arriving while slot 1 decodes is
    prefilled in chunks, each between two of slot 1's forwards; both requests' tokens, every
    round's logits and the committed KV rows equal their solo runs bit for bit (row-exact), and
    no chunk is a single row."""
    decoding, arrived = threading.Event(), threading.Event()
    logs = [LogitsLog() for _ in range(2)]
    factory, script = forced(model, [LONG, PROMPTS[1]])

    def slot1_round(*_):  # slot 1 decodes its next round only once slot 0 is busy, however loaded the machine
        decoding.set()
        assert arrived.wait(60)

    eng = engine(model, 2, row_exact=True, drafters=factory, prefill_chunk=8,
                 round_observers=lambda b: [logs[b]] + ([slot1_round] if b == 1 else []))
    events = []
    run_chunk, run_group = eng._run_chunk, eng._run_group

    def chunk(call):
        before = call.rows_done
        run_chunk(call)
        events.append(("chunk", call.role, before, call.rows_done))

    def group(calls):
        events.append(("group",))
        run_group(calls)

    eng._run_chunk, eng._run_group = chunk, group
    results, kv = {}, {}

    def one(slot, prompt):
        if slot == 0:
            assert decoding.wait(60)
        with eng.busy(slot) as rt:
            if slot == 0:
                arrived.set()
            results[slot] = rt.generate(prompt, max_new_tokens=N)
            kv[slot] = [a.copy() for a in rt.decoder.kv.arrays]

    threads = [threading.Thread(target=one, args=(b, p)) for b, p in ((1, PROMPTS[1]), (0, LONG))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    target = [e for e in events if e[0] == "chunk" and e[1] == "target"]
    assert len(target) >= 3 and eng.prefill_chunks >= 3
    assert [e[2] for e in target] == [0] + [e[3] for e in target[:-1]] and target[-1][3] == len(LONG)
    assert all(e[3] - e[2] >= 2 for e in target)  # never a one-row chunk
    assert all(e[3] - e[2] == 8 for e in target[:-1])
    between = [events[events.index(a) + 1:events.index(b)] for a, b in zip(target, target[1:])]
    assert all(("group",) in gap for gap in between[:2])  # slot 1 decoded between the chunks
    for b, prompt in ((0, LONG), (1, PROMPTS[1])):
        solo_log = LogitsLog()
        solo = solo_runtime(model, script, row_exact=True, round_observers=[solo_log])
        want = solo.generate(prompt, max_new_tokens=N)
        assert results[b].token_ids == want.token_ids == model.expected(prompt, N)
        assert len(logs[b].rows) == len(solo_log.rows)
        assert all(np.array_equal(m, t) for m, t in zip(logs[b].rows, solo_log.rows))
        committed = len(prompt) + len(want.token_ids) - 1
        for mine, theirs in zip(kv[b], solo.decoder.kv.arrays):
            assert np.array_equal(mine[:, :, :committed], theirs[:, :, :committed])


def test_a_long_prefill_alone_runs_in_chunks_back_to_back(model):
    """With no other slot decoding, a 61-token prompt is still prefilled in chunks of 8 (the
    last 2 to 9 rows), one after the other; tokens, every round's logits and the committed KV
    rows equal the solo runtime's unchunked run bit for bit (row-exact)."""
    log = LogitsLog()
    factory, script = forced(model, [LONG])
    eng = engine(model, 2, row_exact=True, drafters=factory, prefill_chunk=8, round_observers=lambda b: [log])
    sizes, run_chunk = [], eng._run_chunk

    def chunk(call):
        before = call.rows_done
        run_chunk(call)
        if call.role == "target":
            sizes.append(call.rows_done - before)

    eng._run_chunk = chunk
    kv = {}
    got = run_pinned(eng, {0: (LONG, {})}, kv, max_new_tokens=N)[0]
    assert sizes == [8] * 7 + [5] and eng.prefill_chunks >= 8  # 61 rows: chunk_end's last chunk 2 to 9 rows
    solo_log = LogitsLog()
    solo = solo_runtime(model, script, row_exact=True, round_observers=[solo_log], prefill_chunk=0)
    want = solo.generate(LONG, max_new_tokens=N)
    assert got.token_ids == want.token_ids == model.expected(LONG, N)
    assert len(log.rows) == len(solo_log.rows) and all(np.array_equal(m, t) for m, t in zip(log.rows, solo_log.rows))
    committed = len(LONG) + len(want.token_ids) - 1
    for mine, theirs in zip(kv[0], solo.decoder.kv.arrays):
        assert np.array_equal(mine[:, :, :committed], theirs[:, :, :committed])


def test_prefill_chunk_must_be_a_whole_number(gqa):
    from eagle_deploy.contract.errors import SettingError
    from eagle_deploy.runtime.decode import PREFILL_CHUNK

    for bad in (-1, 2.5, True):
        with pytest.raises(SettingError, match="prefill_chunk must be an integer >= 0") as err:
            engine(gqa, 2, prefill_chunk=bad)
        assert err.value.field == "prefill_chunk"
    eng = engine(gqa, 2)  # the runtime's default chunk (RuntimeOptions): a 61-token prompt is one forward
    assert eng.prefill_chunk == PREFILL_CHUNK > len(LONG) + 1
    eng.generate_many([LONG, PROMPTS[0]], max_new_tokens=8)
    assert eng.prefill_chunks == 0


def test_a_short_prompt_is_prefilled_before_a_long_ones_next_chunk(gqa):
    """The scheduling rule alone (no forwards run): with a chunked prefill under way, a waiting
    prompt of one chunk or less goes first (shortest remaining prefill first); after each
    prefill forward the decoding slots get the next one."""
    from eagle_deploy.runtime.backends.base import StepInputs
    from eagle_deploy.runtime.batch_rows import _Call

    eng = engine(gqa, 3, prefill_chunk=8)

    def call(slot, n, past):
        ids = np.ones((1, n), np.int64)
        return _Call(slot, "target", StepInputs(ids, ids, np.ones((1, n, past + n), bool), ids[:, -1:]), past)

    long, decode, short = call(0, 40, 0), call(1, 3, 20), call(2, 5, 0)
    long.rows_done = 8
    ran = []
    eng._run_group = lambda group: ran.append(("group", [c.slot for c in group]))
    eng._run_chunk = lambda c: ran.append(("chunk", c.slot))
    eng._busy, eng._pending = {0, 1, 2}, {0: long, 1: decode, 2: short}
    with eng._cond:  # _step runs with the engine's lock held
        eng._step()
        assert ran == [("group", [2])]  # the short prompt first, whole
        del eng._pending[2]
        eng._step()  # the decoding slot's turn after a prefill ...
        eng._step()  # ... then the long prefill's next chunk
    assert ran[1:] == [("group", [1]), ("chunk", 0)]


@pytest.mark.parametrize("seq,chunks", [(130, [128, 2]), (200, [128, 72]), (300, [128, 128, 44]),
                                        (257, [128, 129]), (258, [128, 128, 2])])
def test_chunk_sizes_are_the_setting_and_the_last_two_rows_or_more(seq, chunks):
    """prefill_chunk 128: every chunk is 128 rows but the last, which holds 2 to 129 rows."""
    from eagle_deploy.runtime.decode import chunk_end

    sizes, a = [], 0
    while a < seq:
        b = chunk_end(a, seq, 128)
        sizes.append(b - a)
        a = b
    assert sizes == chunks
