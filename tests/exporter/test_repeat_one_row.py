"""Target graphs that repeat one-row queries inside attention (exporter/fused.py and contract
onnx_io, "One-row queries"; manifest `target.extra.repeats_one_row`, the default for quantised
fused exports): a one-token forward runs one row through the matmuls and norms, and its logits,
features and KV are bit for bit what row 0 of the older graph's two-row forward gives (the
runtime's row-exact recipe before); every forward of two or more rows is unchanged.

The exports compared are one tiny target exported twice (tests/conftest.py quant_exports:
"int4" / "int8" repeat, "int4-two-row" / "int8-two-row" do not)."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from eagle_deploy.contract.manifest import Manifest
from eagle_deploy.runtime.backends.base import StepInputs
from eagle_deploy.runtime.backends.ort import OrtBackend
from eagle_deploy.runtime.kv import CapacityError
from eagle_deploy.runtime.row_exact import matmuls_row_exact, step_rows
from eagle_deploy.runtime.tree import DraftTree
from tests import tiny
from tests.conftest import MAX_LENGTH, THREADS
from tests.helpers import AVX512, causal_mask, kv_rows, prefill, run_step, run_tree

KINDS = ["int8", "int4"]
PROMPT = np.random.default_rng(11).integers(1, tiny.VOCAB, 40).tolist()
STEPS = 12
PER_GRAPH_NODES = 19  # _RepeatOneRow's nodes (exporter/fused.py)


@pytest.fixture(scope="module")
def exports(quant_exports) -> dict:
    return quant_exports


def _backend(folder) -> OrtBackend:
    m = Manifest.load(folder)
    return OrtBackend(folder, m.target, m.graph_dims("target"), threads=THREADS)


def _pair(exports, kind) -> tuple[OrtBackend, OrtBackend]:
    """(the graph that repeats one-row queries, the same export without it)."""
    return _backend(exports[kind]), _backend(exports[f"{kind}-two-row"])


def _same(a: dict, b: dict, rows: slice = slice(None)) -> None:
    assert np.array_equal(a["logits"], b["logits"])
    assert np.array_equal(a["features"], b["features"][:, rows])


def test_quantised_fused_exports_repeat_one_row_queries_and_no_other_graph_does(exports):
    for name, folder in exports.items():
        m = Manifest.load(folder)
        assert m.target.repeats_one_row is (name in KINDS), name
        assert m.draft.repeats_one_row is False
        extra = (folder / "manifest.json").read_text()
        assert ('"repeats_one_row": true' in extra) is (name in KINDS)  # False is left out of the JSON


@pytest.mark.parametrize("kind", KINDS)
def test_the_graph_adds_a_gather_and_a_slice_per_layer_and_a_few_nodes_per_graph(exports, kind):
    import onnx

    def ops(folder):
        model = onnx.load(str(folder / "target.onnx"), load_external_data=False)
        return Counter(n.op_type for n in model.graph.node if n.op_type != "Constant")

    new, old = ops(exports[kind]), ops(exports[f"{kind}-two-row"])
    layers = Manifest.load(exports[kind]).dims.num_layers
    added = new - old
    assert not old - new
    assert added["Gather"] == layers and added["Slice"] == layers + 2  # per layer, and two in _RepeatOneRow
    assert sum(added.values()) == 2 * layers + PER_GRAPH_NODES


@pytest.mark.parametrize("kind", KINDS)
def test_a_one_row_forward_is_row_zero_of_the_two_row_forward_bit_for_bit(exports, kind):
    """Greedy steps after a prompt: each one-token forward of the new graph against the old
    graph's [token, token] at [p, p + 1] (causal): logits, features and KV rows [0, p + 1) are
    identical (the spare row p + 1 is not: from layer 1 on the old graph's second row had its
    own hidden state, the new graph repeats row 0's q/k/v; the next forward overwrites it).
    Where the CPU runs int4 MatMulNBits on one row through another path (AVX2 only) the matmuls
    differ, so there the runtime runs two rows
    (test_the_runtime_runs_one_row_where_the_matmuls_are_row_exact_alone)."""
    new, old = _pair(exports, kind)
    if not matmuls_row_exact(new.graph):
        pytest.skip("this CPU's one-row MatMulNBits path for this graph rounds differently (int4 without AVX-512)")
    kv_new, kv_old = new.allocate_kv(MAX_LENGTH + 1), old.allocate_kv(MAX_LENGTH + 1)
    _same(prefill(new, kv_new, PROMPT), prefill(old, kv_old, PROMPT))
    token, p = PROMPT[-1], len(PROMPT)
    for _ in range(STEPS):
        one = run_step(new, kv_new, [token], [p], causal_mask(p, 1), p)
        two = run_step(old, kv_old, [token, token], [p, p + 1], causal_mask(p, 2), p, logits_at=[0])
        _same(one, two, slice(0, 1))
        assert all(np.array_equal(a, b) for a, b in zip(kv_rows(kv_new, p + 1), kv_rows(kv_old, p + 1)))
        token, p = int(one["logits"][0, 0].argmax()), p + 1


@pytest.mark.parametrize("kind", KINDS)
def test_forwards_of_two_rows_or_more_are_unchanged(exports, kind):
    """Causal chunks of 2, 3 and 8 rows and a verification tree: the same bits in both graphs."""
    new, old = _pair(exports, kind)
    P = len(PROMPT)
    tree = DraftTree.from_paths(5, [[7, 9, 11], [8, 12], [7, 10]])
    for run in [lambda be, kv, S=S: run_step(be, kv, PROMPT[:S], np.arange(P, P + S), causal_mask(P, S), P)
                for S in (2, 3, 8)] + [lambda be, kv: run_tree(be, kv, tree, P)]:
        outs, kvs = [], []
        for be in (new, old):
            kv = be.allocate_kv(MAX_LENGTH + 1)
            prefill(be, kv, PROMPT)
            outs.append(run(be, kv))
            kvs.append(kv_rows(kv, MAX_LENGTH + 1))
        _same(*outs)
        assert all(np.array_equal(a, b) for a, b in zip(*kvs))


@pytest.mark.parametrize("kind", KINDS)
def test_a_batch_of_one_token_rows_repeats_each_row_at_its_own_past(exports, kind):
    """Two sequences with different pasts, one new token each, in one batched forward (contract
    "Batched forwards"): each row's logits and KV are its solo one-token forward's."""
    new, _ = _pair(exports, kind)
    if not matmuls_row_exact(new.graph):
        pytest.skip("this CPU's one-row MatMulNBits path for this graph rounds differently (int4 without AVX-512)")
    prompts = [PROMPT, PROMPT[:25]]
    kv = new.allocate_kv(MAX_LENGTH + 1, batch=2)
    for b, prompt in enumerate(prompts):
        prefill(new, kv.slots(b, b + 1), prompt)
    pasts, T = [len(p) for p in prompts], max(len(p) for p in prompts) + 1
    mask = np.zeros((2, 1, T), bool)
    for b, past in enumerate(pasts):
        mask[b, 0, :past + 1] = True
    tokens = [[3], [4]]
    out = new.run(StepInputs(np.array(tokens, np.int64), np.array([[p] for p in pasts], np.int64), mask,
                             np.zeros((2, 1), np.int64)), kv, max(pasts))
    logits = out.logits.copy()
    for b, prompt in enumerate(prompts):
        solo = new.allocate_kv(MAX_LENGTH + 1)
        prefill(new, solo, prompt)
        want = run_step(new, solo, tokens[b], [pasts[b]], causal_mask(pasts[b], 1), pasts[b])
        assert np.array_equal(logits[b], want["logits"][0])
        n = pasts[b] + 1
        assert all(np.array_equal(np.array(a[:, b:b + 1]), s) for a, s in zip(kv_rows(kv, n), kv_rows(solo, n)))


def test_a_one_token_forward_needs_the_spare_kv_row(exports):
    """The graph writes rows [past, past + 2) of a one-token call: the backend refuses a buffer
    without the spare row (CapacityError) instead of letting the operator write past it."""
    new, old = _pair(exports, "int4")
    for be, fits in ((new, False), (old, True)):
        kv = be.allocate_kv(len(PROMPT) + 1)
        prefill(be, kv, PROMPT)
        P = len(PROMPT)
        if fits:
            run_step(be, kv, [5], [P], causal_mask(P, 1), P)
        else:
            with pytest.raises(CapacityError, match=rf"\[{P}, {P + 2}\)"):
                run_step(be, kv, [5], [P], causal_mask(P, 1), P)


def test_export_options_choose_where_the_row_is_repeated():
    from eagle_deploy.contract.onnx_io import KV_SEQ_MAJOR, KV_SHARED
    from eagle_deploy.exporter.export import ExportOptions, check_options, repeat_one_row_for

    assert repeat_one_row_for(ExportOptions(quant="int4"), KV_SHARED)
    assert repeat_one_row_for(ExportOptions(quant="int8"), KV_SHARED)
    assert not repeat_one_row_for(ExportOptions(), KV_SHARED)  # fp32: not row-exact by default
    assert repeat_one_row_for(ExportOptions(repeat_one_row="on"), KV_SHARED)
    assert not repeat_one_row_for(ExportOptions(quant="int4", repeat_one_row="off"), KV_SHARED)
    assert not repeat_one_row_for(ExportOptions(quant="int4"), KV_SEQ_MAJOR)  # the standard graph: never
    with pytest.raises(ValueError, match="needs the fused graph"):
        check_options(ExportOptions(repeat_one_row="on", graph="standard"))
    with pytest.raises(ValueError, match="--repeat-one-row maybe is not one of auto, on, off"):
        check_options(ExportOptions(repeat_one_row="maybe"))


@pytest.mark.parametrize("kind", KINDS + ["int4-two-row", "fp32"])
def test_the_runtime_runs_one_row_where_the_matmuls_are_row_exact_alone(exports, kind):
    """Row-exact decoding runs one-token forwards as one row on a graph that repeats one-row
    queries where its matmuls give a row the same bits alone (int8; int4 with AVX-512), else as
    two; the KV buffer keeps the spare row either way."""
    from eagle_deploy.runtime.api import EagleRuntime

    for row_exact in (True, False):
        d = EagleRuntime.load(exports[kind], threads=THREADS, with_draft=False, row_exact=row_exact).decoder
        repeats = kind in KINDS
        one = repeats and (kind == "int8" or AVX512)
        assert d.step_rows == (2 if row_exact and not one else 1), (kind, row_exact)
        assert d.kv.capacity == MAX_LENGTH + int(row_exact or repeats)


def test_which_matmuls_are_row_exact_alone():
    from eagle_deploy.common.cpu import CpuInfo
    from eagle_deploy.contract.manifest import GraphEntry, QuantRecord

    avx2, avx512 = (CpuInfo("x", 25, 1, frozenset(f), 2) for f in ({"avx2"}, {"avx2", "avx512f"}))

    def graph(kind=None, **settings):
        record = None if kind is None else QuantRecord(kind=kind, method=settings.pop("method", "nbits"),
                                                       batch_invariant=False, **settings)
        return GraphEntry(path="target.onnx", dtype="float32", inputs=(), outputs=(), quant=kind, quant_info=record)

    default = {"block_size": 32, "accuracy_level": 4}
    assert matmuls_row_exact(graph(), avx2, "x86_64")  # fp32 MatMul with a constant weight
    assert matmuls_row_exact(graph("int8", **default), avx2, "x86_64")
    assert not matmuls_row_exact(graph("int4", **default), avx2, "x86_64")
    assert matmuls_row_exact(graph("int4", **default), avx512, "AMD64")
    assert not matmuls_row_exact(graph("int8", block_size=128, accuracy_level=4), avx512, "x86_64")
    assert not matmuls_row_exact(graph("int8", block_size=32, accuracy_level=0), avx512, "x86_64")
    assert not matmuls_row_exact(graph("int8", method="dynamic"), avx512, "x86_64")
    assert not matmuls_row_exact(graph("int8", **default), avx512, "aarch64")  # not measured there
    assert [step_rows(r, p, e) for r, p, e in ((True, True, True), (True, True, False), (True, False, True),
                                               (False, False, False))] == [1, 2, 2, 1]
