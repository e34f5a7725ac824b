"""KVBuffer: compaction of a scattered accepted path, capacity checks, NaN poisoning; after
every round the target KV equals a fresh prefill of the committed tokens; KV buffer reuse
across tree sizes: one buffer, prefilled from an empty past and reused for trees of every
size, equals fresh exactly-sized buffers bitwise."""
from __future__ import annotations

import numpy as np
import pytest

from eagle_deploy.contract import onnx_io as c
from eagle_deploy.runtime.kv import CapacityError, KVBuffer
from eagle_deploy.runtime.tree import DraftTree
from tests.conftest import PROMPTS
from tests.helpers import (
    CommitSpy,
    RecordingBackend,
    ReferenceScript,
    ScriptedDrafter,
    assert_kv_close,
    kv_rows,
    poison,
    prefill,
    run_tree,
    wrong_token,
)


def _numbered(capacity=16, layers=2):
    """A buffer whose row r holds the value r (per array a: r + 1000 * a)."""
    names = c.kv_names(layers)
    arrays = [np.broadcast_to((np.arange(capacity) + 1000 * i)[:, None, None, None],
                              (capacity, 1, 2, 3)).astype(np.float32).copy()
              for i in range(len(names))]
    return KVBuffer(names, arrays)


def test_compact_moves_a_scattered_path_into_place():
    kv = _numbered()
    before = [a.copy() for a in kv.arrays]
    kv.compact(5, [0, 2, 5, 7])
    for i, (a, b) in enumerate(zip(kv.arrays, before)):
        np.testing.assert_array_equal(a[:5], b[:5])  # rows before start untouched
        np.testing.assert_array_equal(a[5:9, 0, 0, 0], np.array([5, 7, 10, 12]) + 1000 * i)
        np.testing.assert_array_equal(a[9:], b[9:])  # only rows 5..8 are written


def test_shared_layout_rows_view_and_compaction_match_seq_major():
    """The fused graphs' layout [batch, kv_heads, capacity, head_dim]: rows() views it
    sequence-major (writes go through), and compaction moves the same rows as in the
    sequence-major layout."""
    seq = _numbered()
    shared = KVBuffer(seq.names, [np.ascontiguousarray(a.transpose(1, 2, 0, 3)) for a in seq.arrays], c.KV_SHARED)
    assert shared.capacity == seq.capacity == 16 and shared.arrays[0].shape == (1, 2, 16, 3)
    for i in range(len(seq.arrays)):
        np.testing.assert_array_equal(shared.rows(i), seq.arrays[i])
    for kv in (seq, shared):
        kv.compact(5, [0, 2, 5, 7])
    for i in range(len(seq.arrays)):
        np.testing.assert_array_equal(shared.rows(i), seq.arrays[i])
    poison(shared, 12)
    assert np.isnan(shared.arrays[1][:, :, 12:]).all() and not np.isnan(shared.arrays[1][:, :, :12]).any()
    assert KVBuffer.allocate(seq.names, 8, 1, 2, 3, np.float32, c.KV_SHARED).arrays[0].shape == (1, 2, 8, 3)
    with pytest.raises(ValueError, match="layout"):
        KVBuffer(seq.names, seq.arrays, "bnsh")


def test_compact_overlapping_moves_read_before_write():
    kv = _numbered()
    kv.compact(0, [0, 1, 3, 4, 6])  # row 3 -> 2, 4 -> 3 (its source 3 is also a destination), 6 -> 4
    np.testing.assert_array_equal(kv.arrays[0][:5, 0, 0, 0], [0, 1, 3, 4, 6])


def test_compact_identity_and_errors():
    kv = _numbered()
    before = kv.arrays[0].copy()
    kv.compact(3, [0, 1, 2])
    kv.compact(3, [])
    np.testing.assert_array_equal(kv.arrays[0], before)
    with pytest.raises(ValueError, match="increasing"):
        kv.compact(0, [0, 3, 2])
    with pytest.raises(CapacityError):
        kv.compact(10, [0, 6])  # source row 16 is past capacity 16
    np.testing.assert_array_equal(kv.arrays[0], before)


def test_check_and_poison():
    kv = _numbered()
    kv.check(10, 6)
    for past, seq in ((10, 7), (-1, 1), (16, 1)):
        with pytest.raises(CapacityError, match="capacity 16"):
            kv.check(past, seq)
    poison(kv, 12)
    assert np.all(np.isnan(kv.arrays[1][12:])) and not np.any(np.isnan(kv.arrays[1][:12]))


def test_backend_refuses_rows_past_capacity(mha):
    be = mha.backend()
    kv = be.allocate_kv(8)
    prefill(be, kv, [1, 2, 3, 4, 5, 6])
    with pytest.raises(CapacityError):
        prefill(be, kv, [7, 8, 9], past=6)


# ---------------------------------------------------------------- KV after each round


def _scattered(pos, ref):
    """Wrong siblings ranked first at each depth, so the accepted path's node indices are
    not contiguous (e.g. [0, 2, 5, 9])."""
    t = ref[pos:pos + 4]
    return [[wrong_token(t[0])] * 3, [t[0], wrong_token(t[1]), 7], t[:2] + [wrong_token(t[2])], t]


@pytest.mark.parametrize("kind", ["scripted-scattered", "eagle-dynamic", "eagle1"])
def test_target_kv_equals_fresh_prefill_after_every_round(model, kind):
    from eagle_deploy.contract.tree_config import TreeConfig

    prompt = PROMPTS[2]
    ref = model.ref(prompt, 48)
    if kind == "scripted-scattered":
        rt = model.runtime(drafter=ScriptedDrafter(ReferenceScript(prompt, ref, _scattered)))
    else:
        rt = model.runtime(tree=TreeConfig.static("eagle1") if kind == "eagle1" else None)
    spy = CommitSpy(rt.decoder)
    result = rt.generate(prompt, max_new_tokens=40)
    assert result.token_ids == model.expected(prompt, 40)
    if kind == "scripted-scattered":
        assert any(r.path != list(range(len(r.path))) for r in spy.rounds), "no scattered path was accepted"
        assert max(len(r.path) for r in spy.rounds) == 5
    be = model.backend()
    fresh = be.allocate_kv(model.manifest.max_length)
    prefill(be, fresh, spy.rounds[-1].committed[:-1])
    for r in spy.rounds:
        assert r.target_len == len(r.committed) - 1
        assert_kv_close(r.target_kv, kv_rows(fresh, r.target_len), what=f"round ending at {r.target_len}")


# ---------------------------------------------------------------- KV buffer reuse across tree sizes


def _random_tree(n: int, seed: int) -> DraftTree:
    rng = np.random.default_rng(seed)
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
    return DraftTree(rng.integers(1, 256, n), np.array(parents), -np.arange(n, dtype=np.float32))


def test_one_buffer_reused_across_tree_sizes_equals_fresh_buffers(model):
    prompt = PROMPTS[2] * 2
    P = len(prompt)
    reused_be = RecordingBackend(model.backend(), poison=True)
    reused = reused_be.allocate_kv(model.manifest.max_length)
    first = prefill(reused_be, reused, prompt)  # past 0 through the same IO-binding path
    assert reused_be.calls[0].past == 0
    for i, n in enumerate([60, 7, 33, 1, 60]):
        tree = _random_tree(n, seed=i)
        got = run_tree(reused_be, reused, tree, P)
        be = model.backend()
        fresh = be.allocate_kv(P + n)
        fresh_first = prefill(be, fresh, prompt)
        want = run_tree(be, fresh, tree, P)
        for name in (c.LOGITS, c.FEATURES):
            assert got[name].shape == want[name].shape == (1, n, want[name].shape[-1])
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"{name}, tree of {n}")
        for a, b in zip(kv_rows(reused, P + n), kv_rows(fresh, P + n)):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(first[c.LOGITS], fresh_first[c.LOGITS])


def test_one_backend_alternating_between_kv_buffers(model):
    """OrtBackend keeps a shared-layout buffer bound between calls: switching the buffer (as a
    second request would) rebinds it, and each buffer sees only its own rows."""
    be = model.backend()
    a, b = be.allocate_kv(32), be.allocate_kv(32)
    out_a = prefill(be, a, PROMPTS[0])
    out_b = prefill(be, b, PROMPTS[1])
    step_a = prefill(be, a, [42], past=len(PROMPTS[0]))
    step_b = prefill(be, b, [42], past=len(PROMPTS[1]))
    for prompt, first, step in ((PROMPTS[0], out_a, step_a), (PROMPTS[1], out_b, step_b)):
        fresh_be = model.backend()
        fresh = fresh_be.allocate_kv(32)
        np.testing.assert_array_equal(prefill(fresh_be, fresh, prompt)[c.LOGITS], first[c.LOGITS])
        np.testing.assert_array_equal(prefill(fresh_be, fresh, [42], past=len(prompt))[c.LOGITS], step[c.LOGITS])


def test_backend_rebinds_only_what_changed(model):
    """OrtBackend keeps its input and output bindings between forwards (inputs are copied into
    reused buffers): a vanilla decoding step after another rebinds only the attention mask (its
    width grows), a forward of another size rebinds the rest, and the outputs stay a fresh
    backend's bit for bit."""
    be = model.backend()
    kv = be.allocate_kv(64)
    prompt = PROMPTS[0]
    P = len(prompt)
    prefill(be, kv, prompt)
    real, calls = be._binding, []

    class Spy:  # the IOBinding, recording the names bound
        def __getattr__(self, name):
            return getattr(real, name)

        def bind_input(self, name, *args):
            calls.append(name)
            return real.bind_input(name, *args)

        def bind_output(self, name, *args):
            calls.append(name)
            return real.bind_output(name, *args)

    be._binding = Spy()
    outs = []
    for i, token in enumerate([42, 7, 99]):
        calls.clear()
        outs.append({k: v.copy() for k, v in prefill(be, kv, [token], past=P + i).items()})
        if i:
            assert calls == [c.ATTENTION_MASK]
    assert set(calls) == {c.ATTENTION_MASK}
    calls.clear()
    tree = run_tree(be, kv, _random_tree(5, seed=3), P + 3)
    assert {c.INPUT_IDS, c.POSITION_IDS, c.ATTENTION_MASK, c.LOGITS} <= set(calls)
    fresh_be = model.backend()
    fresh = fresh_be.allocate_kv(64)
    prefill(fresh_be, fresh, prompt)
    for i, token in enumerate([42, 7, 99]):
        np.testing.assert_array_equal(prefill(fresh_be, fresh, [token], past=P + i)[c.LOGITS], outs[i][c.LOGITS])
    want = run_tree(fresh_be, fresh, _random_tree(5, seed=3), P + 3)
    np.testing.assert_array_equal(tree[c.LOGITS], want[c.LOGITS])
