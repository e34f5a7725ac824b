"""The typed seams between the runtime's pieces: backend outputs, the per-request `Stats`
(and the one definition of tau / per-depth acceptance), `stream()`'s result, observers and
wrappers given at construction, the draft forward count in the `Drafter` protocol, and the
attention masks' one home."""
from __future__ import annotations

import numpy as np
import pytest

from eagle_deploy.contract import onnx_io as c
from eagle_deploy.runtime import acceptance
from eagle_deploy.runtime.api import EagleRuntime, Generation
from eagle_deploy.runtime.backends.base import DraftOutputs, StepInputs, TargetOutputs, outputs_from_named
from eagle_deploy.runtime.decode import Stats
from eagle_deploy.runtime.drafter import causal_mask, expansion_mask
from eagle_deploy.runtime.tree import DraftTree
from eagle_deploy.runtime.verify import verify_greedy
from tests.conftest import HEAD_TREE, PROMPTS
from tests.helpers import RecordingBackend, run_step

# --------------------------------------------------------------------------- backend outputs


def test_outputs_from_named_builds_the_graph_type():
    logits, feats = np.zeros((1, 2, 7), np.float32), np.zeros((1, 3, 4), np.float32)
    out = outputs_from_named({c.LOGITS: logits, c.FEATURES: feats, "present.0.key": None})
    assert isinstance(out, TargetOutputs) and out.logits is logits and out.features is feats
    assert out.named() == {c.LOGITS: logits, c.FEATURES: feats}
    ids, lp = np.zeros((1, 1, 5), np.int64), np.zeros((1, 1, 5), np.float32)
    draft = outputs_from_named({c.NEXT_FEATURES: feats, c.TOPK_LOGPROBS: lp, c.TOPK_IDS: ids})
    assert isinstance(draft, DraftOutputs) and draft.topk_ids is ids and draft.topk_logprobs is lp
    assert set(draft.named()) == {c.NEXT_FEATURES, c.TOPK_LOGPROBS, c.TOPK_IDS}
    with pytest.raises(ValueError, match=c.FEATURES):
        outputs_from_named({c.LOGITS: logits})


def test_backends_return_typed_outputs(mha):
    target, draft = mha.backend("target"), mha.backend("draft")
    kv = target.allocate_kv(16)
    out = target.run(_inputs([5, 6, 7], [1, 2]), kv, 0)
    assert isinstance(out, TargetOutputs)
    assert out.logits.shape == (1, 2, mha.manifest.dims.vocab) and out.logits.dtype == np.float32
    assert out.features.shape == (1, 3, mha.manifest.dims.hidden)
    dkv = draft.allocate_kv(16)
    got = run_step(draft, dkv, [6, 7, 8], np.arange(3), causal_mask(0, 3), 0, logits_at=[2], features=out.features[0])
    dout = draft.run(_inputs([6, 7, 8], [2], out.features), draft.allocate_kv(16), 0)
    assert isinstance(dout, DraftOutputs) and dout.topk_ids.dtype == np.int64
    assert dout.topk_ids.shape == dout.topk_logprobs.shape == (1, 1, dout.topk_ids.shape[-1])
    np.testing.assert_array_equal(got[c.TOPK_IDS], dout.topk_ids)


def _inputs(tokens, logits_at, features=None) -> StepInputs:
    """A prefill-shaped StepInputs (past 0, causal)."""
    n = len(tokens)
    feats = None if features is None else np.ascontiguousarray(features)
    return StepInputs(np.asarray(tokens, np.int64)[None], np.arange(n)[None], causal_mask(0, n),
                      np.asarray(logits_at, np.int64)[None], feats)


# --------------------------------------------------------------------------- tau and Stats


def test_tau_and_depth_rates_have_one_definition():
    assert acceptance.tau([]) is None and acceptance.tau([1, 2, 3, 2]) == 2.0
    a = Stats(accepted_per_round=[3, 1], tree_depth_per_round=[3, 3])
    b = Stats(accepted_per_round=[4], tree_depth_per_round=[2])
    assert (a.rounds, a.round_tokens, b.rounds, b.round_tokens) == (2, 4, 1, 4)  # derived from the rounds
    assert a.mean_accept_len == 2.0 and Stats().mean_accept_len == 0.0
    assert acceptance.pooled_tau([a, b]) == pytest.approx(8 / 3) and acceptance.pooled_tau([Stats()]) is None
    # accepted draft tokens per round: 2, 0, 3 with tree depths 3, 3, 2
    assert acceptance.pooled_depth_rates([a, b], 3) == acceptance.depth_rates([2, 0, 3], [3, 3, 2], 3)
    # depth 1: 2 of 3 rounds; depth 2: both rounds that got there; depth 3: tried once (round 1), missed
    assert acceptance.pooled_depth_rates([a, b], 3) == [round(2 / 3, 4), 1.0, 0.0]


def test_stats_is_typed_and_its_json_is_plain(mha):
    r = mha.rt.generate(PROMPTS[0], max_new_tokens=12)
    s = r.stats
    assert isinstance(s, Stats) and s.mode == "eagle" and s.lossless and s.acceptance == "lossless"
    assert s.target_forwards == s.rounds + 1 == len(s.accepted_per_round) + 1
    assert s.mean_accept_len == acceptance.tau(s.accepted_per_round)
    j = s.to_json()
    assert j["mean_accept_len"] == round(s.mean_accept_len, 4) and j["target_forwards"] == s.target_forwards
    assert j["mode"] == "eagle" and j["lossless"] is True and j["draft_forwards"] == s.draft_forwards > 0
    assert mha.rt.generate(PROMPTS[0], max_new_tokens=4, mode="vanilla").stats.to_json()["mode"] == "vanilla"


# --------------------------------------------------------------------------- stream() carries its result


def test_stream_result_is_on_the_iterator(mha):
    rt = mha.rt
    s = rt.stream(PROMPTS[1], max_new_tokens=16)
    assert isinstance(s, Generation) and iter(s) is s
    with pytest.raises(RuntimeError, match="not finished"):
        s.result
    text = "".join(s)
    assert s.result.text == text and s.result.token_ids == rt.generate(PROMPTS[1], max_new_tokens=16).token_ids
    assert list(s) == [] and s.result.text == text  # exhausted: the result stays


# --------------------------------------------------------------------------- construction, not rewiring


def test_wrappers_and_observers_are_given_at_load(mha):
    wrapped, seen = [], []

    def wrap(backend):
        wrapped.append(RecordingBackend(backend))
        return wrapped[-1]

    rt = EagleRuntime.load(mha.export_dir, threads=1, wrap_backend=wrap, **HEAD_TREE,
                           round_observers=[lambda tree, logits, v: seen.append((tree.size, logits.shape, v.accepted))])
    assert [w.name for w in wrapped] == [w.inner.name for w in wrapped] and len(wrapped) == 2
    assert rt.decoder.target is wrapped[0] and rt.decoder.drafter.backend is wrapped[1]
    r = rt.generate(PROMPTS[0], max_new_tokens=10)
    assert r.token_ids == mha.expected(PROMPTS[0], 10)
    assert len(seen) == r.stats.rounds and all(shape == (n, mha.manifest.dims.vocab) for n, shape, _ in seen)
    assert [a + 1 for _, _, a in seen][:-1] == r.stats.accepted_per_round[:-1]
    assert len(wrapped[1].calls) == r.stats.draft_forwards  # the Drafter protocol's forward count


# --------------------------------------------------------------------------- masks and trees


def test_tree_attention_mask_and_subtree():
    tree = DraftTree(np.array([9, 1, 2, 3, 4]), np.array([-1, 0, 0, 1, 3]), np.array([0, -1, -2, -1.5, -3]))
    mask = tree.attention_mask(4)
    assert mask.shape == (1, 5, 9) and mask[0, :, :4].all()
    np.testing.assert_array_equal(mask[0, :, 4:], tree.tree_mask)
    assert tree.kept([1, 4, 2]) == [0, 1, 2]  # node 4's parent 3 is not kept
    sub = tree.subtree([1, 3, 4])
    assert sub.tokens.tolist() == [9, 1, 3, 4] and sub.parents.tolist() == [-1, 0, 1, 2]
    np.testing.assert_array_equal(sub.scores, tree.scores[[0, 1, 3, 4]])


def test_verify_greedy_from_argmax_equals_from_logits():
    rng = np.random.default_rng(0)
    tree = DraftTree(np.array([0, 3, 5, 3, 1]), np.array([-1, 0, 0, 1, 1]), -np.arange(5, dtype=np.float32))
    for _ in range(50):
        logits = rng.standard_normal((5, 6)).astype(np.float32)
        logits[0, 3] += rng.choice([0.0, 5.0])
        want = verify_greedy(tree, logits)
        assert verify_greedy(tree, argmax=logits.argmax(-1)) == want
    with pytest.raises(ValueError):
        verify_greedy(tree)


def test_expansion_mask():
    mask = expansion_mask(3, 5, [[], [4], [3, 4]])
    assert mask.shape == (1, 3, 8)
    assert mask[0, :, :3].all() and not mask[0, 0, 3:5].any() and mask[0, 1, 3:5].tolist() == [False, True]
    assert mask[0, 2, 3:5].all() and (mask[0, :, 5:] == np.eye(3, dtype=bool)).all()


def test_decoder_and_drafter_masks_come_from_the_one_home(mha):
    """The verification forward's mask is DraftTree.attention_mask; the prefill's causal_mask."""
    rec = []

    def wrap(backend):
        rec.append(RecordingBackend(backend))
        return rec[-1]

    trees = []
    rt = EagleRuntime.load(mha.export_dir, threads=1, wrap_backend=wrap, **HEAD_TREE,
                           round_observers=[lambda tree, logits, v: trees.append(tree)])
    rt.generate(PROMPTS[2], max_new_tokens=8)
    target_calls = rec[0].calls
    n = len(PROMPTS[2])
    np.testing.assert_array_equal(target_calls[0].attention_mask, causal_mask(0, n)[0])
    for call, tree in zip(target_calls[1:], trees):
        np.testing.assert_array_equal(call.attention_mask, tree.attention_mask(call.past)[0])
    assert len(target_calls) == 1 + len(trees) > 1
