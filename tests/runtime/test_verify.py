"""Verification: exact accepted lengths on hand-built logits, and the greedy tie-break (lower
token id) in the verifier, in vanilla decoding, and end to end with two identical LM-head
rows (adversarial drafts stay lossless, ties broken towards the lower id)."""
from __future__ import annotations

import numpy as np
import pytest

from eagle_deploy.contract import onnx_io as c
from eagle_deploy.runtime.sampling import SamplingParams, greedy_token, target_probs
from eagle_deploy.runtime.tree import DraftTree
from eagle_deploy.runtime.verify import verify_greedy, verify_sampling
from tests.helpers import ReferenceScript, ScriptedDrafter, hf_greedy, prefill

V = 16


def _logits(*argmaxes: int, tie: int | None = None) -> np.ndarray:
    """Row i has its maximum at argmaxes[i] (and also at `tie`, if given, for every row)."""
    rows = np.zeros((len(argmaxes), V), dtype=np.float32)
    for i, a in enumerate(argmaxes):
        rows[i, a] = 5.0
        if tie is not None:
            rows[i, tie] = 5.0
    return rows


@pytest.mark.parametrize("argmaxes, expect_path, expect_tokens", [
    # tree: 0 -> 1 (tok 3) -> 3 (tok 5); 0 -> 2 (tok 4) -> 4 (tok 6)
    ((3, 5, 9, 1, 2), [0, 1, 3], [3, 5, 1]),  # left chain fully accepted, bonus from node 3
    ((4, 5, 6, 1, 7), [0, 2, 4], [4, 6, 7]),  # right branch (second sibling) accepted
    ((3, 8, 9, 1, 2), [0, 1], [3, 8]),  # depth-2 rejected
    ((9, 5, 6, 1, 2), [0], [9]),  # every root child rejected: exactly one token
])
def test_verify_greedy_exact_paths(argmaxes, expect_path, expect_tokens):
    tree = DraftTree(np.array([0, 3, 4, 5, 6]), np.array([-1, 0, 0, 1, 2]), np.array([0, -1, -2, -2, -3]))
    v = verify_greedy(tree, _logits(*argmaxes))
    assert v.path == expect_path and v.tokens == expect_tokens
    assert v.accepted == len(expect_path) - 1 and v.bonus == expect_tokens[-1]


def test_verify_greedy_tie_goes_to_lower_id():
    # root logits tie between 7 and 3; the drafter ranked 7 first
    tree = DraftTree(np.array([0, 7, 3]), np.array([-1, 0, 0]), np.array([0.0, -0.1, -0.5]))
    v = verify_greedy(tree, _logits(7, 1, 2, tie=3))
    assert v.path == [0, 2] and v.tokens == [3, 2]
    assert greedy_token(_logits(7, tie=3)[0]) == 3
    root_only = verify_greedy(DraftTree.root_only(0), _logits(7, tie=3))
    assert root_only.tokens == [3]


def test_top_k_one_sampling_equals_greedy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(5, V)).astype(np.float32)
    tree = DraftTree.from_paths(0, [[int(np.argmax(logits[0])), 2], [1]])
    params = SamplingParams(temperature=0.9, top_k=1, seed=0)
    assert params.greedy
    assert verify_sampling(tree, logits, params, params.rng()) == verify_greedy(tree, logits)
    p = target_probs(_logits(7, tie=3)[0], params)
    assert p[3] == 1.0 and p.sum() == 1.0


# ---------------------------------------------------------------- end to end with tied rows


def test_tie_fixture_really_ties(tie):
    m = tie.model
    w = m.hf.lm_head.weight.detach().numpy()
    assert tie.low < tie.high and np.array_equal(w[tie.low], w[tie.high])
    ref = m.ref(tie.prompt, 8)
    assert ref[tie.k] == tie.low  # the plain loop (torch.argmax) takes the lower id
    be = m.backend()
    kv = be.allocate_kv(64)
    logits = prefill(be, kv, tie.prompt + ref[:tie.k])[c.LOGITS][0, -1]
    assert logits[tie.low] == logits[tie.high] == logits.max()  # bitwise tie in the ONNX graph too


N = 48


def test_tie_vanilla_and_eagle_pick_the_lower_id(tie):
    m = tie.model
    want = m.expected(tie.prompt, N)
    assert want[tie.k] == tie.low
    assert want == hf_greedy(m.hf, tie.prompt, N, m.eos_ids)
    rt = m.runtime()
    assert rt.generate(tie.prompt, max_new_tokens=N, mode="vanilla").token_ids == want
    assert rt.generate(tie.prompt, max_new_tokens=N).token_ids == want


@pytest.mark.parametrize("chain", [1, 3], ids=["tie-at-root-child", "tie-at-depth-3"])
@pytest.mark.parametrize("order", ["high-only", "high-first", "low-first"])
def test_tie_scripted_drafts_of_the_tied_pair(tie, order, chain):
    """Perfect chains of `chain` drafts, except where a chain covers the tie: there the
    drafter proposes the higher id (alone, or ranked above/below the lower id's chain). The
    higher id is always rejected and the lower accepted. With chain 1 the rounds root at
    positions 1, 3, ... so the tie (k = 3) is a root child; with chain 3 it is at depth 3."""
    m = tie.model
    ref = m.ref(tie.prompt, N + 8)
    assert tie.k == 3
    tie_rounds = []

    def paths(pos, r):
        lo = r[pos:pos + chain]
        if not pos <= tie.k < pos + chain:
            return [lo]
        i = tie.k - pos
        hi = lo[:i] + [tie.high] + lo[i + 1:]
        tie_rounds.append((pos, i))
        return {"high-only": [hi], "high-first": [hi, lo], "low-first": [lo, hi]}[order]

    rt = m.runtime(drafter=ScriptedDrafter(ReferenceScript(tie.prompt, ref, paths)))
    result = rt.generate(tie.prompt, max_new_tokens=N)
    assert result.token_ids == m.expected(tie.prompt, N)
    assert result.token_ids[tie.k] == tie.low
    (pos, i), = tie_rounds
    assert i == (0 if chain == 1 else 2)
    acc = result.stats.accepted_per_round
    round_index = (pos - 1) // (chain + 1)
    assert acc[:round_index] == [chain + 1] * round_index
    assert acc[round_index] == (i + 1 if order == "high-only" else chain + 1)
