"""The EAGLE draft loop: the token shift between features and tokens in what the draft
graph is fed, stale draft KV (the draft KV after every round against a fresh draft forward),
and determinism within a process, across processes, and across requests."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from eagle_deploy.contract.tree_config import TreeConfig
from eagle_deploy.runtime.drafter import EagleDrafter
from tests.conftest import PROMPTS, THREADS
from tests.helpers import (
    CommitSpy,
    ForcingDrafter,
    RecordingBackend,
    ReferenceScript,
    assert_kv_close,
    causal_mask,
    hf_draft_features,
    kv_rows,
    run_step,
    wrong_token,
)

ATOL = 1e-4


def _forced_runtime(model, paths, prompt, ref, tree: TreeConfig | None = None):
    """A runtime whose real EagleDrafter (draft backend recorded) runs every round, while
    verification gets the scripted tree."""
    m = model.manifest
    draft_be = RecordingBackend(model.backend("draft"))
    tree = tree or m.tree
    inner = EagleDrafter.for_export(draft_be, tree, m)
    forcing = ForcingDrafter(inner, ReferenceScript(prompt, ref, paths))
    return model.runtime(drafter=forcing, tree=tree), forcing, draft_be


def _accept_two(pos, ref):
    """Accept two drafts, then a wrong one: the round commits [a1, a2, bonus]."""
    return [ref[pos:pos + 2] + [wrong_token(ref[pos + 2])]]


def test_token_shift(model):
    prompt = PROMPTS[0]  # [t0..t4]
    assert len(prompt) == 5
    ref = model.ref(prompt, 16)
    t5, a1, a2, b = ref[:4]
    rt, forcing, draft_be = _forced_runtime(model, _accept_two, prompt, ref)
    result = rt.generate(prompt, max_new_tokens=8)
    assert result.token_ids == ref[:8]
    assert result.stats.accepted_per_round[0] == 3
    h = hf_draft_features(model, prompt + [t5, a1, a2])  # target features at positions 0..7
    first = draft_be.calls[forcing.call_marks[0]]
    assert first.input_ids.tolist() == prompt[1:] + [t5]
    assert first.position_ids.tolist() == [0, 1, 2, 3, 4] and first.past == 0
    np.testing.assert_array_equal(first.attention_mask, causal_mask(0, 5)[0])
    np.testing.assert_allclose(first.features, h[:5], rtol=0, atol=ATOL)
    second = draft_be.calls[forcing.call_marks[1]]
    assert second.input_ids.tolist() == [a1, a2, b]
    assert second.position_ids.tolist() == [5, 6, 7] and second.past == 5
    np.testing.assert_array_equal(second.attention_mask, causal_mask(5, 3)[0])
    np.testing.assert_allclose(second.features, h[5:8], rtol=0, atol=ATOL)


def test_tree_expansion_inputs(model):
    """Expansion calls after the extension: depth-d nodes at position root + d - 1, fed the
    head's own predicted feature of their parent, seeing committed rows and their ancestors only."""
    prompt = PROMPTS[1]
    ref = model.ref(prompt, 24)
    rt, forcing, draft_be = _forced_runtime(model, _accept_two, prompt, ref, tree=TreeConfig("dynamic", 20, 4, 3))
    rt.generate(prompt, max_new_tokens=16)
    ext_i = forcing.call_marks[0]
    expansions = draft_be.calls[ext_i + 1:forcing.call_marks[1]]
    assert len(expansions) == 3  # depth 4: one extension + 3 expansions
    root_pos = len(prompt)
    for d, call in enumerate(expansions, start=1):
        assert call.position_ids.tolist() == [root_pos + d - 1] * 3  # top_k frontier nodes per depth
        assert call.past == root_pos + 3 * (d - 1)  # committed rows + earlier scratch rows
        mask = call.attention_mask
        assert mask.shape == (3, call.past + 3)
        assert mask[:, :root_pos].all()  # every committed row
        np.testing.assert_array_equal(mask[:, call.past:], np.eye(3, dtype=bool))  # itself, not its siblings
        assert mask[:, root_pos:call.past].sum(axis=1).tolist() == [d - 1] * 3  # its d - 1 draft ancestors
        if d >= 2:  # the ancestors seen are one node per earlier depth
            for row in mask[:, root_pos:call.past]:
                assert [int(row[3 * e:3 * e + 3].sum()) for e in range(d - 1)] == [1] * (d - 1)


class _TreeRecorder:
    """Wraps an EagleDrafter and keeps every (request, tree)."""

    def __init__(self, inner):
        self.inner, self.seen = inner, []

    forwards = property(lambda self: self.inner.forwards)

    def reset(self):
        self.inner.reset()

    def propose(self, request):
        tree = self.inner.propose(request)
        self.seen.append((list(request.committed), request.root_position, tree))
        return tree


def _sequential_scores(model, committed, root_pos, tree):
    """Reference cumulative draft log-probabilities of every tree node, each computed by its
    own chain of single-token draft calls (no tree mask): the committed pairs (target feature
    at p, token at p + 1), then the node's ancestors fed with the head's predicted features."""
    be = model.backend("draft")
    h = hf_draft_features(model, committed[:-1])
    scores = np.zeros(tree.size)
    top_ids = {}
    for node in range(tree.size):
        path = tree.path_to(node)
        kv = be.allocate_kv(root_pos + len(path))
        out = run_step(be, kv, committed[1:root_pos + 1], np.arange(root_pos), causal_mask(0, root_pos), 0,
                       logits_at=[root_pos - 1], features=h[:root_pos])
        feat, total = out["next_features"][0, -1], 0.0
        for depth, child in enumerate(path[1:]):
            lp = dict(zip(out["topk_ids"][0, -1].tolist(), out["topk_logprobs"][0, -1].tolist()))
            top_ids.setdefault(path[depth], list(lp))
            total += lp[int(tree.tokens[child])]  # KeyError: the child is not in its parent's top-k
            p = root_pos + depth
            out = run_step(be, kv, [int(tree.tokens[child])], [p], causal_mask(p, 1), p, logits_at=[0],
                           features=feat[None], from_target=False)
            feat = out["next_features"][0, -1]
        scores[node] = total
    return scores, top_ids


@pytest.mark.parametrize("tree_name", ["dynamic", "eagle1"])
def test_draft_tree_scores_equal_a_sequential_reference(model, tree_name):
    """Every node's cumulative draft log-probability equals the head's own prediction along
    that node's path computed one token at a time; expanded nodes' children are the top of
    their parent's distribution (static: at the ranks the choices name)."""
    m = model.manifest
    tree_cfg = TreeConfig("dynamic", 24, 4, 4) if tree_name == "dynamic" else TreeConfig.static("eagle1")
    recorder = _TreeRecorder(EagleDrafter.for_export(model.backend("draft"), tree_cfg, m))
    prompt = PROMPTS[2]
    rt = model.runtime(drafter=recorder, tree=tree_cfg)
    assert rt.generate(prompt, max_new_tokens=16).token_ids == model.expected(prompt, 16)
    for committed, root_pos, tree in recorder.seen[:2]:
        assert tree.size == tree_cfg.total_tokens
        # static trees keep every choice; dynamic ones rerank by score (deep nodes may drop out)
        assert (int(tree.depths.max()) == tree_cfg.depth if tree_name == "eagle1"
                else 2 <= int(tree.depths.max()) <= tree_cfg.depth)
        scores, top_ids = _sequential_scores(model, committed, root_pos, tree)
        np.testing.assert_allclose(tree.scores, scores, rtol=0, atol=ATOL)
        for node in range(tree.size):
            kids = [int(tree.tokens[k]) for k in tree.children(node)]
            if not kids:
                continue
            ranks = sorted(top_ids[node].index(t) for t in kids)
            if tree_name == "dynamic":
                assert ranks == list(range(len(kids)))  # the best children, none skipped
            else:
                prefix = _static_prefix(tree, node, top_ids)
                assert ranks == sorted(c[-1] for c in tree_cfg.choices if c[:-1] == prefix)


def _static_prefix(tree, node, top_ids) -> tuple:
    """The choice path (child ranks) of `node` in a static tree."""
    ranks = []
    for parent, child in zip(tree.path_to(node), tree.path_to(node)[1:]):
        ranks.append(top_ids[parent].index(int(tree.tokens[child])))
    return tuple(ranks)


# ---------------------------------------------------------------- draft KV is never stale


def _perfect(pos, ref):
    return [ref[pos:pos + 4]]


def _mixed(pos, ref):
    """Rounds alternate between accepting 0, 2 and 4 drafts."""
    k = [0, 2, 4][pos % 3]
    return [ref[pos:pos + k] + [wrong_token(ref[pos + k])]]


@pytest.mark.parametrize("kind", ["eagle-only", "perfect", "mixed"])
def test_draft_kv_equals_fresh_draft_forward_every_round(model, kind):
    prompt = PROMPTS[2]
    ref = model.ref(prompt, 48)
    if kind == "eagle-only":
        rt = model.runtime()
    else:
        rt, _, _ = _forced_runtime(model, _perfect if kind == "perfect" else _mixed, prompt, ref)
    spy = CommitSpy(rt.decoder)
    result = rt.generate(prompt, max_new_tokens=32)
    assert result.token_ids == model.expected(prompt, 32)
    committed = spy.rounds[-1].committed
    feats = hf_draft_features(model, committed[:-1])
    be = model.backend("draft")
    fresh = be.allocate_kv(model.manifest.max_length)
    n = max(r.draft_len for r in spy.rounds)
    run_step(be, fresh, committed[1:n + 1], np.arange(n), causal_mask(0, n), 0, logits_at=[n - 1], features=feats[:n])
    lens = [r.draft_len for r in spy.rounds]
    assert lens == sorted(lens) and lens[0] == len(prompt)
    for r in spy.rounds:
        # the drafter has been fed every pair up to this round's root (the last round may skip it)
        assert r.draft_len == r.target_len - len(r.chunk) or r is spy.rounds[-1]
        assert_kv_close(r.draft_kv, kv_rows(fresh, r.draft_len), atol=ATOL,
                        what=f"draft KV after round ending at {r.target_len}")
    if kind != "eagle-only":
        assert max(len(r.chunk) for r in spy.rounds) >= 3


# ---------------------------------------------------------------- determinism

SAMPLED = {"temperature": 0.8, "top_p": 0.95, "seed": 1234}


def _signature(rt, prompt, **kw):
    r = rt.generate(prompt, max_new_tokens=32, **kw)
    return r.token_ids, r.stats.accepted_per_round


def _counters(rt, prompt, **kw) -> dict:
    """Everything a request reports that does not depend on timing."""
    r = rt.generate(prompt, max_new_tokens=32, **kw)
    keep = ("prompt_tokens", "new_tokens", "finish_reason", "target_forwards", "draft_forwards", "mean_accept_len",
            "accepted_per_round", "tree_depth_per_round")
    return {"tokens": r.token_ids, **{k: r.stats.to_json().get(k) for k in keep}}


@pytest.mark.parametrize("kw", [{}, SAMPLED], ids=["greedy", "sampled"])
def test_same_prompt_twice_in_one_process(model, kw):
    rt = model.runtime()
    first = _signature(rt, PROMPTS[0], **kw)
    assert _signature(rt, PROMPTS[0], **kw) == first
    assert len(first[0]) == 32 or first[0][-1] in model.eos_ids


@pytest.mark.parametrize("kw", [{}, SAMPLED], ids=["greedy", "sampled"])
def test_request_b_after_a_equals_b_fresh(model, kw):
    a, b = PROMPTS[2], PROMPTS[1]
    rt = model.runtime()
    rt.generate(a, max_new_tokens=40, **kw)
    rt.generate(a, max_new_tokens=7, mode="vanilla")
    after_a = _counters(rt, b, **kw)
    fresh = _counters(model.runtime(), b, **kw)
    assert after_a == fresh  # per-request counters included (draft_forwards is not cumulative)
    rounds = len(fresh["accepted_per_round"])
    assert 0 < fresh["draft_forwards"] <= 4 * rounds  # depth-4 tree: at most 1 extension + 3 expansions per round
    if not kw:
        assert after_a["tokens"] == model.expected(b, 32)


def test_fresh_process_gives_identical_tokens(mha):
    script = (
        "import json, sys\n"
        "from eagle_deploy.runtime.api import EagleRuntime\n"
        f"rt = EagleRuntime.load(sys.argv[1], threads={THREADS}, drafter_kind='eagle', planned=False)\n"
        "out = []\n"
        "for prompt in json.loads(sys.argv[2]):\n"
        "    for kw in json.loads(sys.argv[3]):\n"
        "        r = rt.generate(prompt, max_new_tokens=32, **kw)\n"
        "        out.append([r.token_ids, r.stats.accepted_per_round])\n"
        "print(json.dumps(out))\n"
    )
    prompts, kws = PROMPTS[:2], [{}, SAMPLED]
    proc = subprocess.run([sys.executable, "-c", script, str(mha.export_dir), json.dumps(prompts), json.dumps(kws)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    rt = mha.runtime()
    ours = [list(_signature(rt, p, **kw)) for p in prompts for kw in kws]
    assert theirs == ours
    assert theirs[1][0] != theirs[0][0]  # the sampled run really sampled
