"""logit_bias, penalties, min_p and logprobs, at the three levels: hand-built logits and
trees (each node's row shaped from its own path), the sampled distribution through the decode
loop (chi-square on a 16-token vocabulary), and greedy EAGLE == greedy vanilla end to end."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from eagle_deploy.contract.errors import SettingError
from eagle_deploy.runtime.request import Request
from eagle_deploy.runtime.sampling import SamplingParams, target_probs
from eagle_deploy.runtime.shaping import LogitShaper, path_tokens, token_logprob
from eagle_deploy.runtime.tree import DraftTree
from tests.conftest import PROMPTS
from tests.runtime.conftest import V16_PROMPT
from tests.runtime.stats import chi2_pvalue, counts_of, total_variation, tv_noise
from tests.runtime.test_sampling import P_MIN, _fixed_pair_drafter

PENALTIES = dict(repetition_penalty=1.3, frequency_penalty=0.6, presence_penalty=0.4)


def reference_shape(logits, prompt, generated, bias=(), repetition=1.0, frequency=0.0, presence=0.0):
    """The shaping written out independently: transformers' RepetitionPenaltyLogitsProcessor
    over prompt + generated, then OpenAI's frequency / presence formula over generated."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    z = torch.as_tensor(np.array(logits, np.float64))[None]
    for t, b in bias:
        z[0, t] += b
    if repetition != 1.0:
        z = RepetitionPenaltyLogitsProcessor(repetition)(torch.tensor([list(prompt) + list(generated)]), z)
    z = z[0].numpy().copy()
    for t in set(generated):
        z[t] -= frequency * list(generated).count(t) + presence
    return z


def test_a_row_is_shaped_like_the_reference_and_each_tree_node_from_its_own_path():
    rng = np.random.default_rng(0)
    V = 40
    prompt, committed = [3, 4, 5, 3], [7, 7, 9]
    params = SamplingParams(logit_bias=((1, 2.5), (9, -1.0)), **PENALTIES)
    shaper = LogitShaper(params, prompt)
    shaper.push(committed)
    tree = DraftTree.from_paths(7, [[7, 2, 7], [5, 1], [11]])
    logits = rng.normal(size=(tree.size, V)).astype(np.float32) * 3
    rows = shaper.rows(logits, tree)
    for i in range(tree.size):
        path = path_tokens(tree, i)
        want = reference_shape(logits[i], prompt, committed + path, params.logit_bias, **{
            "repetition": 1.3, "frequency": 0.6, "presence": 0.4})
        assert np.allclose(rows(i), want, rtol=0, atol=1e-9), (i, path)
    assert sorted(path_tokens(tree, i) for i in range(tree.size)) == [[], [5], [5, 1], [7], [7, 2], [7, 2, 7], [11]]
    # a row shaped along a path equals the row after committing that path
    fresh = LogitShaper(params, prompt)
    fresh.push(committed + [7, 2])
    node = next(i for i in range(tree.size) if path_tokens(tree, i) == [7, 2])
    assert np.array_equal(fresh.row(logits[node]), rows(node))
    assert LogitShaper.of(SamplingParams(), prompt) is None  # nothing to shape: rows are used as they are


def test_min_p_keeps_the_tokens_at_least_min_p_times_as_likely_as_the_best():
    logits = np.log(np.array([0.5, 0.25, 0.1, 0.1, 0.05]))
    p = target_probs(logits, SamplingParams(temperature=1.0, min_p=0.2))  # keeps p >= 0.1
    assert np.allclose(p, [0.5 / 0.95, 0.25 / 0.95, 0.1 / 0.95, 0.1 / 0.95, 0.0])
    assert np.array_equal(target_probs(logits, SamplingParams(temperature=1.0, min_p=0.0)) > 0, [True] * 5)


def test_token_logprob_is_the_log_softmax_with_its_best_alternatives():
    logits = np.array([1.0, 3.0, 3.0, -2.0, 0.5], np.float32)
    lp = token_logprob(logits, 4, 3)
    ref = torch.log_softmax(torch.tensor(logits, dtype=torch.float64), -1).numpy()
    assert lp.token == 4 and abs(lp.logprob - ref[4]) < 1e-12
    assert [t for t, _ in lp.top] == [1, 2, 0] and all(abs(v - ref[t]) < 1e-12 for t, v in lp.top)
    assert token_logprob(logits, 1, 0).top == ()


@pytest.mark.parametrize("kw, field", [
    ({"logit_bias": {"x": 1.0}}, "logit_bias"), ({"logit_bias": {3: 101.0}}, "logit_bias[3]"),
    ({"logit_bias": {"-1": 1.0}}, "logit_bias"), ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"min_p": 1.5}, "min_p"),
    ({"logprobs": 21}, "logprobs"), ({"logprobs": -1}, "logprobs"),
])
def test_bad_shaping_settings_are_one_error_naming_the_field(kw, field):
    with pytest.raises(SettingError) as err:
        Request("hi", **kw)
    assert err.value.field == field
    assert Request("hi", logit_bias={"12": -100, 3: 0.5}).logit_bias == ((3, 0.5), (12, -100.0))  # JSON's keys


def test_a_logit_bias_id_outside_the_vocabulary_is_refused_before_any_forward(mha):
    with pytest.raises(SettingError, match=r"logit_bias keys must be token ids in \[0, 256\), got 256"):
        mha.rt.generate(PROMPTS[0], 4, logit_bias={256: 1.0})


SHAPED = [dict(PENALTIES), dict(logit_bias={5: 4.0, 20: -100}), dict(frequency_penalty=1.5, presence_penalty=-0.5),
          dict(repetition_penalty=0.8, logit_bias={7: 2.0})]


@pytest.mark.parametrize("shaping", range(len(SHAPED)))
def test_greedy_eagle_equals_vanilla_under_penalties_and_bias(model, shaping):
    """The head's fixed tree and the default planned hybrid drafter (whose lookup branches
    copy repeated tokens, which the penalties push down) both give vanilla's tokens."""
    kw = SHAPED[shaping]
    head = model.runtime()
    default = model.runtime(drafter_kind="hybrid", planned=True)
    for prompt in PROMPTS:
        vanilla = head.generate(prompt, 40, mode="vanilla", **kw).token_ids
        assert head.generate(prompt, 40, **kw).token_ids == vanilla
        assert default.generate(prompt, 40, **kw).token_ids == vanilla
    plain = [head.generate(p, 40, mode="vanilla").token_ids for p in PROMPTS]
    assert plain != [head.generate(p, 40, mode="vanilla", **kw).token_ids for p in PROMPTS]  # it changed something


def test_logprobs_of_eagle_equal_vanilla_up_to_rounding(gqa):
    rt = gqa.runtime(row_exact=True)
    for prompt in PROMPTS:
        e = rt.generate(prompt, 30, logprobs=5)
        v = rt.generate(prompt, 30, logprobs=5, mode="vanilla")
        assert e.token_ids == v.token_ids and len(e.logprobs) == len(e.token_ids) == 30
        # the same rows; not always the same last bits (a tree forward vs a one-token forward)
        assert [lp.logprob for lp in e.logprobs] == pytest.approx([lp.logprob for lp in v.logprobs], abs=1e-5)
        assert [[t for t, _ in lp.top] for lp in e.logprobs] == [[t for t, _ in lp.top] for lp in v.logprobs]
        assert [lp.token for lp in e.logprobs] == e.token_ids
        assert all(lp.top[0][0] == lp.token and len(lp.top) == 5 for lp in e.logprobs)  # greedy: the best
    assert rt.generate(PROMPTS[0], 4).logprobs is None


def test_logprobs_are_the_targets_own_distribution(gqa):
    """Against transformers' forward of the same tiny target (float64 log-softmax)."""
    r = gqa.rt.generate(PROMPTS[1], 12, logprobs=2, mode="vanilla", **PENALTIES)
    ids = list(PROMPTS[1]) + r.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(gqa.hf(torch.tensor([ids])).logits[0].double(), -1).numpy()
    for j, lp in enumerate(r.logprobs):
        assert abs(lp.logprob - ref[len(PROMPTS[1]) - 1 + j, lp.token]) < 1e-4


def test_a_stop_inside_an_accepted_chunk_keeps_one_logprob_per_token(mha):
    rt = mha.runtime()
    full = rt.generate(PROMPTS[0], 30, logprobs=0)
    cut = rt.generate(PROMPTS[0], 30, logprobs=0, stop=[rt.tokenizer.decode(full.token_ids[8:10])])
    assert len(cut.logprobs) == len(cut.token_ids) < 30 and cut.logprobs == full.logprobs[:len(cut.token_ids)]


N_JOINT = 4000


@pytest.mark.statistical
def test_sampling_under_penalties_follows_the_shaped_target(v16, v16_logits):
    """generate(max_new_tokens=4) over a depth-2 tree holding [a, b] and [b, a]: the joint of
    (t1, t2) follows sum_t0 p(t0) p(t1|t0) p(t2|t0,t1), each factor the reference shaping of
    the exact logits after that token's own context (siblings shaped differently)."""
    T, V = 0.8, 16
    l0, l1, l2 = v16_logits
    shape = dict(repetition=1.4, frequency=0.7, presence=0.5)

    def probs(logits, generated):
        return target_probs(reference_shape(logits, V16_PROMPT, generated, **shape), SamplingParams(temperature=T))

    p0 = probs(l0, [])
    p1 = np.stack([probs(l1[a], [a]) for a in range(V)])
    p2 = np.stack([[probs(l2[a, b], [a, b]) for b in range(V)] for a in range(V)])
    joint = np.einsum("a,ab,abc->bc", p0, p1, p2)
    a, b = np.argsort(-joint.sum(1))[:2].tolist()
    rt = v16.runtime(drafter=_fixed_pair_drafter([[a, b], [b, a]]))
    pairs, deep = np.empty(N_JOINT, np.int64), 0
    for s in range(N_JOINT):
        r = rt.generate(V16_PROMPT, max_new_tokens=4, temperature=T, seed=s, repetition_penalty=1.4,
                        frequency_penalty=0.7, presence_penalty=0.5)
        pairs[s] = r.token_ids[1] * V + r.token_ids[2]
        deep += r.stats.accepted_per_round[0] == 3
    counts = counts_of(pairs, V * V)
    p, tv = chi2_pvalue(counts, joint), total_variation(counts, joint)
    assert p > P_MIN and tv < tv_noise(joint, N_JOINT), f"chi-square p={p:.2e}, TV={tv:.4f}"
    assert deep > 0.02 * N_JOINT  # both drafts accepted in some rounds: the tree was really used


def test_a_batch_of_mixed_requests_each_equals_its_vanilla_answer(gqa):
    """BatchRuntime slots decoding at once with different controls (one plain, one penalised,
    one biased with logprobs, one sampled): each greedy answer is its own vanilla answer."""
    from eagle_deploy.runtime.batch import BatchRuntime

    eng = BatchRuntime.load(gqa.export_dir, 4, threads=1)  # the default: planned hybrid drafter
    settings = [{}, dict(PENALTIES), dict(logit_bias={5: 4.0}, logprobs=2), dict(temperature=0.8, seed=3,
                                                                                 presence_penalty=1.0)]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[1]]
    results = eng.generate_many(prompts, per_request=settings, max_new_tokens=30)
    solo = gqa.runtime()
    for prompt, kw, r in zip(prompts, settings, results):
        if kw.get("temperature"):  # sampled: exact in distribution (other trees draw the rng differently)
            assert r.finish_reason in ("stop", "length") and 0 < len(r.token_ids) <= 30
            continue
        vanilla = solo.generate(prompt, 30, mode="vanilla", **kw)
        assert r.token_ids == vanilla.token_ids
        if "logprobs" in kw:
            assert [e.token for e in r.logprobs] == r.token_ids
            assert [e.logprob for e in r.logprobs] == pytest.approx([e.logprob for e in vanilla.logprobs], abs=1e-4)


@pytest.mark.parametrize("flags, message", [
    (["--presence-penalty", "3"], "--presence-penalty must be in [-2, 2], got 3.0"),
    (["--logit-bias", "x=1"], "--logit-bias takes ID=BIAS (a token id and a number), got 'x=1'"),
    (["--logit-bias", "5=200"], "--logit-bias[5] must be in [-100, 100], got 200.0"),
    (["--logprobs", "21", "--json"], "--logprobs must be at most 20 (alternatives per token), got 21"),
    (["--logprobs", "2"], "--logprobs needs --json (the log-probabilities are printed in its 'logprobs')"),
    (["--min-p", "0.1"], "--min-p has no effect: --temperature 0 decodes greedily (the target's most likely token)"),
])
def test_eagle_run_names_the_flag_of_a_bad_control(capsys, flags, message):
    from eagle_deploy.runtime import cli

    assert cli.main(["--engines", "no-such-folder", "--prompt", "hi", *flags]) == 2
    assert capsys.readouterr().err.strip() == f"eagle-run: error: {message}"


def test_eagle_run_prints_logprobs_and_applies_the_controls(mha, capsys):
    import json

    from eagle_deploy.runtime import cli

    args = ["--engines", str(mha.export_dir), "--prompt", "hello", "--raw", "--threads", "1", "--json",
            "--max-new-tokens", "12", "--repetition-penalty", "1.3", "--logit-bias", "101=2", "--logprobs", "1"]
    assert cli.main(args) == 0
    out = json.loads(capsys.readouterr().out)
    want = mha.rt.generate("hello", 12, chat=False, mode="vanilla", repetition_penalty=1.3, logit_bias={101: 2.0},
                           logprobs=1)
    assert out["token_ids"] == want.token_ids and len(out["logprobs"]) == len(want.token_ids)
    assert [e["token"] for e in out["logprobs"]] == want.token_ids and all(len(e["top"]) == 1 for e in out["logprobs"])
