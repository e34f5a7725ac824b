"""Stops inside an accepted chunk: EOS and max_new_tokens end the request exactly there;
nothing after the stop is emitted or counted, and the target KV holds exactly the committed
tokens that were run (all but the last)."""
from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import PROMPTS
from tests.helpers import (
    CommitSpy,
    ReferenceScript,
    ScriptedDrafter,
    UnclippedDrafter,
    assert_kv_close,
    clone_runtime_export,
    kv_rows,
    prefill,
    wrong_token,
)

PROMPT = PROMPTS[1]
DEPTH = 5


def _perfect(pos, ref):
    return [ref[pos:pos + DEPTH]]


def _eos_index(ref, lo, hi):
    """First index j in [lo, hi) whose token does not occur earlier (so it can serve as EOS)."""
    return next(j for j in range(lo, hi) if ref[j] not in ref[:j])


def _assert_kv_is_committed_prefix(model, rt, rounds):
    last = rounds[-1]
    assert last.target_len == len(last.committed) - 1
    be = model.backend()
    kv = be.allocate_kv(model.manifest.max_length)
    prefill(be, kv, last.committed[:last.target_len])
    assert_kv_close(kv_rows(rt.decoder.kv, last.target_len), kv_rows(kv, last.target_len))


@pytest.fixture
def eos_runtime(model, tmp_path):
    """A runtime whose manifest names the reference's token at index j as its EOS."""

    def make(j, drafter=None, ref_len=40):
        ref = model.ref(PROMPT, ref_len)
        eos = ref[j]
        folder = clone_runtime_export(model.export_dir, tmp_path / f"eos{j}", eos_token_ids=[eos])
        return model.runtime(folder, drafter=drafter), ref, eos

    return make


@pytest.mark.parametrize("where", ["mid-chunk", "bonus", "first-token"])
def test_eos_inside_accepted_chunk(model, eos_runtime, where):
    ref = model.ref(PROMPT, 40)
    # round 1 verifies drafts for ref[1..]; the EOS is ref[j]: an accepted draft token with
    # drafts continuing past it (mid-chunk), the bonus token after j - 1 accepted drafts, or
    # the prefill's first token
    j = {"mid-chunk": _eos_index(ref, 2, DEPTH), "bonus": _eos_index(ref, 2, DEPTH + 1), "first-token": 0}[where]
    paths = _perfect if where != "bonus" else (lambda pos, r: [r[pos:pos + j - 1] + [wrong_token(r[pos + j - 1])]])
    script = ReferenceScript(PROMPT, ref, paths)
    rt, ref, eos = eos_runtime(j, ScriptedDrafter(script))
    spy = CommitSpy(rt.decoder)
    request = rt.stream(PROMPT, max_new_tokens=30)
    deltas = list(request)
    result = request.result
    assert result.token_ids == ref[:j + 1]
    assert result.finish_reason == "stop"
    stats = result.stats
    assert stats.new_tokens == j + 1
    assert stats.accepted_per_round == ([] if j == 0 else [j])
    assert stats.target_forwards == (1 if j == 0 else 2)
    text = rt.tokenizer.decode(ref[:j], skip_special_tokens=True)
    assert result.text == text and "".join(deltas) == text
    if j:
        assert spy.rounds[-1].finish_reason == "stop" and spy.rounds[-1].chunk == ref[1:j + 1]
        _assert_kv_is_committed_prefix(model, rt, spy.rounds)
    # vanilla on the same engine stops at the same token
    assert rt.generate(PROMPT, max_new_tokens=30, mode="vanilla").token_ids == ref[:j + 1]


def test_eos_id_zero_stops_greedy_like_hf(model, eos_runtime):
    """The tiny fixtures' own EOS (id 0): decoding stops on it like the plain loop does."""
    assert model.eos_ids == [0]
    ref = model.ref(PROMPT, 40)
    assert 0 not in ref[:40]
    result = model.rt.generate(PROMPT, max_new_tokens=40)
    assert result.token_ids == ref and result.finish_reason == "length"


@pytest.mark.parametrize("max_new", [1, 2, 3, 4, 6, 7, 9, 13])
@pytest.mark.parametrize("drafter_kind", ["clipped", "unclipped"])
def test_max_new_tokens_inside_a_chunk(model, max_new, drafter_kind):
    """Perfect depth-5 drafts; max_new_tokens falls inside a round's chunk. `clipped` is the
    ScriptedDrafter (respects DraftRequest.max_depth); `unclipped` ignores it, so the
    decoder itself must cut the chunk."""
    ref = model.ref(PROMPT, 40)
    script = ReferenceScript(PROMPT, ref, _perfect)
    drafter = ScriptedDrafter(script) if drafter_kind == "clipped" else UnclippedDrafter(script)
    rt = model.runtime(drafter=drafter)
    spy = CommitSpy(rt.decoder)
    result = rt.generate(PROMPT, max_new_tokens=max_new)
    assert result.token_ids == ref[:max_new]
    assert result.finish_reason == "length"
    assert result.stats.new_tokens == max_new
    assert sum(result.stats.accepted_per_round) == max_new - 1
    assert result.stats.target_forwards == 1 + -(-(max_new - 1) // (DEPTH + 1))
    if spy.rounds:
        _assert_kv_is_committed_prefix(model, rt, spy.rounds)
        assert spy.rounds[-1].committed == PROMPT + ref[:max_new]


def test_finish_reasons(model):
    rt = model.rt
    assert rt.generate(PROMPT, max_new_tokens=5).finish_reason == "length"
    with pytest.raises(ValueError, match="max_new_tokens"):
        rt.generate(PROMPT, max_new_tokens=0)
    # a stop string ends the request with "stop" and is excluded from the text
    ref = model.ref(PROMPT, 40)
    full = rt.tokenizer.decode(ref[:20], skip_special_tokens=True)
    stop = next(full[i:i + 2] for i in range(4, len(full) - 2)
                if "\ufffd" not in full[i:i + 2] and full[i:i + 2].isprintable() and full[i:i + 2] not in full[:i + 1])
    result = rt.generate(PROMPT, max_new_tokens=40, stop=[stop])
    assert result.finish_reason == "stop"
    assert result.text == full[:full.index(stop)]
    assert stop not in result.text


def test_stats_count_nothing_after_the_stop(model, eos_runtime):
    ref = model.ref(PROMPT, 40)
    j = _eos_index(ref, 8, 12)  # in round 2 (ref[7..12])
    rt, ref, eos = eos_runtime(j, ScriptedDrafter(ReferenceScript(PROMPT, ref, _perfect)))
    result = rt.generate(PROMPT, max_new_tokens=30)
    assert result.token_ids == ref[:j + 1]
    assert result.stats.accepted_per_round == [DEPTH + 1, j - DEPTH - 1]
    assert result.stats.mean_accept_len == pytest.approx(j / 2)
    assert np.sum(result.stats.accepted_per_round) + 1 == result.stats.new_tokens
