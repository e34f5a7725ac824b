"""Chunked prefill in the Decoder (EagleRuntime's `prefill_chunk`, default decode.PREFILL_CHUNK):
a long prompt runs as forwards of `prefill_chunk` rows, each at the past the chunks before it
wrote, and gives the same tokens, first-token logits, features and KV as one forward."""
from __future__ import annotations

import numpy as np
import pytest

from eagle_deploy.runtime.api import EagleRuntime
from eagle_deploy.runtime.decode import PREFILL_CHUNK, Stats
from eagle_deploy.runtime.sampling import SamplingParams
from tests.conftest import MAX_LENGTH, THREADS
from tests.helpers import RecordingBackend

PROMPT = [int(t) for t in np.random.default_rng(3).integers(5, 250, 23)]  # 23 ids of the tiny 256-token vocabulary


def _prefill_calls(rt: EagleRuntime, prompt, **kw):
    """(result, [(rows, past)] of the target forwards before the first token came back)."""
    rt.decoder.target = rec = RecordingBackend(rt.decoder.target)
    r = rt.generate(prompt, max_new_tokens=12, **kw)
    calls = [(len(c.input_ids), c.past) for c in rec.calls[: r.stats.prefill_forwards]]
    return r, calls


@pytest.mark.parametrize("model", ["mha", "gqa", "eagle3"])
@pytest.mark.parametrize("mode", ["eagle", "vanilla"])
def test_chunked_prefill_runs_the_chunks_and_decodes_the_same_tokens(model, mode, request):
    m = request.getfixturevalue(model)
    whole, whole_calls = _prefill_calls(m.runtime(prefill_chunk=0), PROMPT, mode=mode)
    chunked, calls = _prefill_calls(m.runtime(prefill_chunk=5), PROMPT, mode=mode)
    assert whole_calls == [(23, 0)] and whole.stats.prefill_forwards == 1
    assert calls == [(5, 0), (5, 5), (5, 10), (5, 15), (3, 20)]  # the last 2 to 6 rows, never one
    assert chunked.stats.prefill_forwards == 5 and chunked.stats.target_forwards == chunked.stats.rounds + 5
    assert chunked.stats.to_json()["prefill_forwards"] == 5
    assert chunked.token_ids == whole.token_ids == m.expected(PROMPT, 12)


@pytest.mark.parametrize("model", ["mha", "gqa", "eagle3"])
def test_chunked_prefill_state_and_kv_are_one_forwards_bits(model, request):
    """Decoder.prefill itself: the first token, the features handed to the draft head
    (EAGLE-3: the tapped features) and every KV row written are bit-identical."""
    m = request.getfixturevalue(model)
    states, kvs = [], []
    for chunk in (0, 4, 7):
        rt = m.runtime(prefill_chunk=chunk)
        params = SamplingParams()
        state, _ = rt.decoder.prefill(PROMPT, params, params.rng(), Stats())
        states.append(state)
        kvs.append([a[..., :len(PROMPT), :].copy() if a.ndim == 4 else a.copy() for a in rt.decoder.kv.arrays])
    for state, kv in zip(states[1:], kvs[1:]):
        assert state.committed == states[0].committed and state.target_len == len(PROMPT)
        assert state.features.shape == states[0].features.shape
        assert np.array_equal(state.features, states[0].features)
        assert all(np.array_equal(a, b) for a, b in zip(kv, kvs[0]))


def test_quantised_row_exact_exports_decode_the_same_tokens_chunked(quant_exports):
    """int4 and int8 (row-exact by default): chunked greedy output equals one-forward output."""
    for name in ("int8", "int4"):
        outs = [EagleRuntime.load(quant_exports[name], threads=THREADS, prefill_chunk=chunk).generate(
                    PROMPT, max_new_tokens=16, mode=mode).token_ids
                for chunk in (0, 6) for mode in ("eagle", "vanilla")]
        assert outs[0] == outs[1] == outs[2] == outs[3], name


def test_default_chunk_and_short_prompts(mha):
    """EagleRuntime chunks by default; a prompt of at most PREFILL_CHUNK + 1 tokens is one forward."""
    rt = mha.runtime()
    assert rt.decoder.prefill_chunk == PREFILL_CHUNK and MAX_LENGTH - 1 <= PREFILL_CHUNK + 1
    r = rt.generate([5] * (MAX_LENGTH - 1), max_new_tokens=2)
    assert r.stats.prefill_forwards == 1


@pytest.mark.parametrize("bad", [-1, True, 2.5, "8"])
def test_bad_chunk_is_a_value_error_at_load(mha, bad):
    with pytest.raises(ValueError, match="prefill_chunk must be an integer >= 0"):
        mha.runtime(prefill_chunk=bad)
