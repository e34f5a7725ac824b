"""KV capacity: a prompt plus a draft tree running past max_length clips the tree and ends
with "length"; no call reads a row it does not own (NaN-poisoned before every call) and
nothing is written past max_length (the buffer is oversized and poisoned past the end)."""
from __future__ import annotations

import numpy as np
import pytest

from eagle_deploy.contract.tree_config import TreeConfig
from eagle_deploy.runtime.drafter import EagleDrafter
from tests.helpers import CommitSpy, RecordingBackend, ReferenceScript, ScriptedDrafter, poison

EXTRA = 32


def _long_prompt(n: int, seed: int = 3) -> list[int]:
    return np.random.default_rng(seed).integers(1, 256, n).tolist()


def _guarded(rt, max_length: int):
    """Wrap the runtime's backends: poison unused rows before each call, forbid writes past
    max_length, and give the target an oversized buffer whose tail must stay NaN."""
    dec = rt.decoder
    dec.target = RecordingBackend(dec.target, poison=True, limit=max_length)
    dec.kv = dec.target.allocate_kv(max_length + EXTRA)
    poison(dec.kv)
    if isinstance(dec.drafter, EagleDrafter):
        dec.drafter.backend = RecordingBackend(dec.drafter.backend, poison=True, limit=dec.drafter.kv.capacity)
        poison(dec.drafter.kv)
    return rt


def _wide_perfect(pos, ref):
    """The true depth-5 chain plus 5 wrong siblings at every depth (30 draft nodes)."""
    truth = ref[pos:pos + 5]
    paths = [truth]
    for d in range(len(truth)):
        paths += [truth[:d] + [w] for w in [t for t in range(250, 240, -1) if t != truth[d]][:5]]
    return paths


@pytest.mark.parametrize("prompt_len", [200, 236, 250])
def test_tree_is_clipped_at_capacity_and_finishes_with_length(model, prompt_len):
    L = model.manifest.max_length
    prompt = _long_prompt(prompt_len)
    ref = model.ref(prompt, L - prompt_len + 8)
    assert model.eos_ids[0] not in ref[:L + 1 - prompt_len]
    rt = _guarded(model.runtime(drafter=ScriptedDrafter(ReferenceScript(prompt, ref, _wide_perfect))), L)
    spy = CommitSpy(rt.decoder)
    result = rt.generate(prompt, max_new_tokens=200)
    # the last committed token is chosen but never run, so KV capacity L allows L + 1 tokens
    assert result.token_ids == ref[:L + 1 - prompt_len]
    assert result.finish_reason == "length"
    assert spy.rounds[-1].target_len == L
    calls = rt.decoder.target.calls
    assert max(call.past + len(call.input_ids) for call in calls) == L
    assert len(calls[1].input_ids) == min(31, L - prompt_len)  # full tree, or clipped to the room left
    assert 1 <= len(calls[-1].input_ids) < 31  # the last tree was clipped
    assert np.all(np.isnan(rt.decoder.kv.rows(0)[L:])), "a row past max_length was written"


@pytest.mark.parametrize("tree", ["dynamic-wide", "eagle1"])
def test_eagle_drafter_near_capacity_reads_nothing_stale(model, tree):
    L = model.manifest.max_length
    config = (TreeConfig("dynamic", total_tokens=60, depth=6, top_k=8) if tree == "dynamic-wide"
              else TreeConfig.static("eagle1"))
    prompt = _long_prompt(230, seed=5)
    rt = _guarded(model.runtime(tree=config), L)
    result = rt.generate(prompt, max_new_tokens=100)
    want = model.expected(prompt, L + 1 - 230)
    assert result.token_ids == want
    assert result.finish_reason == ("stop" if want[-1] in model.eos_ids else "length")
    assert np.all(np.isnan(rt.decoder.kv.rows(-1)[L:]))
    draft_calls = rt.decoder.drafter.backend.calls
    assert draft_calls and (max(call.past + len(call.input_ids) for call in draft_calls)
                            <= rt.decoder.drafter.kv.capacity)


def test_prompt_one_short_of_capacity_gives_two_tokens(model):
    L = model.manifest.max_length
    prompt = _long_prompt(L - 1, seed=7)
    rt = _guarded(model.runtime(), L)
    result = rt.generate(prompt, max_new_tokens=10)
    assert result.token_ids == model.expected(prompt, 2)
    assert result.finish_reason == "length" or result.token_ids[-1] in model.eos_ids
    assert [len(call.input_ids) for call in rt.decoder.target.calls] == [L - 1, 1]


@pytest.mark.parametrize("extra", [0, 5])
def test_prompt_at_or_past_capacity_is_refused_before_any_forward(model, extra):
    L = model.manifest.max_length
    rt = _guarded(model.runtime(), L)
    with pytest.raises(ValueError, match=f"{L + extra} tokens"):
        rt.generate(_long_prompt(L + extra), max_new_tokens=4)
    assert rt.decoder.target.calls == []
    # the Decoder's own guard (what a caller of Decoder.decode without EagleRuntime meets) says the same
    from eagle_deploy.runtime.decode import TokenStopper
    from eagle_deploy.runtime.sampling import SamplingParams

    assert rt.decoder.length_limit == L  # the fixture is at its limit: shortening is the only remedy
    with pytest.raises(ValueError, match=f"the prompt has {L + extra} tokens; .* at most {L - 1} prompt tokens fit "
                                         r"\(one row is left for output\): shorten the prompt$"):
        next(rt.decoder.decode(_long_prompt(L + extra), 4, SamplingParams(), TokenStopper()))
    assert rt.decoder.target.calls == []


def test_vanilla_runs_to_capacity(model):
    L = model.manifest.max_length
    prompt = _long_prompt(240, seed=9)
    rt = _guarded(model.runtime(), L)
    result = rt.generate(prompt, max_new_tokens=100, mode="vanilla")
    want = model.expected(prompt, L + 1 - 240)
    assert result.token_ids == want
    assert np.all(np.isnan(rt.decoder.kv.rows(0)[L:]))


def test_finish_says_whether_capacity_or_max_new_tokens_was_the_limit(model):
    L = model.manifest.max_length
    prompt = _long_prompt(L - 6, seed=11)
    rt = model.runtime()
    full = rt.generate(prompt, max_new_tokens=100)
    if full.token_ids[-1] in model.eos_ids:
        pytest.skip("the reference output stops at EOS before the capacity")
    assert full.finish_reason == "length" and len(full.token_ids) == 7
    assert full.stats.limited_by == "capacity" and full.stats.to_json()["limited_by"] == "capacity"
    short = rt.generate(prompt, max_new_tokens=3)
    assert short.finish_reason == "length" and short.stats.limited_by == "max_new_tokens"
    assert short.stats.to_json()["limited_by"] == "max_new_tokens"


def test_eagle_run_reports_the_kv_capacity_limit(mha, capsys):
    import json

    from eagle_deploy.runtime import cli
    from tests.conftest import THREADS

    L = mha.manifest.max_length
    base = ["--engines", str(mha.export_dir), "--prompt", "ab" * ((L - 6) // 2), "--raw", "--max-new-tokens", "100",
            "--threads", str(THREADS)]
    assert cli.main(base + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    if out["finish_reason"] == "stop":
        pytest.skip("the output stops at EOS before the capacity")
    assert out["finish_reason"] == "length" and out["stats"]["limited_by"] == "capacity"
    assert cli.main(base) == 0
    err = capsys.readouterr().err
    assert mha.manifest.length_limit == L  # the fixture is exported at its position limit: no re-export to suggest
    assert (f"finish: length (the export's KV capacity, max_length {L}, ran out before --max-new-tokens; "
            "already the largest max_length allowed)") in err


@pytest.mark.parametrize("prompt_len", [236, 248, 253])
@pytest.mark.parametrize("tree", ["dynamic-deep", "eagle1"])
def test_drafting_depth_is_limited_by_the_rows_left(model, prompt_len, tree):
    """Near capacity the target verifies only the rows left, so the drafter grows no deeper
    than that: every draft position stays below max_length and a round spends at most one
    draft forward per row left. The output stays vanilla greedy's."""
    L = model.manifest.max_length
    deep = TreeConfig("dynamic", total_tokens=40, depth=8, top_k=4)
    config = deep if tree == "dynamic-deep" else TreeConfig.static("eagle1")
    prompt = _long_prompt(prompt_len, seed=13)
    rt = _guarded(model.runtime(tree=config), L)
    drafter = rt.decoder.drafter
    rounds = []  # (rows left in the target KV, draft forwards of the round)
    propose = drafter.propose

    def recording(request):
        before = len(drafter.backend.calls)
        tree_ = propose(request)
        rounds.append((L - request.root_position, len(drafter.backend.calls) - before))
        return tree_

    drafter.propose = recording
    result = rt.generate(prompt, max_new_tokens=100)
    assert result.token_ids == model.expected(prompt, L + 1 - prompt_len)
    fed = [int(p) for call in drafter.backend.calls for p in call.position_ids]
    assert max(fed) < L, f"draft position {max(fed)} fed with max_length {L}"
    assert rounds and all(forwards <= left for left, forwards in rounds), rounds
    assert rounds[-1][0] < config.depth  # the last rounds did run short of rows
