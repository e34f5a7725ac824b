"""Row-exact decoding (decode.Decoder, row_exact): greedy EAGLE output bit-identical to vanilla
greedy on quantised (and fp32) fused graphs.

tests/exporter/test_batch_invariance.py shows that every row of the exported graphs has the same
bits in any causal forward of two or more tokens, and that only two things break that: a
one-token forward (onnxruntime's one-row sgemm kernel inside GroupQueryAttention) and a tree row
whose attention row holds masked siblings (another softmax summation order). On SmolLM2-135M the
int8 activation rounding of the quantised matmuls amplifies those last-bit differences into
different greedy tokens (int8 7 / 20, int4 4 / 20 prompts identical; 20 / 20 with row_exact).
Row-exact mode removes both causes: one-token target forwards run as two rows, verification
trees are depth-first and acceptance ends at the first accepted node off the top path.

The test records, for every generated token, the logits row that chose it, in vanilla and in
EAGLE decoding, and compares them bit for bit: with row_exact they are equal, without it they
are not."""
from __future__ import annotations

import platform

import numpy as np
import pytest

from eagle_deploy.runtime.tree import DraftTree
from eagle_deploy.runtime.verify import Verification, contiguous
from tests.conftest import PROMPTS, THREADS
from tests.helpers import AVX512, ScriptedDrafter, wrong_token

NEW_TOKENS = 40


class CountingTarget:
    """Backend wrapper counting the target forwards by row count."""

    def __init__(self, inner):
        self.inner, self.name, self.kv_names = inner, inner.name, inner.kv_names
        self.rows: list[int] = []

    def allocate_kv(self, capacity: int):
        return self.inner.allocate_kv(capacity)

    def run(self, inputs, kv, past: int):
        self.rows.append(inputs.input_ids.shape[1])
        return self.inner.run(inputs, kv, past)


def test_depth_first_puts_the_top_path_at_rows_equal_to_depth():
    # root -> a (best), b; a -> c (best), d; b -> e, in creation (breadth-first) order
    tree = DraftTree.from_paths(1, [[2, 4], [3, 6], [2, 5]])
    assert tree.tokens.tolist() == [1, 2, 4, 3, 6, 5]
    dfs = tree.depth_first()
    assert dfs.tokens.tolist() == [1, 2, 4, 5, 3, 6]
    assert dfs.depths.tolist() == [0, 1, 2, 2, 1, 2]
    assert [int(dfs.tokens[p]) for p in dfs.parents[1:]] == [1, 2, 2, 1, 3]  # same parent of each token
    assert DraftTree.from_paths(1, [[2, 3, 4]]).depth_first().tokens.tolist() == [1, 2, 3, 4]


def test_contiguous_cuts_at_the_first_node_off_the_top_path():
    v = Verification([0, 1, 2, 3], [10, 11, 12, 13])
    assert contiguous(v) == v
    cut = contiguous(Verification([0, 1, 4, 5], [10, 14, 15, 16]))
    assert cut.path == [0, 1] and cut.tokens == [10, 14]  # node 4's token is the bonus; nothing after
    assert contiguous(Verification([0, 3], [13, 20])).tokens == [13]


class DecidingRows:
    """Round observer: the logits row that chose each committed token, in order, and how many
    rounds accepted a node off the top path (row index != depth: the round was cut there)."""

    def __init__(self):
        self.rows: list[np.ndarray] = []
        self.cuts = 0

    def __call__(self, tree, logits, verification):
        self.rows.extend(logits[node].copy() for node in verification.path)
        # a bonus token the tree drafted below the last accepted node was accepted off the top path
        self.cuts += verification.bonus in [int(tree.tokens[k]) for k in tree.children(verification.path[-1])]


@pytest.fixture(scope="module")
def exports(quant_exports) -> dict:
    """{"fp32" | "int8" | "int4": export folder} (tests/conftest.py quant_exports)."""
    return quant_exports


def _oracle(prompt, ref):
    """Trees from the vanilla continuation `ref`: on even steps the right path first (accepted
    contiguously), on odd steps behind a higher-ranked wrong branch (accepted at row 3, depth 1)."""
    def script(committed):
        pos = len(committed) - len(prompt)
        if pos >= len(ref) or list(committed[len(prompt):]) != ref[:pos]:
            return []
        bad = wrong_token(ref[pos])
        right = ref[pos:pos + 3]
        return [right, [bad]] if pos % 2 == 0 else [[bad, bad], right]
    return ScriptedDrafter(script)


def _decode(folder, recipe: bool, prompt, ref=None):
    """(tokens, deciding logits rows, rounds cut by row_exact, target forwards' row counts) of
    one greedy request: vanilla when ref is None, else EAGLE with the oracle drafter built on ref."""
    from eagle_deploy.runtime.api import EagleRuntime

    rows = DecidingRows()
    drafter = _oracle(prompt, ref) if ref is not None else ScriptedDrafter(lambda committed: [])
    targets = []

    def wrap(backend):
        if not targets:  # the target is opened first
            targets.append(CountingTarget(backend))
            return targets[0]
        return backend

    rt = EagleRuntime.load(folder, threads=THREADS, drafter=drafter, round_observers=[rows], wrap_backend=wrap,
                           row_exact=recipe)
    out = rt.generate(prompt, max_new_tokens=NEW_TOKENS, mode="vanilla" if ref is None else "eagle")
    assert out.stats.row_exact is recipe and out.stats.to_json()["row_exact"] is recipe
    return out.token_ids, rows.rows[:len(out.token_ids) - 1], rows.cuts, targets[0].rows


def _int4(name: str):
    return pytest.param(name, marks=pytest.mark.xfail(
        not AVX512, strict=True, reason="known, open: on an AVX2-only CPU (AMD EPYC Zen 3, 2026-12-02) some int4 "
        "deciding rows differ in their last bits between row-exact EAGLE and vanilla (the greedy tokens still agreed "
        "here); the kernel-level invariants of test_batch_invariance.py hold there, so another op is involved"))


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86-64 MLAS kernel paths")
@pytest.mark.parametrize("kind", ["int8", _int4("int4"), "fp32", "int8-two-row", _int4("int4-two-row")])
def test_recipe_makes_every_deciding_logit_row_bit_identical(exports, kind):
    """int8 / int4: graphs that repeat one-row queries themselves (exporter/fused.py), whose
    row-exact vanilla steps run one row where the matmuls allow it (runtime/row_exact.py);
    "-two-row": the graphs before, whose row-exact vanilla steps run two rows."""
    from eagle_deploy.runtime.api import EagleRuntime

    folder = exports[kind]
    step = EagleRuntime.load(folder, threads=THREADS, with_draft=False, row_exact=True).decoder.step_rows
    assert step == (1 if kind == "int8" or (kind == "int4" and AVX512) else 2)
    repeats = not kind.endswith("-two-row") and kind != "fp32"
    differing_without = 0
    for prompt in PROMPTS:
        vanilla, vanilla_rows, _, counts = _decode(folder, True, prompt)
        assert 3 - step not in counts and counts.count(step) >= NEW_TOKENS - 1  # every vanilla step ran as step rows
        eagle, eagle_rows, cuts, _ = _decode(folder, True, prompt, ref=vanilla)
        assert eagle == vanilla, prompt
        assert cuts > 0 and len(eagle_rows) == len(vanilla_rows) == len(vanilla) - 1
        assert all(np.array_equal(a, b) for a, b in zip(eagle_rows, vanilla_rows)), prompt

        plain_vanilla, plain_rows, _, counts = _decode(folder, False, prompt)
        assert 1 in counts
        if repeats and step == 1:  # the graph gives its one-token forwards the two-row bits anyway
            assert plain_vanilla == vanilla and all(np.array_equal(a, b) for a, b in zip(plain_rows, vanilla_rows))
            continue
        plain_eagle, plain_eagle_rows, _, _ = _decode(folder, False, prompt, ref=plain_vanilla)
        assert plain_eagle == plain_vanilla  # the 2-layer fixture's tokens agree anyway ...
        differing_without += sum(not np.array_equal(a, b) for a, b in zip(plain_eagle_rows, plain_rows))
    assert differing_without > 0 or (repeats and step == 1)  # ... but without the recipe their logits do not
