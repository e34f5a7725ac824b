"""Greedy EAGLE decoding is lossless: token for token equal to vanilla greedy on the same
engine and to a plain transformers greedy loop, for dynamic and static trees, MHA and GQA,
and under adversarial scripted drafts."""
from __future__ import annotations

import pytest

from eagle_deploy.contract.tree_config import TreeConfig
from tests.conftest import PROMPTS
from tests.helpers import ReferenceScript, ScriptedDrafter, wrong_token

N = 64
TREES = {
    "dynamic-default": None,  # the manifest's tree (dynamic 16/4/4)
    "dynamic-wide": TreeConfig("dynamic", total_tokens=60, depth=6, top_k=8),
    "dynamic-chain": TreeConfig("dynamic", total_tokens=6, depth=5, top_k=1),
    "dynamic-depth-1": TreeConfig("dynamic", total_tokens=9, depth=1, top_k=8),
    "dynamic-root-only": TreeConfig("dynamic", total_tokens=1, depth=3, top_k=2),
    "eagle1": TreeConfig.static("eagle1"),
}


@pytest.fixture(scope="module", params=["mha", "gqa", "gqa_standard"])
def model(request):
    """Both tiny targets as the default fp32 graph (fused operators, shared KV), and the GQA one
    as the standard-op graph (sequence-major KV)."""
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def runtimes():
    cache = {}

    def get(model, tree_name):
        key = (model.name, tree_name)
        if key not in cache:
            cache[key] = model.runtime(tree=TREES[tree_name])
        return cache[key]

    return get


@pytest.mark.parametrize("tree_name", list(TREES))
@pytest.mark.parametrize("prompt", PROMPTS, ids=[f"p{i}" for i in range(len(PROMPTS))])
def test_eagle_equals_vanilla_equals_hf(model, runtimes, tree_name, prompt):
    rt = runtimes(model, tree_name)
    eagle = rt.generate(prompt, max_new_tokens=N)
    vanilla = rt.generate(prompt, max_new_tokens=N, mode="vanilla")
    want = model.expected(prompt, N)
    assert vanilla.token_ids == want
    assert eagle.token_ids == want
    assert eagle.finish_reason == vanilla.finish_reason == ("stop" if want[-1] in model.eos_ids else "length")
    stats = eagle.stats
    assert stats.new_tokens == len(want)
    assert sum(stats.accepted_per_round) == len(want) - 1  # the first token comes from prefill
    assert stats.draft_forwards > 0
    assert max(stats.tree_depth_per_round) <= rt.tree.depth
    if rt.tree.total_tokens == 1:
        assert stats.tree_depth_per_round == [0] * len(stats.accepted_per_round)  # root-only trees
    assert vanilla.stats.target_forwards == len(want)  # vanilla: one token per target forward


def test_static_tree_shape(mha, runtimes):
    rt = runtimes(mha, "eagle1")
    assert rt.tree.kind == "static" and rt.tree.total_tokens == 26 and rt.tree.depth == 5
    stats = rt.generate(PROMPTS[0], max_new_tokens=8).stats
    assert stats.tree_depth_per_round[0] == 5  # a random head still fills every static choice
    assert stats.draft_forwards <= 5 * stats.target_forwards


# ---------------------------------------------------------------- adversarial scripted drafts


def _always_wrong(pos, ref):
    """The same wrong token at every depth (a chain of depth 5)."""
    return [[wrong_token(ref[pos])] * 5]


def _single_wrong_node(pos, ref):
    return [[wrong_token(ref[pos])]]


def _root_only(pos, ref):
    return []


def _all_root_children_wrong(pos, ref):
    """Four wrong root children; under each, the true continuation (which must not be
    accepted through a rejected parent)."""
    truth = ref[pos:pos + 4]
    wrongs = [t for t in range(250, 240, -1) if t != ref[pos]][:4]
    return [[w] + truth[1:] for w in wrongs] + [[w, truth[0]] for w in wrongs]


def _perfect(depth):
    def paths(pos, ref):
        return [ref[pos:pos + depth]]
    return paths


def _correct_second_sibling(pos, ref):
    """The true chain ranked below a wrong sibling at every depth (scattered accepted path)."""
    truth = ref[pos:pos + 4]
    return [[wrong_token(truth[0])], [truth[0], wrong_token(truth[1])], truth[:2] + [wrong_token(truth[2])], truth]


ADVERSARIAL = {
    "always-wrong": (_always_wrong, lambda acc: all(a == 1 for a in acc)),
    "single-wrong-node": (_single_wrong_node, lambda acc: all(a == 1 for a in acc)),
    "root-only": (_root_only, lambda acc: all(a == 1 for a in acc)),
    "all-root-children-wrong": (_all_root_children_wrong, lambda acc: all(a == 1 for a in acc)),
    "perfect-depth-5": (_perfect(5), lambda acc: all(a == 6 for a in acc[:-1]) and 1 <= acc[-1] <= 6),
    "correct-second-sibling": (_correct_second_sibling,
                               lambda acc: all(a == 5 for a in acc[:-1]) and 1 <= acc[-1] <= 5),
}


@pytest.mark.parametrize("name", list(ADVERSARIAL))
@pytest.mark.parametrize("prompt", PROMPTS[:2], ids=["p0", "p1"])
def test_scripted_drafts_stay_lossless(model, name, prompt):
    paths, accept_ok = ADVERSARIAL[name]
    ref = model.ref(prompt, N + 8)
    script = ReferenceScript(prompt, ref, paths)
    rt = model.runtime(drafter=ScriptedDrafter(script))
    result = rt.generate(prompt, max_new_tokens=N)
    want = model.expected(prompt, N)
    assert result.token_ids == want
    assert rt.generate(prompt, max_new_tokens=N, mode="vanilla").token_ids == want
    acc = result.stats.accepted_per_round
    assert script.requests >= 1
    assert sum(acc) == len(want) - 1
    assert accept_ok(acc), acc


def test_fully_wrong_round_commits_exactly_one_token(model):
    prompt = PROMPTS[0]
    ref = model.ref(prompt, N + 8)
    rt = model.runtime(drafter=ScriptedDrafter(ReferenceScript(prompt, ref, _all_root_children_wrong)))
    result = rt.generate(prompt, max_new_tokens=N)
    assert result.stats.accepted_per_round == [1] * (N - 1)
    assert result.stats.target_forwards == N


@pytest.mark.parametrize("depth", [1, 3, 5])
def test_perfect_round_commits_depth_plus_one(model, depth):
    prompt = PROMPTS[1]
    n = 1 + 10 * (depth + 1)
    ref = model.ref(prompt, n + 8)
    assert model.eos_ids[0] not in ref[:n]
    rt = model.runtime(drafter=ScriptedDrafter(ReferenceScript(prompt, ref, _perfect(depth))))
    result = rt.generate(prompt, max_new_tokens=n)
    assert result.token_ids == ref[:n]
    assert result.stats.accepted_per_round == [depth + 1] * 10
    assert result.stats.tree_depth_per_round == [depth] * 10
    assert result.stats.mean_accept_len == depth + 1
