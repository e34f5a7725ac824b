"""Threshold acceptance (`--acceptance threshold`): opt-in and NOT LOSSLESS.

A draft token is accepted whenever the target gives it probability >= threshold, so a
low-probability-but-above-threshold draft is accepted far more often than the target would
sample it: chi-square rejects the output distribution (p < 1e-6) where the default lossless
rule passes (p > 1e-3) on the very same setup. The mode is labelled in --help, in the run
summary and in the result stats. `test_threshold_gain_and_divergence` measures what the
mode buys (tau) and what it costs (total variation from the target) on the tiny model.
"""
from __future__ import annotations

import numpy as np
import pytest

from eagle_deploy.runtime import cli
from eagle_deploy.runtime.sampling import SamplingParams, greedy_token
from eagle_deploy.runtime.tree import DraftTree
from eagle_deploy.runtime.verify import verify_sampling, verify_threshold
from tests.conftest import THREADS
from tests.helpers import ScriptedDrafter
from tests.runtime.conftest import V16_PROMPT
from tests.runtime.stats import chi2_pvalue, counts_of, ref_probs, total_variation, tv_noise

PROMPT = V16_PROMPT
V16 = 16


def test_verification_level_threshold_is_lossy_lossless_is_not():
    """Root probabilities [0.1, 0.5, 0.2, 0.1, 0.1]; the draft is token 0 (p = 0.1) and the
    threshold 0.05: threshold mode always emits token 0 first."""
    probs = np.array([0.1, 0.5, 0.2, 0.1, 0.1])
    logits = np.log(probs)[None].repeat(2, 0).astype(np.float32)
    tree = DraftTree.from_paths(3, [[0]])
    params = SamplingParams(1.0)
    n = 4000
    lossless = [verify_sampling(tree, logits, params, np.random.default_rng(s)).tokens[0] for s in range(n)]
    lossy = [verify_threshold(tree, logits, params, np.random.default_rng(s), 0.05).tokens[0] for s in range(n)]
    assert chi2_pvalue(counts_of(lossless, 5), probs) > 1e-3
    assert total_variation(counts_of(lossless, 5), probs) < 0.03
    assert chi2_pvalue(counts_of(lossy, 5), probs) < 1e-6
    assert set(lossy) == {0}
    # below the threshold the lossless rule applies at that node
    below = [verify_threshold(tree, logits, params, np.random.default_rng(s), 0.2).tokens[0] for s in range(n)]
    assert chi2_pvalue(counts_of(below, 5), probs) > 1e-3
    with pytest.raises(ValueError, match="threshold"):
        verify_threshold(tree, logits, params, np.random.default_rng(0), 0.0)


def _t1_draws(rt, n: int, T: float, **kw) -> tuple[np.ndarray, list]:
    """n seeded requests of 3 tokens; returns (t1 per request, stats per request)."""
    t1, stats = np.empty(n, np.int64), []
    for s in range(n):
        r = rt.generate(PROMPT, max_new_tokens=3, temperature=T, seed=s, **kw)
        t1[s] = r.token_ids[1]
        stats.append(r.stats)
    return t1, stats


@pytest.mark.statistical
def test_end_to_end_threshold_changes_the_distribution(v16, v16_logits):
    """The drafter always proposes token z, the token whose smallest probability over the
    contexts (prompt + t0) is largest among the tokens with mean probability < 0.1; the
    threshold sits just below that smallest probability, so threshold mode accepts z every
    time, while lossless mode accepts it with probability p(z)."""
    T = 1.0
    l0, l1, _ = v16_logits
    p0, p1 = ref_probs(l0, T), ref_probs(l1, T)
    marg = p0 @ p1
    low = np.flatnonzero(marg < 0.1)
    z = int(low[np.argmax(p1[:, low].min(0))])
    threshold = 0.9 * float(p1[:, z].min())
    assert 0.005 < threshold and marg[z] < 0.1
    drafter = ScriptedDrafter(lambda committed: [[z]])
    n = 3000
    lossless, _ = _t1_draws(v16.runtime(drafter=drafter), n, T)
    lossy, stats = _t1_draws(v16.runtime(drafter=drafter, acceptance="threshold", threshold=threshold), n, T)
    assert chi2_pvalue(counts_of(lossless, V16), marg) > 1e-3
    assert chi2_pvalue(counts_of(lossy, V16), marg) < 1e-6
    assert np.all(lossy == z)
    assert stats[0].lossless is False and stats[0].acceptance == "threshold"


def test_greedy_threshold_mode_leaves_the_greedy_path(v16, v16_logits):
    """Greedy decoding with threshold acceptance tests the plain softmax: a non-argmax draft
    above the threshold is accepted, so the output is no longer the greedy one."""
    l0, l1, _ = v16_logits
    t0 = greedy_token(l0)
    p = ref_probs(l1[t0], 1.0)
    z = int(np.argsort(-p)[1])  # the second likeliest token after t0
    drafter = ScriptedDrafter(lambda committed: [[z]] if len(committed) == len(PROMPT) + 1 else [])
    greedy = v16.runtime(drafter=drafter).generate(PROMPT, max_new_tokens=4)
    lossy = v16.runtime(drafter=drafter, acceptance="threshold",
                        threshold=0.5 * p[z]).generate(PROMPT, max_new_tokens=4)
    assert greedy.token_ids == v16.expected(PROMPT, 4)
    assert lossy.token_ids[:2] == [t0, z] != greedy.token_ids[:2]


def test_not_lossless_is_labelled(v16, capsys):
    help_text = " ".join(cli.build_parser().format_help().split())
    for flag in ("--acceptance", "--threshold"):
        i = help_text.rindex(flag + " ")  # the option entry, not the usage line
        assert "NOT LOSSLESS" in help_text[i:i + 400], flag
    base = ["--engines", str(v16.export_dir), "--prompt", "\x03\x01\x04", "--raw", "--max-new-tokens", "6",
            "--threads", str(THREADS), "--temperature", "1", "--seed", "1"]
    assert cli.main(base + ["--acceptance", "threshold", "--threshold", "0.2"]) == 0
    _, err = capsys.readouterr()
    summary = [line for line in err.splitlines() if line.startswith("[eagle")]
    assert len(summary) == 1 and "NOT LOSSLESS" in summary[0]
    assert any(line.startswith("note:") and "NOT LOSSLESS" in line for line in err.splitlines())
    assert cli.main(base) == 0
    _, err = capsys.readouterr()
    assert "NOT LOSSLESS" not in err


@pytest.mark.statistical
def test_threshold_gain_and_divergence(v16, v16_logits, record_property):
    """Measured on the vocab-16 tiny target with its random EAGLE head (default tree), T = 1:
    tau (tokens per target forward, over 24-token requests) and the total variation of the
    first round's token t1 from the exact target marginal, lossless vs threshold 0.05 / 0.1 /
    0.3 (this target's probabilities rarely reach 0.3 at T = 1, so 0.3 changes little)."""
    T = 1.0
    l0, l1, _ = v16_logits
    marg = ref_probs(l0, T) @ ref_probs(l1, T)
    n_tv, n_tau = 1500, 50
    noise = tv_noise(marg, n_tv)
    report = {}
    modes = {"lossless": {}, **{f"threshold-{t}": dict(acceptance="threshold", threshold=t) for t in (0.05, 0.1, 0.3)}}
    for name, kw in modes.items():
        rt = v16.runtime(**kw)
        t1, _ = _t1_draws(rt, n_tv, T)
        rounds = tokens = 0
        for s in range(n_tau):
            st = rt.generate(PROMPT, max_new_tokens=24, temperature=T, seed=10_000 + s).stats
            rounds += len(st.accepted_per_round)
            tokens += sum(st.accepted_per_round)
        counts = counts_of(t1, V16)
        report[name] = {"tau": tokens / rounds, "tv": total_variation(counts, marg), "p": chi2_pvalue(counts, marg)}
    report["tv_noise_q999"] = noise
    print("\nthreshold acceptance on the vocab-16 tiny model (T=1):", report)
    record_property("threshold_report", report)
    assert report["lossless"]["tv"] < noise and report["lossless"]["p"] > 1e-3
    for name in ("threshold-0.05", "threshold-0.1"):
        assert report[name]["tau"] > report["lossless"]["tau"]
        assert report[name]["tv"] > noise and report[name]["p"] < 1e-6
    assert report["threshold-0.3"]["tau"] >= report["lossless"]["tau"]
