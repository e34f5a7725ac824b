"""The runtime with an export's int8 prefill graph (RuntimeOptions.prefill_graph "auto", the
default; contract onnx_io "Prefill graph"): prompt forwards run on prefill.onnx, every other
forward on the int4 target graph, into one KV buffer. Greedy EAGLE output equals vanilla's (both
start from the same prefill), chunked and whole prefills give the same tokens and bits, the
prefix cache stores rows a fresh prefill would compute, and BatchRuntime (eagle-serve) answers as
EagleRuntime (eagle-run) does. Exports without a prefill graph load and decode as before.

The exports are tests/conftest.py's prefill_exports."""
from __future__ import annotations

import numpy as np
import pytest

from eagle_deploy.contract import onnx_io as c
from eagle_deploy.contract.errors import SettingError
from eagle_deploy.contract.manifest import Manifest
from eagle_deploy.runtime.api import EagleRuntime
from eagle_deploy.runtime.backends import load_backend
from eagle_deploy.runtime.batch import BatchRuntime
from eagle_deploy.runtime.drafter import EagleDrafter
from eagle_deploy.runtime.options import RuntimeOptions
from tests import tiny
from tests.conftest import HEAD_TREE, THREADS
from tests.helpers import ForcingDrafter, RecordingBackend, kv_rows
from tests.runtime.test_batch import reference_script

N = 32
_rng = np.random.default_rng(31)
PROMPTS = [[77], _rng.integers(1, tiny.VOCAB, 9).tolist(), _rng.integers(1, tiny.VOCAB, 40).tolist(),
           _rng.integers(1, tiny.VOCAB, 150).tolist()]


@pytest.fixture(scope="module")
def folder(prefill_exports):
    return prefill_exports["int4-prefill"]


def _runtime(folder, script=None, wrap=None, **kw) -> EagleRuntime:
    """EagleRuntime over `folder` drafting the head's tree, or with `script` a ForcingDrafter
    (tests/helpers.py) over the real draft graph that proposes the script's trees."""
    drafter = None
    if script is not None:
        m = Manifest.load(folder)
        drafter = ForcingDrafter(EagleDrafter.for_export(load_backend("ort", folder, m, "draft", THREADS), m.tree, m),
                                 script)
    return EagleRuntime.load(folder, drafter=drafter, wrap_backend=wrap, **{**HEAD_TREE, "threads": THREADS, **kw})


def test_the_prefill_graph_is_opened_only_when_the_export_has_one_and_it_is_asked_for(folder, prefill_exports):
    rt = _runtime(folder)
    assert rt.options.prefill_graph == "auto" and rt.decoder.prefill_target.graph.path == c.PREFILL_FILE
    assert _runtime(folder, prefill_graph="target").decoder.prefill_target is None
    older = _runtime(prefill_exports["fp32"])  # an export without one loads and decodes as before
    assert Manifest.load(prefill_exports["fp32"]).prefill is None and older.decoder.prefill_target is None
    assert len(older.generate(PROMPTS[1], max_new_tokens=4).token_ids) == 4
    m = Manifest.load(folder)
    assert RuntimeOptions().uses_prefill_graph(m)
    assert not RuntimeOptions(backend="trt").uses_prefill_graph(m)
    assert not RuntimeOptions(prefill_graph="target").uses_prefill_graph(m)
    with pytest.raises(SettingError, match="prefill_graph must be one of auto, target, got 'int8'"):
        RuntimeOptions(prefill_graph="int8")


def test_prompt_forwards_run_on_the_prefill_graph_and_every_other_on_the_target(folder):
    recorders = []

    def wrap(backend):
        recorders.append(RecordingBackend(backend))
        recorders[-1].graph = backend.graph
        return recorders[-1]

    rt = _runtime(folder, wrap=wrap, prefill_chunk=16)
    by_graph = {r.graph.path: r for r in recorders}
    result = rt.generate(PROMPTS[2], max_new_tokens=8)
    prefill, target = by_graph[c.PREFILL_FILE], by_graph[c.TARGET_FILE]
    assert [len(call.input_ids) for call in prefill.calls] == [16, 16, 8]
    assert [call.past for call in prefill.calls] == [0, 16, 32]
    assert len(target.calls) == result.stats.rounds and all(call.past >= 40 for call in target.calls)
    assert result.stats.prefill_forwards == 3


@pytest.mark.parametrize("chunk", [0, 16])
def test_greedy_eagle_equals_vanilla_with_the_int8_prefill(folder, chunk):
    """Drafts forced along the vanilla reference (several tokens accepted per round, branches
    off it rejected) and the head's own trees: every token is vanilla's."""
    plain = _runtime(folder, prefill_chunk=chunk)
    refs = {tuple(p): plain.generate(p, max_new_tokens=N, mode="vanilla").token_ids for p in PROMPTS}
    forced = _runtime(folder, reference_script(refs), prefill_chunk=chunk)
    taus = []
    for p in PROMPTS:
        result = forced.generate(p, max_new_tokens=N)
        assert result.token_ids == refs[tuple(p)]
        taus.append(result.stats.mean_accept_len)
        assert plain.generate(p, max_new_tokens=N).token_ids == refs[tuple(p)]
    assert np.mean(taus) > 2  # rounds accepted several drafted tokens


def test_chunked_and_whole_prefills_give_the_same_bits_and_tokens(folder):
    runtimes = {chunk: _runtime(folder, prefill_chunk=chunk) for chunk in (0, 7, 64)}
    prompt = PROMPTS[3]
    outs = {chunk: rt.decoder.prefill_rows(prompt, 0) for chunk, rt in runtimes.items()}
    for chunk, (out, features) in outs.items():
        assert np.array_equal(out.logits, outs[0][0].logits), chunk
        assert np.array_equal(np.concatenate(features), np.concatenate(outs[0][1])), chunk
        assert all(np.array_equal(a, b) for a, b in zip(kv_rows(runtimes[chunk].decoder.kv, len(prompt)),
                                                         kv_rows(runtimes[0].decoder.kv, len(prompt))))
    tokens = {chunk: rt.generate(prompt, max_new_tokens=N).token_ids for chunk, rt in runtimes.items()}
    assert tokens[7] == tokens[64] == tokens[0]


def test_the_prefix_cache_stores_the_rows_a_fresh_int8_prefill_computes(folder):
    """A first turn's prompt and answer are settled by the prefill graph (Decoder.settle runs
    prefill forwards), so the cached rows are what a fresh prefill of those tokens gives, bit
    for bit, and a next turn that reuses them decodes the tokens it gets without the cache."""
    cached = _runtime(folder, prefix_cache_mb=16, prefill_chunk=16)
    first = cached.generate(PROMPTS[2], max_new_tokens=N)
    entry = cached.prefix_cache.entries()[-1]
    assert entry.tokens.tolist() == PROMPTS[2] + first.token_ids
    fresh = _runtime(folder, prefill_chunk=16)
    out, features = fresh.decoder.prefill_rows(entry.tokens.tolist(), 0)
    assert np.array_equal(np.concatenate(features), entry.features)
    assert all(np.array_equal(a, b) for a, b in zip(kv_rows(fresh.decoder.kv, len(entry.tokens)), entry.kv))
    turn = PROMPTS[2] + first.token_ids + PROMPTS[1]
    again = cached.generate(turn, max_new_tokens=N)
    assert again.stats.cached_tokens == len(entry.tokens)
    assert again.token_ids == fresh.generate(turn, max_new_tokens=N).token_ids


def test_batched_decoding_runs_prefills_on_it_and_answers_as_a_lone_runtime(folder):
    solo = _runtime(folder, prefill_chunk=16)
    want = [solo.generate(p, max_new_tokens=N).token_ids for p in PROMPTS]
    batch = BatchRuntime.load(folder, 2, prefill_chunk=16, shrink_trees=False, **{**HEAD_TREE, "threads": THREADS})
    assert set(batch.backends) == {"target", "draft", "prefill"}
    batch.backends["prefill"] = counted = RecordingBackend(batch.backends["prefill"])
    results = batch.generate_many(PROMPTS, max_new_tokens=N)
    assert [r.token_ids for r in results] == want
    one_token = solo.decoder.step_rows  # the 1-token prompt: run as 2 rows where one row is not exact here
    assert sum(len(call.input_ids) for call in counted.calls) == sum(map(len, PROMPTS)) - 1 + one_token
    plain = BatchRuntime.load(folder, 2, prefill_graph="target", **{**HEAD_TREE, "threads": THREADS})
    assert "prefill" not in plain.backends


@pytest.mark.parametrize("module", ["eagle_deploy.runtime.cli", "eagle_deploy.serve.cli"])
def test_eagle_run_and_eagle_serve_take_the_choice_as_a_flag(module):
    import importlib

    parser = importlib.import_module(module).build_parser()
    args = parser.parse_args(["--engines", "x", "--prefill-graph", "target"] + (["--prompt", "hi"] * ("run" in module)))
    assert RuntimeOptions.from_args(args).prefill_graph == "target"
    assert RuntimeOptions.from_args(parser.parse_args(["--engines", "x"] + (["--prompt", "hi"] * ("run" in module)))
                                    ).prefill_graph == "auto"
