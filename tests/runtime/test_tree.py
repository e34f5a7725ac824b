"""DraftTree's contract: siblings carry distinct tokens. A second copy of a token under one
parent is never accepted (greedy verification follows the first match, rejection sampling
gives it zero probability), so a tree whose childless duplicate ranks first accepts less
than the chain it contains. Such trees are refused when built, naming the node and token."""
from __future__ import annotations

import numpy as np
import pytest

from eagle_deploy.runtime.drafter import DraftRequest
from eagle_deploy.runtime.tree import DraftTree
from tests.runtime.fakes import Script, scripted_runtime

PROMPT = list(b"Tree: ")
GEN = list(b"siblings must differ, and they do.")
DEPTH = 4


def test_duplicate_siblings_are_refused_naming_node_and_token():
    with pytest.raises(ValueError, match=r"node 2 repeats token 7 of its sibling node 1 \(both children of node 0\)"):
        DraftTree(np.array([5, 7, 7, 9]), np.array([-1, 0, 0, 2]), np.array([0.0, -0.1, -0.2, -0.3]))
    with pytest.raises(ValueError, match=r"node 4 repeats token 9 of its sibling node 3 \(both children of node 1\)"):
        DraftTree(np.array([5, 7, 8, 9, 9]), np.array([-1, 0, 0, 1, 1]), np.zeros(5))
    # the same token under different parents is fine (7 -> 7, 8 -> 7)
    tree = DraftTree(np.array([5, 7, 8, 7, 7]), np.array([-1, 0, 0, 1, 2]), np.zeros(5))
    assert tree.size == 5
    # from_paths merges shared prefixes instead: one node per distinct path
    merged = DraftTree.from_paths(5, [[7], [7, 9], [7, 9, 1]])
    assert merged.tokens.tolist() == [5, 7, 9, 1] and merged.parents.tolist() == [-1, 0, 1, 2]


class DuplicatingDrafter:
    """A custom drafter: the script's next DEPTH tokens as a chain, plus (ranked first) a
    childless copy of the chain's first token, built node by node as a custom drafter would."""

    forwards = 0

    def __init__(self, script: Script, merge: bool = False):
        self.script, self.merge = script, merge

    def reset(self) -> None:
        pass

    def propose(self, request: DraftRequest) -> DraftTree:
        root = int(request.committed[-1])
        chain = self.script.future(request.committed, min(DEPTH, request.max_depth, request.max_nodes - 1))
        if len(chain) < 1:
            return DraftTree.root_only(root)
        if self.merge:
            return DraftTree.from_paths(root, [chain[:1], chain])
        tokens = [root, chain[0], chain[0], *chain[1:]]
        parents = [-1, 0, 0] + [2 + d for d in range(len(chain) - 1)]
        return DraftTree(np.array(tokens), np.array(parents), -np.arange(len(tokens), dtype=np.float32) * 0.1)


def test_a_drafter_proposing_duplicate_siblings_fails_loudly(tok):
    script = Script(PROMPT, GEN)
    rt = scripted_runtime(script, tok, drafter=DuplicatingDrafter(script))
    with pytest.raises(ValueError, match=r"node 2 repeats token \d+ of its sibling node 1"):
        rt.generate(PROMPT, max_new_tokens=len(GEN))


def test_the_same_drafter_through_from_paths_accepts_the_whole_chain(tok):
    script = Script(PROMPT, GEN)
    rt = scripted_runtime(script, tok, drafter=DuplicatingDrafter(script, merge=True))
    result = rt.generate(PROMPT, max_new_tokens=len(GEN))
    assert result.token_ids == GEN
    assert result.stats.accepted_per_round[0] == DEPTH + 1  # the chain and the bonus token
