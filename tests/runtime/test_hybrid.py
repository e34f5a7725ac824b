"""The hybrid drafter (runtime/hybrid.py): lookup chains merged into the head's tree, feedback
from the committed tokens, skipped head rounds whose features reach the head later, and
losslessness end to end (greedy = vanilla on EagleRuntime and BatchRuntime)."""
from __future__ import annotations

import numpy as np
import pytest

from eagle_deploy.contract.tree_config import TreeConfig
from eagle_deploy.runtime.costs import CostModel
from eagle_deploy.runtime.drafter import DraftRequest
from eagle_deploy.runtime.hybrid import HybridDrafter, make_drafter, merge_chain
from eagle_deploy.runtime.lookup import ContextLookup
from eagle_deploy.runtime.planner import Plan
from eagle_deploy.runtime.tree import DraftTree
from eagle_deploy.runtime.verify import verify_greedy
from tests.conftest import PROMPTS

CHEAP = CostModel({0: {1: 0.010, 16: 0.012}}, {0: 0.001})


def test_a_chain_shares_the_nodes_it_has_in_common_and_branches_after():
    head = DraftTree.from_paths(9, [[1, 2, 3], [4]])  # nodes: 9, 1, 2, 3, 4
    tree, origin = merge_chain(head, np.ones(head.size, np.int64), [1, 2, 7, 8], np.log([0.9, 0.8, 0.7, 0.6]))
    paths = {tuple(int(tree.tokens[j]) for j in tree.path_to(i)[1:]) for i in range(1, tree.size)}
    assert paths == {(1,), (1, 2), (1, 2, 3), (4,), (1, 2, 7), (1, 2, 7, 8)}
    assert tree.size == 7  # two new nodes, siblings distinct (DraftTree checks it)
    by_path = {tuple(int(tree.tokens[j]) for j in tree.path_to(i)[1:]): int(origin[i]) for i in range(1, tree.size)}
    assert by_path == {(1,): 3, (1, 2): 3, (1, 2, 3): 1, (4,): 1, (1, 2, 7): 2, (1, 2, 7, 8): 2}
    node_1 = [i for i in range(tree.size) if tree.parents[i] == 0 and tree.tokens[i] == 1][0]
    assert tree.scores[node_1] == pytest.approx(max(head.scores[1], np.log(0.9)))


def test_a_chain_below_a_root_only_tree_is_a_chain():
    tree, origin = merge_chain(DraftTree.root_only(5), np.full(1, 3), [6, 6, 6], np.zeros(3))
    assert tree.tokens.tolist() == [5, 6, 6, 6] and tree.parents.tolist() == [-1, 0, 1, 2]
    assert origin.tolist() == [3, 2, 2, 2]


def test_greedy_verification_takes_the_lookup_branch_when_the_target_agrees():
    """Hand-built logits: the target continues 1 -> 2 -> 7 -> 8; the head guessed 1 -> 2 -> 3."""
    head = DraftTree.from_paths(9, [[1, 2, 3], [4]])
    tree, _ = merge_chain(head, np.ones(head.size, np.int64), [1, 2, 7, 8], np.zeros(4))
    nxt = {(): 1, (1,): 2, (1, 2): 7, (1, 2, 7): 8, (1, 2, 7, 8): 5}
    logits = np.full((tree.size, 16), -5.0, np.float32)
    for i in range(tree.size):
        path = tuple(int(tree.tokens[j]) for j in tree.path_to(i)[1:])
        logits[i, nxt.get(path, 0)] = 5.0
    v = verify_greedy(tree, logits)
    assert v.tokens == [1, 2, 7, 8, 5] and v.accepted == 4


class FakeHead:
    """An EagleDrafter stand-in: records its requests, proposes a fixed chain."""

    def __init__(self, chain):
        self.chain, self.requests, self.forwards, self.tree = chain, [], 0, TreeConfig("dynamic", 4, 3, 1)

    def reset(self):
        self.forwards = 0

    def propose(self, request):
        self.requests.append(request)
        self.forwards += 1
        return DraftTree.from_paths(int(request.committed[-1]), [self.chain[: request.max_depth]])


def request(committed, features, max_nodes=64, max_depth=16):
    return DraftRequest(committed, features, len(committed) - 1, max_nodes, max_depth)


def test_feedback_counts_how_deep_each_source_was_accepted():
    head = FakeHead([4, 9, 9])
    d = HybridDrafter(head, ContextLookup(1, 3), head.tree, planned=False)
    committed = [1, 2, 3, 4, 5, 1, 2, 3]  # lookup: [4, 5, 1, 2, 3, ...]; head: [4, 9, 9]
    tree = d.propose(request(committed, np.zeros((8, 2), np.float32)))
    plan = d.plans[-1]
    assert plan.lookup >= 3 and plan.head_depth == 3
    seen = []
    d.planner.record = lambda p, h, look, n, alternate=None: seen.append((p, h, look, n))
    # the target accepted 4, 5 (head shares only the 4) and chose 7 as the bonus
    d.propose(request(committed + [4, 5, 7], np.zeros((3, 2), np.float32)))
    assert seen[0][1:3] == (1, 2) and seen[0][3] == 3  # head depth 1, lookup depth 2, a 3-gram match
    assert tree.size == 1 + 3 + (plan.lookup - 1)


def test_alternate_continuations_hang_beside_the_chain_within_the_node_budget():
    head = FakeHead([9, 9, 9])
    d = HybridDrafter(head, ContextLookup(1, 3, candidates=3), head.tree, planned=False, alternates=2,
                      alternate_len=2)
    #            the 1-gram [1] was followed by 2 (latest), 3 and 4: main chain 2 ..., alternates 3 ..., 4 ...
    committed = [1, 4, 5, 7, 1, 3, 7, 8, 1, 2, 6, 6, 1]
    tree = d.propose(request(committed, np.zeros((13, 2), np.float32)))
    _, _, origin, _, _, _ = d._last
    paths = {tuple(int(tree.tokens[j]) for j in tree.path_to(i)[1:]): int(origin[i]) for i in range(1, tree.size)}
    assert paths[(2, 6, 6, 1)] == 2 and paths[(3, 7)] == 4 and paths[(4, 5)] == 4  # alternates cut to 2 tokens
    assert (3, 7, 8) not in paths and paths[(9, 9, 9)] == 1
    depth1 = {int(tree.tokens[i]): float(tree.scores[i]) for i in range(tree.size) if tree.parents[i] == 0}
    assert depth1[2] > depth1[3] > depth1[4]  # the main chain first, then the alternates by rank
    small = d.propose(request(committed, np.zeros((1, 2), np.float32), max_nodes=9))
    assert small.size == 9  # root + head 3 + chain 4: the first alternate gets the one node left
    assert sorted(int(small.tokens[i]) for i in range(small.size) if small.parents[i] == 0) == [2, 3, 9]


def test_the_planner_pays_for_the_alternates_rows():
    from eagle_deploy.runtime.planner import DraftPlanner

    seen = []

    class Costs:
        def draft(self, past):
            return 0.001

        def verify(self, rows, past):
            seen.append(np.array(rows))
            return 0.01 + 0.001 * np.asarray(rows, float)

    p = DraftPlanner(0, 1, 1, 8, Costs(), alternate_len=4)
    assert p.alternate_rows(0, 2) == 0 and p.alternate_rows(3, 2) == 6 and p.alternate_rows(6, 2) == 8
    p.choose(6, 3, 0, alternates=2)
    assert seen[-1][0].tolist() == [1, 2 + 2, 3 + 4, 4 + 6, 5 + 8, 6 + 8, 7 + 8]  # root + k + alternates
    p.choose(6, 3, 0)
    assert seen[-1][0].tolist() == [1, 2, 3, 4, 5, 6, 7]


def test_rounds_without_the_head_keep_their_features_for_its_next_extension():
    head = FakeHead([4])
    d = HybridDrafter(head, None, head.tree, planned=True, costs=CHEAP)
    plans = iter([Plan(0, 0, 0), Plan(0, 0, 0), Plan(3, 3, 0)])
    d.planner.choose = lambda available, ngram=1, past=0, alternates=0: next(plans)
    f = [np.full((k, 2), i, np.float32) for i, k in enumerate((6, 1, 2))]
    committed = list(range(1, 7))
    for i, feats in enumerate(f):
        tree = d.propose(request(committed, feats))
        committed = committed + [10 + i] * (feats.shape[0] if i < 2 else 0)
        assert tree.size == (1 if i < 2 else 2)
    (req,) = head.requests
    assert np.array_equal(req.features, np.concatenate(f))  # 6 + 1 + 2 rows, in order
    assert req.max_depth == 3 and req.max_nodes == 4


def test_make_drafter_kinds():
    head = FakeHead([1])
    assert make_drafter("eagle", head, head.tree, planned=False) is head
    assert make_drafter("lookup", None, head.tree, planned=False).head is None
    assert make_drafter("hybrid", head, head.tree, planned=False).lookup is not None
    assert make_drafter("hybrid", head, head.tree, planned=False).alternates == 2
    row_exact = make_drafter("hybrid", head, head.tree, planned=False, one_path=True)
    assert row_exact.alternates == 0 and row_exact.lookup.candidates == 1  # never accepted past one token
    with pytest.raises(ValueError, match="needs the draft graph"):
        make_drafter("hybrid", None, head.tree)
    with pytest.raises(ValueError, match="drafter must be one of"):
        make_drafter("medusa", head, head.tree)
    with pytest.raises(ValueError, match="CostModel"):
        HybridDrafter(head, None, head.tree, planned=True)


# ---------------------------------------------------------------- end to end: lossless


REPEATING = PROMPTS[1] + PROMPTS[0] + PROMPTS[1] + PROMPTS[0][:3]  # lookup finds matches in the prompt


@pytest.mark.parametrize("kind", ["hybrid", "lookup", "eagle"])
@pytest.mark.parametrize("planned", [True, False], ids=["planned", "always"])
def test_greedy_output_is_vanilla_greedy(model, kind, planned):
    rt = model.runtime(drafter_kind=kind, planned=planned)
    for prompt in (PROMPTS[0], REPEATING):
        r = rt.generate(prompt, max_new_tokens=48)
        want = model.ref(prompt)[: len(r.token_ids)]
        assert r.token_ids == want and r.stats.new_tokens == 48 or r.finish_reason == "stop"
        v = rt.generate(prompt, max_new_tokens=48, mode="vanilla")
        assert r.token_ids == v.token_ids
        assert r.stats.to_json()["drafter"] == kind and v.stats.drafter is None  # what drafted, in the JSON
        assert sum(r.stats.accepted_per_round) == r.stats.new_tokens - 1
        assert len(r.stats.tree_size_per_round) == r.stats.rounds
        assert r.stats.draft_rounds == sum(n > 1 for n in r.stats.tree_size_per_round)
        if not planned and kind != "lookup":  # (lookup drafts only where the context matches)
            assert r.stats.draft_rounds >= r.stats.rounds - 1  # drafts whenever there is room
    if kind == "lookup":
        assert r.stats.draft_forwards == 0 and rt.decoder.drafter.head is None


def test_lookup_tokens_are_accepted_on_a_repeating_continuation(gqa):
    """Random tiny targets fall into loops: once the output repeats, lookup chains hold."""
    rt = gqa.runtime(drafter_kind="lookup", planned=False)
    r = rt.generate(PROMPTS[2], max_new_tokens=80)
    assert r.token_ids == gqa.ref(PROMPTS[2])[:80]
    assert max(r.stats.accepted_per_round) >= 3 and r.stats.mean_accept_len > 1.2


def test_seeded_sampling_repeats_on_one_planned_runtime(mha):
    rt = mha.runtime(drafter_kind="hybrid", planned=True)
    a = rt.generate(REPEATING, max_new_tokens=32, temperature=0.8, seed=7)
    b = rt.generate(REPEATING, max_new_tokens=32, temperature=0.8, seed=7)
    assert a.token_ids == b.token_ids and a.stats.accepted_per_round == b.stats.accepted_per_round


def test_batched_hybrid_greedy_equals_vanilla(gqa):
    from eagle_deploy.runtime.batch import BatchRuntime

    eng = BatchRuntime.load(gqa.export_dir, 3, threads=1, drafter_kind="hybrid", planned=True)
    prompts = [PROMPTS[0], REPEATING, PROMPTS[2], PROMPTS[1]]
    results = eng.generate_many(prompts, max_new_tokens=40)
    for prompt, r in zip(prompts, results):
        assert r.token_ids == gqa.ref(prompt)[: len(r.token_ids)] and len(r.token_ids) == 40
    assert all(isinstance(rt.decoder.drafter, HybridDrafter) for rt in eng.runtimes)
    assert {r.stats.drafter for r in results} == {"hybrid"}
    assert len({id(rt.decoder.drafter.planner.costs) for rt in eng.runtimes}) == 1  # one device cost model


# ---------------------------------------------------------------- statistical: mixed siblings

V16_REPEATING = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7]
N_MIXED = 6000


class _Watch:
    """Wraps a drafter; counts rounds whose tree holds a lookup node beside a head node at depth 1,
    and rounds with two or more lookup nodes at depth 1 (alternate continuations)."""

    def __init__(self, inner):
        self.inner, self.mixed, self.rounds, self.lookup_siblings = inner, 0, 0, 0
        self.forwards = 0

    def reset(self):
        self.inner.reset()

    def propose(self, request):
        tree = self.inner.propose(request)
        origin = self.inner._last[2]
        depth1 = [i for i in range(tree.size) if tree.parents[i] == 0]
        self.rounds += 1
        self.mixed += any(not origin[i] & 1 for i in depth1) and any(origin[i] & 1 for i in depth1)
        self.lookup_siblings += sum(bool(origin[i] & 6) for i in depth1) >= 2
        return tree


@pytest.mark.statistical
@pytest.mark.parametrize("alternates", [0, 2], ids=["one-chain", "alternates"])
def test_sampling_over_mixed_head_and_lookup_siblings_follows_the_target(v16, alternates):
    """t0 from the prefill, then (t1, t2) through trees holding the head's top-k AND a context-
    lookup chain as siblings: their joint, marginalised over t0, matches the target's exactly
    (recursive rejection treats every deterministic sibling alike)."""
    import torch

    from eagle_deploy.runtime.backends import load_backend
    from eagle_deploy.runtime.drafter import EagleDrafter
    from tests.runtime.stats import chi2_pvalue, counts_of, ref_probs, total_variation, tv_noise

    T, V, P = 0.9, 16, V16_REPEATING
    with torch.no_grad():
        l0 = v16.hf(torch.tensor([P])).logits[0, -1].double().numpy()
        l1 = v16.hf(torch.tensor([P + [a] for a in range(V)])).logits[:, -1].double().numpy()
        l2 = v16.hf(torch.tensor([P + [a, b] for a in range(V) for b in range(V)])).logits[:, -1].double().numpy()
    joint = np.einsum("a,ab,abc->bc", ref_probs(l0, T), ref_probs(l1, T), ref_probs(l2.reshape(V, V, V), T))
    manifest = v16.manifest
    tree = TreeConfig("dynamic", 4, 2, 2)
    head = EagleDrafter.for_export(load_backend("ort", v16.export_dir, manifest, "draft", 1), tree, manifest)
    drafter = _Watch(HybridDrafter(head, ContextLookup(1, 3, candidates=1 + alternates), tree, planned=False,
                                   max_lookup=3, alternates=alternates, alternate_len=2))
    rt = v16.runtime(drafter=drafter)
    pairs = np.empty(N_MIXED, np.int64)
    for s in range(N_MIXED):
        r = rt.generate(P, max_new_tokens=3, temperature=T, seed=s)
        pairs[s] = r.token_ids[1] * V + r.token_ids[2]
    counts = counts_of(pairs, V * V)
    p, tv = chi2_pvalue(counts, joint.ravel()), total_variation(counts, joint.ravel())
    bound = tv_noise(joint.ravel(), N_MIXED)
    assert p > 1e-3 and tv < bound, f"chi-square p={p:.2e}, TV={tv:.4f} (exact-sampler 99.9% TV {bound:.4f})"
    assert drafter.mixed > 0.3 * drafter.rounds  # lookup and head siblings really were verified together
    if alternates:  # and several lookup continuations side by side
        assert drafter.lookup_siblings > 0.3 * drafter.rounds


def test_device_costs_are_measured_once_and_cached(mha, tmp_path, monkeypatch):
    """The first planned runtime measures and caches; the next one (another process alike)
    reads the same costs; a damaged entry is measured again; tuning curves take precedence."""
    from eagle_deploy.runtime import costs

    monkeypatch.setenv("EAGLE_DEPLOY_CACHE", str(tmp_path / "cache"))
    calls = []
    real = costs.measure_costs
    monkeypatch.setattr(costs, "measure_costs", lambda *a, **k: calls.append(k) or real(*a, **k))
    first = mha.runtime(drafter_kind="hybrid", planned=True).costs
    (entry,) = (tmp_path / "cache" / "costs").glob("*.json")
    second = mha.runtime(drafter_kind="hybrid", planned=True).costs
    assert len(calls) == 1 and second.to_json() == first.to_json()
    assert len(first.pasts) == 2 and first.pasts[0] == 64 < first.pasts[1]  # two context lengths measured
    entry.write_text("{not json")
    mha.runtime(drafter_kind="hybrid", planned=True)
    assert len(calls) == 2 and CostModel.from_json(__import__("json").loads(entry.read_text()))
    assert mha.runtime().costs is None  # the plain EAGLE tree plans nothing, measures nothing
    assert len(calls) == 2


def test_alternatives_are_learnt_from_the_committed_tokens_even_when_not_drafted():
    head = FakeHead([9, 9, 9])
    d = HybridDrafter(head, ContextLookup(1, 3, candidates=3), head.tree, planned=False, alternates=2,
                      alternate_len=3)
    d.planner.full = lambda available, alternates=0: Plan(0, 0, available)  # the chain alone, no alternates
    committed = [1, 4, 5, 7, 1, 3, 7, 8, 1, 2, 6, 6, 1]  # after 1: 2 6 6 1 (chain), 3 7 8, 4 5 7 (alternates)
    tree = d.propose(request(committed, np.zeros((13, 2), np.float32)))
    assert sorted(int(tree.tokens[i]) for i in range(tree.size) if tree.parents[i] == 0) == [2]
    seen = []
    d.planner.record = lambda p, h, look, n, alternate=None: seen.append(alternate)
    d.propose(request(committed + [3, 7, 5], np.zeros((3, 2), np.float32)))  # the target went 3 7, bonus 5
    assert seen == [(3, 2)]  # the best alternative (3 7 8) matched two tokens, failed at the third
