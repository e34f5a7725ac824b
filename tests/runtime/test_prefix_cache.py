"""The prefix cache (runtime/prefix_cache.py, RuntimeOptions.prefix_cache_mb): a prompt that
starts with an earlier request's tokens, its settled answer included, copies their KV and
features in and prefills only the rest, with the logits, features and KV of a fresh prefill
bit for bit; a chat's next turn decodes the same tokens with the cache as without; entries
stay within the byte budget, least recently used evicted first; BatchRuntime slots share one."""
from __future__ import annotations

import numpy as np
import pytest

from eagle_deploy.contract.errors import SettingError
from eagle_deploy.runtime import cli as run_cli
from eagle_deploy.runtime.api import EagleRuntime
from eagle_deploy.runtime.batch import BatchRuntime
from eagle_deploy.runtime.decode import Stats
from eagle_deploy.runtime.options import FLAGS, RuntimeOptions
from eagle_deploy.runtime.prefix_cache import PrefixCache, PrefixEntry
from eagle_deploy.runtime.sampling import SamplingParams
from tests.conftest import HEAD_TREE, THREADS
from tests.helpers import wrong_token

RNG = np.random.default_rng(7)
FIRST = [int(t) for t in RNG.integers(5, 250, 30)]  # turn 1 (ids of the tiny 256-token vocabulary)
TAIL = [int(t) for t in RNG.integers(5, 250, 9)]  # what a later prompt adds after the shared prefix
CHUNK = 8  # prefill chunk of the runtime under test: shared prefixes end inside and across chunks
ANSWER = 12


def _load(folder, cache_mb: float, **kw) -> EagleRuntime:
    return EagleRuntime.load(folder, **{**HEAD_TREE, "threads": THREADS, "prefix_cache_mb": cache_mb, **kw})


@pytest.fixture(params=["gqa", "mha", "eagle3", "int4"])
def export(request):
    """fp32 exports (GQA and MHA targets; an EAGLE-3 head, fed tapped features) and an int4
    one (row-exact by default), all with the fused graph."""
    if request.param == "int4":
        return request.getfixturevalue("quant_exports")["int4"]
    return request.getfixturevalue(request.param).export_dir


def _prefill(rt: EagleRuntime, prompt):
    """Decoder.prefill alone -> (stats, first-token logits, features [n, F], KV rows [0, n) per array)."""
    params, stats = SamplingParams(), Stats()
    state, logits = rt.decoder.prefill(prompt, params, params.rng(), stats)
    kv = rt.decoder.kv
    return stats, logits, state.features, [kv.rows(i)[:len(prompt)].copy() for i in range(len(kv.arrays))]


def test_a_hit_prefills_the_bits_of_a_fresh_prefill(export):
    """Three shared-prefix sizes (inside the first chunk, across a chunk boundary, into the
    settled answer) and a prompt the cache holds whole (capped at n - 2): the first token's
    logits, every feature row and every KV row equal a fresh runtime's one-forward prefill."""
    rt = _load(export, 4, prefill_chunk=CHUNK)
    fresh = _load(export, 0, prefill_chunk=0)
    turn = rt.generate(FIRST, ANSWER, mode="vanilla")
    held = FIRST + turn.token_ids
    assert len(turn.token_ids) == ANSWER and len(rt.prefix_cache) == 1
    assert list(rt.prefix_cache.entries()[0].tokens) == held  # settled: prompt and answer
    for shared in (3, 13, len(FIRST) + 6):
        prompt = held[:shared] + [wrong_token(held[shared])] + TAIL
        stats, logits, features, kv = _prefill(rt, prompt)
        _, want_logits, want_features, want_kv = _prefill(fresh, prompt)
        assert stats.cached_tokens == shared and stats.prefill_forwards == -(-(len(prompt) - shared - 1) // CHUNK)
        assert np.array_equal(logits, want_logits), shared
        assert features.shape == want_features.shape and np.array_equal(features, want_features), shared
        assert all(np.array_equal(a, b) for a, b in zip(kv, want_kv)), shared
    stats, logits, features, kv = _prefill(rt, held[:20])  # all 20 held: the last 2 rows are prefilled
    _, want_logits, want_features, want_kv = _prefill(fresh, held[:20])
    assert stats.cached_tokens == 18 and stats.prefill_forwards == 1
    assert np.array_equal(logits, want_logits) and np.array_equal(features, want_features)
    assert all(np.array_equal(a, b) for a, b in zip(kv, want_kv))


@pytest.mark.parametrize("mode", ["eagle", "vanilla"])
def test_a_second_turn_hits_and_decodes_the_same_tokens(export, mode):
    """Turn 2 = turn 1's prompt + its answer + new tokens: it reuses more than turn 1's prompt
    and decodes greedily exactly what a runtime without the cache decodes; its entry then
    replaces turn 1's (it extends it)."""
    rt, plain = _load(export, 4), _load(export, 0)
    one = rt.generate(FIRST, ANSWER, mode=mode)
    assert one.token_ids == plain.generate(FIRST, ANSWER, mode=mode).token_ids
    assert one.stats.cached_tokens == 0 and one.stats.to_json()["cached_tokens"] == 0
    second = FIRST + one.token_ids + TAIL
    two = rt.generate(second, 16, mode=mode)
    assert two.stats.cached_tokens == len(FIRST) + len(one.token_ids) > len(FIRST)
    assert two.stats.to_json()["cached_tokens"] == two.stats.cached_tokens
    assert two.token_ids == plain.generate(second, 16, mode=mode).token_ids
    entries = rt.prefix_cache.entries()
    assert len(entries) == 1 and list(entries[0].tokens) == second + two.token_ids
    c = rt.prefix_cache.counters
    assert (c.lookups, c.hits, c.cached_tokens, c.stored, c.settled) == (2, 1, two.stats.cached_tokens, 2, 2)
    assert c.settle_seconds > 0


def test_a_stream_settles_at_its_end_and_a_cancelled_one_is_not_kept(gqa):
    rt = _load(gqa.export_dir, 4)
    s = rt.stream(FIRST, 10)
    list(s)
    assert len(rt.prefix_cache) == 1 and rt.decoder.unsettled is None
    assert s.settle() == 0.0  # once
    late = rt.stream(TAIL + FIRST, 40)
    late.defer_settle()
    list(late)
    assert rt.decoder.unsettled is not None and len(rt.prefix_cache) == 1
    assert late.settle() > 0 and len(rt.prefix_cache) == 2
    gone = rt.stream(TAIL + TAIL, 40)
    next(gone)
    gone.cancel()
    list(gone)
    assert gone.result.finish_reason == "cancelled" and rt.decoder.unsettled is None and len(rt.prefix_cache) == 2


def test_settling_the_prompt_alone_runs_no_forward_and_hits_exactly(gqa):
    """answer=False (eagle-serve with requests waiting): the prompt's rows are stored as they
    are, no forward runs, and a later prompt that extends it prefills the bits of a fresh one."""
    rt = _load(gqa.export_dir, 4, prefill_chunk=CHUNK)
    s = rt.stream(FIRST, ANSWER)
    s.defer_settle()
    list(s)
    forwards, run = [], rt.decoder.target.run
    rt.decoder.target.run = lambda *a, **k: forwards.append(1) or run(*a, **k)
    s.settle(answer=False)
    rt.decoder.target.run = run
    assert forwards == [] and len(rt.prefix_cache) == 1
    stats, logits, features, kv = _prefill(rt, FIRST + TAIL)
    assert stats.cached_tokens == len(FIRST)  # the prompt, not its answer
    fresh = _load(gqa.export_dir, 0, prefill_chunk=0)
    _, logits0, features0, kv0 = _prefill(fresh, FIRST + TAIL)
    assert np.array_equal(logits, logits0) and np.array_equal(features, features0)
    assert all(np.array_equal(a, b) for a, b in zip(kv, kv0))


def test_entries_stay_within_the_budget_least_recently_used_first(gqa):
    rt = _load(gqa.export_dir, 4)
    prompts = [[t] + FIRST for t in (7, 8, 9)]
    for p in prompts[:2]:
        rt.generate(p, ANSWER, mode="vanilla")
    a, b = rt.prefix_cache.entries()
    assert a.nbytes == b.nbytes and rt.prefix_cache.nbytes == 2 * a.nbytes
    small = PrefixCache(2 * a.nbytes + a.nbytes // 2)  # room for two
    for e in (a, b):
        assert small.store(e)
    assert small.match(prompts[0] + [1], 99)[1] is a  # a is now the most recent
    c = PrefixEntry(np.asarray([9] + list(b.tokens[1:])), b.kv, b.features)
    assert small.store(c)
    assert small.entries() == [a, c] and small.nbytes <= small.budget and small.counters.evicted == 1
    assert not small.store(a)  # held already
    assert not PrefixCache(a.nbytes - 1).store(a)  # larger than the whole budget
    tiny = _load(gqa.export_dir, (a.nbytes - 1) / 2**20)
    tiny.generate(prompts[2], ANSWER, mode="vanilla")
    assert len(tiny.prefix_cache) == 0 and tiny.prefix_cache.counters.settled == 0  # not even run


def test_budget_zero_is_off(gqa):
    rt = _load(gqa.export_dir, 0)
    assert rt.prefix_cache is None and rt.decoder.prefix_cache is None and RuntimeOptions().prefix_cache_mb == 0
    r = rt.generate(FIRST, 8)
    r2 = rt.generate(FIRST + r.token_ids + TAIL, 8)
    assert r2.stats.cached_tokens == 0 and rt.decoder.unsettled is None and rt.settle() == 0.0


def test_batch_engine_slots_share_one_cache(gqa):
    """Turn 1 on slot 0, turn 2 on slot 1 (chunked from its first uncached row, prefill_chunk 8,
    while slot 0 decodes another request): the hit is exact, the tokens those of a solo
    runtime without the cache."""
    plain = _load(gqa.export_dir, 0)
    eng = BatchRuntime.load(gqa.export_dir, 2, **{**HEAD_TREE, "threads": THREADS, "prefix_cache_mb": 4,
                                                 "prefill_chunk": CHUNK})
    assert all(rt.prefix_cache is eng.prefix_cache for rt in eng.runtimes)
    with eng.busy(0) as rt:
        one = rt.generate(FIRST, ANSWER)
    second = FIRST + one.token_ids + TAIL + TAIL + TAIL  # 27 new rows: 3 chunks + 3
    other = [3, 1, 4, 1, 5, 9, 2, 6]
    results = eng.generate_many([other, second], per_request=[{"max_new_tokens": 40}, {"max_new_tokens": 16}])
    want = [plain.generate(p, n).token_ids for p, n in ((other, 40), (second, 16))]
    assert [r.token_ids for r in results] == want
    assert results[1].stats.cached_tokens == len(FIRST) + len(one.token_ids) and eng.prefill_chunks >= 3
    assert len(eng.prefix_cache) == 2  # "other" and the conversation (turn 2 replaced turn 1)


def test_the_standard_graph_is_refused(gqa_standard):
    """Its rows differ in the last bit when a prompt runs in parts, so a hit could not be exact."""
    with pytest.raises(SettingError, match="needs the fused target graph") as err:
        _load(gqa_standard.export_dir, 4)
    assert err.value.field == "prefix_cache_mb"


def test_a_bad_budget_is_one_error_naming_it():
    for bad in (-1, float("nan"), "8", True):
        with pytest.raises(SettingError) as err:
            RuntimeOptions(prefix_cache_mb=bad)
        assert err.value.field == "prefix_cache_mb"
    with pytest.raises(SettingError, match="needs the onnxruntime CPU backend"):
        RuntimeOptions(backend="trt", prefix_cache_mb=8)
    assert RuntimeOptions(backend="trt").prefix_cache_mb == 0 and FLAGS["prefix_cache_mb"] == "--prefix-cache-mb"


def test_eagle_run_reports_the_cached_tokens(gqa, capsys):
    """eagle-run's warm-up request leaves its prompt in the cache; the measured run reuses it."""
    argv = ["--engines", str(gqa.export_dir), "--prompt", "hello there", "--raw", "--max-new-tokens", "6",
            "--threads", str(THREADS), "--drafter", "eagle", "--always-draft"]
    import json

    assert run_cli.main([*argv, "--json", "--prefix-cache-mb", "2"]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["cached_tokens"] == stats["prompt_tokens"] - 2 > 0
    assert run_cli.main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["cached_tokens"] == 0
    assert run_cli.main([*argv, "--prefix-cache-mb", "2"]) == 0
    assert "prompt tokens cached" in capsys.readouterr().err
