"""eagle-train on the tiny model: data generation, the unrolled training forward, a short run
that lowers the loss, and a trained head that exports and decodes losslessly."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from eagle_deploy.exporter.export import ExportOptions, export
from eagle_deploy.heads.api import load_head, random_head, save_head
from eagle_deploy.train.data import BatchedGenerator, TokenData, compute_features
from eagle_deploy.train.trainer import (
    TrainConfig,
    evaluate,
    split,
    steps_for_budget,
    train_head,
    unroll_masks,
    unrolled_forward,
)

PROMPTS = [[5, 6, 7, 8, 9], [100, 3, 77, 20, 21, 22, 23, 1, 2], [65, 32, 119], [9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9]]


def _causal(n):
    return torch.tril(torch.ones(n, n, dtype=torch.bool))[None]


def test_batched_generation_equals_one_prompt_at_a_time(gqa):
    gen = BatchedGenerator(gqa.hf, "cpu", eos_ids=gqa.eos_ids)
    batched = gen.generate(PROMPTS, 20)
    for prompt, out in zip(PROMPTS, batched):
        assert out == gen.generate([prompt], 20)[0]
        assert out == gqa.expected(prompt, 20)  # and equals plain HF greedy (left padding is invisible)


def test_finished_rows_leaving_the_batch_and_length_batches_change_nothing(gqa):
    """Rows that produced an EOS leave the batch (compaction) and long prompts get smaller
    batches (prefill_tokens): greedy outputs are those of the plain full batch."""
    from eagle_deploy.train.data import generate_data

    eos = [BatchedGenerator(gqa.hf, "cpu", eos_ids=[]).generate(PROMPTS[:1], 30)[0][5]]  # row 0 ends early
    full = BatchedGenerator(gqa.hf, "cpu", eos_ids=eos, compact_below=0.0).generate(PROMPTS, 30)
    assert len(full[0]) <= 6 and len({len(r) for r in full}) > 1  # rows end at different steps: compaction runs
    assert BatchedGenerator(gqa.hf, "cpu", eos_ids=eos, compact_below=1.0).generate(PROMPTS, 30) == full

    class Ids:  # a tokenizer stand-in without a chat template: the prompt text is its ids
        chat_template = None

        def encode(self, text, add_special_tokens=True):
            return [int(t) for t in text.split()]

    rows = [{"id": f"p{i}", "prompt": " ".join(map(str, p))} for i, p in enumerate(PROMPTS)]
    whole = generate_data(gqa.hf, Ids(), rows, [0.0], 30, 8, "cpu", eos)
    small = generate_data(gqa.hf, Ids(), rows, [0.0], 30, 8, "cpu", eos, prefill_tokens=10)
    assert [whole.sequence(i).tolist() for i in range(4)] == [small.sequence(i).tolist() for i in range(4)]
    for i, meta in enumerate(whole.meta):
        k = int(meta["id"][1:])
        assert whole.sequence(i).tolist() == PROMPTS[k] + full[k]


def test_length_batches_bound_the_padding():
    from eagle_deploy.train.data import length_batches

    lengths = [40, 10, 1000, 12, 30, 700, 45, 11, 999, 60]
    got = [b.tolist() for b in length_batches(lengths, 3)]
    assert got == [[1, 7, 3], [4, 0, 6], [9], [5, 8, 2]]  # ascending; <= 1.5x or +32 of each batch's shortest
    assert sorted(i for b in got for i in b) == list(range(10))
    assert [b.tolist() for b in length_batches([5] * 5, 2)] == [[0, 1], [2, 3], [4]]


def test_sampled_generation_is_seeded(gqa):
    gen = BatchedGenerator(gqa.hf, "cpu", eos_ids=[])
    a, b = gen.generate(PROMPTS, 12, temperature=1.0, seed=3), gen.generate(PROMPTS, 12, temperature=1.0, seed=3)
    c = gen.generate(PROMPTS, 12, temperature=1.0, seed=4)
    assert a == b and a != c
    assert a != gen.generate(PROMPTS, 12)  # T=1 differs from greedy somewhere


def test_token_data_roundtrip(tmp_path):
    data = TokenData.from_sequences([[1, 2, 3], [4, 5], [60000, 7, 8, 9]], [1, 1, 2],
                                    [{"id": "a"}, {"id": "b"}, {"id": "c"}], {"k": 1})
    data.save(tmp_path / "d.npz")
    back = TokenData.load(tmp_path / "d.npz")
    assert [back.sequence(i).tolist() for i in range(3)] == [[1, 2, 3], [4, 5], [60000, 7, 8, 9]]
    assert back.prompt_lens.tolist() == [1, 1, 2] and back.meta[2]["id"] == "c" and back.header == {"k": 1}
    assert back.response_tokens == 2 + 1 + 2
    both = TokenData.concat([back, back])
    assert len(both) == 6 and both.sequence(4).tolist() == [4, 5]


def test_unroll_masks_pattern():
    m = unroll_masks(5, 3, "cpu")
    assert m[0].shape == (5, 5) and torch.equal(m[0], torch.tril(torch.ones(5, 5, dtype=torch.bool)))
    # step 3, query 4: real keys 0..2, its step-2 ancestor (index 3) and itself (index 4)
    row = m[2][4]
    assert row[:5].tolist() == [True, True, True, False, False]
    assert row[5:10].tolist() == [False, False, False, True, False]
    assert row[10:].tolist() == [False, False, False, False, True]


def test_unrolled_forward_matches_the_drafting_chain(gqa):
    """Step s of the training forward at position i equals what the drafter computes at tree
    depth s - 1 of a chain whose real context ends at i - s + 1 (same KV, positions, mask)."""
    torch.manual_seed(0)
    head = random_head(gqa.hf, seed=5).eval()
    n = 18
    tokens = torch.randint(1, 256, (1, n))
    from eagle_deploy.exporter.target import ExportableTarget

    dims = head.dims
    empty = torch.zeros(0, 1, dims.num_kv_heads, dims.head_dim)
    with torch.no_grad():
        feats = ExportableTarget(gqa.hf)(tokens, torch.arange(n)[None], _causal(n), torch.zeros(1, 1, dtype=torch.long),
                                         *[empty] * (2 * gqa.hf.config.num_hidden_layers))[1]
        preds = unrolled_forward(head, feats[:, :-1], tokens[:, 1:], 3)
        for i in (4, 9, 15):
            for s in (1, 2, 3):
                c = i - s + 1
                x, K, V = head(feats[:, : c + 1], tokens[:, 1: c + 2], torch.arange(c + 1)[None], _causal(c + 1),
                               empty, empty)
                g = x[:, -1:]
                for d in range(1, s):
                    g, k, v = head(g, tokens[:, c + 1 + d: c + 2 + d], torch.tensor([[c + d]]),
                                   torch.ones(1, 1, K.shape[0] + 1, dtype=torch.bool), K, V)
                    K, V = torch.cat([K, k]), torch.cat([V, v])
                assert torch.allclose(g[0, 0], preds[s - 1][0, i], atol=1e-5), (i, s)


@pytest.fixture(scope="module")
def tiny_data(gqa):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 256, size=int(rng.integers(4, 12))).tolist() for _ in range(48)]
    gen = BatchedGenerator(gqa.hf, "cpu", eos_ids=[])
    seqs = [p + r for p, r in zip(prompts, gen.generate(prompts, 40))]
    data = TokenData.from_sequences(seqs, [len(p) for p in prompts], [{"id": f"p{i}"} for i in range(len(prompts))])
    return data, compute_features(gqa.hf, data, "cpu", batch_tokens=1024)


@pytest.mark.parametrize("layers", [None, (0, 1)], ids=["eagle", "eagle3-taps"])
def test_features_are_the_export_shaped_targets_features(gqa, tiny_data, layers):
    """compute_features (transformers' SDPA forward, right-padded batches of mixed lengths)
    gives, per position, the features of the ExportableTarget the target graph is traced from
    (EAGLE-3: its taps then the final features), up to float rounding."""
    from eagle_deploy.train.data import target_in

    data, _ = tiny_data
    few = data.subset(range(6))
    assert len({len(few.sequence(i)) for i in range(6)}) > 1  # mixed lengths: padding is exercised
    feats = compute_features(gqa.hf, few, "cpu", batch_tokens=200, out_dtype=torch.float32, feature_layers=layers)
    target = target_in(gqa.hf, torch.float32, "cpu", layers)
    dims = target.dims
    for i in range(len(few)):
        ids = torch.from_numpy(few.sequence(i))[None]
        n = ids.shape[1]
        past = [torch.zeros(0, 1, dims.num_kv_heads, dims.head_dim)] * (2 * dims.num_layers)
        with torch.no_grad():
            out = target(ids, torch.arange(n)[None], torch.tril(torch.ones(n, n, dtype=torch.bool))[None],
                         torch.zeros(1, 1, dtype=torch.long), *past)
        want = torch.cat((out[2], out[1]), dim=-1)[0] if layers else out[1][0]
        assert feats[i].shape == want.shape
        assert torch.allclose(feats[i], want, atol=2e-5, rtol=1e-4), (i, float((feats[i] - want).abs().max()))


def test_short_training_lowers_the_loss_and_the_head_decodes_losslessly(gqa, tiny_data, tmp_path):
    data, feats = tiny_data
    cfg = TrainConfig(epochs=12, lr=3e-3, warmup_steps=5, batch_tokens=512, unroll=2, val_fraction=0.2, seed=0)
    head = random_head(gqa.hf, seed=1)
    _, val_idx = split(data, cfg.val_fraction, cfg.seed)
    train_idx = np.setdiff1d(np.arange(len(data)), val_idx)
    before = evaluate(head, data, feats, train_idx, cfg, "cpu")
    history = train_head(head, data, feats, cfg, "cpu", log=lambda *_: None)
    after = evaluate(head, data, feats, train_idx, cfg, "cpu")
    # (the soft cross-entropy is floored by the entropy of a random target's next-token
    # distribution, so the regression loss and top-1 agreement show the learning)
    for b, a in zip(before, after):  # both unrolled steps learn, the second on the head's own outputs
        assert a["reg"] < 0.7 * b["reg"] and a["ce"] < b["ce"] and a["acc"] > b["acc"] + 0.15, (b, a)
    assert history["steps_done"] == history["steps"] > 0 and len(history["val"]) >= 1

    save_head(head, tmp_path / "head")
    reloaded = load_head(tmp_path / "head", gqa.hf)
    assert all(torch.equal(reloaded.state_dict()[k], v) for k, v in head.state_dict().items())
    out = export(str(gqa.target_dir), str(tmp_path / "head"), tmp_path / "exports", ExportOptions(max_length=256),
                 progress=None)
    from eagle_deploy.runtime.api import EagleRuntime

    rt = EagleRuntime.load(out, threads=1)
    trained_tau, random_tau = [], []
    for i in range(8):  # training prompts: the head must now predict the target's continuations
        prompt = data.sequence(i)[: int(data.prompt_lens[i])].tolist()
        eagle, vanilla = rt.generate(prompt, max_new_tokens=32), rt.generate(prompt, max_new_tokens=32, mode="vanilla")
        assert eagle.token_ids == vanilla.token_ids
        trained_tau.append(eagle.stats.mean_accept_len)
        random_tau.append(gqa.rt.generate(prompt, max_new_tokens=32).stats.mean_accept_len)
    assert np.mean(trained_tau) > np.mean(random_tau) + 0.15, (trained_tau, random_tau)


def test_cpu_bf16_autocast_trains_fp32_weights_and_lowers_the_loss(gqa, tiny_data):
    """cpu_bf16 (eagle-train --torch-dtype bf16 on a CPU): the step runs under bf16 autocast,
    the weights stay fp32 and the head learns as in fp32."""
    data, feats = tiny_data
    cfg = TrainConfig(epochs=12, lr=3e-3, warmup_steps=5, batch_tokens=512, unroll=2, val_fraction=0.2, seed=0,
                      cpu_bf16=True)
    head = random_head(gqa.hf, seed=1)
    _, val_idx = split(data, cfg.val_fraction, cfg.seed)
    train_idx = np.setdiff1d(np.arange(len(data)), val_idx)
    before = evaluate(head, data, feats, train_idx, cfg, "cpu")
    seen = []
    hook = head.fc.register_forward_hook(lambda mod, inp, out: seen.append(out.dtype))
    train_head(head, data, feats, cfg, "cpu", log=lambda *_: None)
    hook.remove()
    after = evaluate(head, data, feats, train_idx, cfg, "cpu")
    assert seen and set(seen) == {torch.bfloat16}  # every training forward ran under autocast
    assert all(p.dtype == torch.float32 for p in head.parameters())
    for b, a in zip(before, after):
        assert a["reg"] < 0.7 * b["reg"] and a["acc"] > b["acc"] + 0.15, (b, a)


def test_sequences_whose_prompt_fills_max_seq_len_are_skipped(gqa, tiny_data):
    """A sequence truncated to max_seq_len within its prompt has no scored position (a batch of
    only such sequences once crashed training with a float loss): it is left out, and said."""
    from eagle_deploy.train.trainer import scored_sequences

    data, feats = tiny_data
    plens = np.asarray(data.prompt_lens)
    cut = int(np.median(plens))  # every prompt of >= cut tokens fills the first `cut` tokens
    scored = scored_sequences(data, cut)
    assert (scored == (plens < cut)).all() and 0 < scored.sum() < len(data)
    lines = []
    cfg = TrainConfig(epochs=1, batch_tokens=2 * cut, max_seq_len=cut, val_fraction=0.2, warmup_steps=1, seed=0)
    history = train_head(random_head(gqa.hf, seed=1), data, feats, cfg, "cpu", log=lines.append)
    assert f"train: {int((~scored).sum())} sequences skipped" in lines[0]
    assert history["train_sequences"] + history["val_sequences"] == scored.sum() and history["steps_done"] > 0


def test_prompt_positions_score_every_position_and_keep_validation_on_responses(gqa, tiny_data):
    """prompt_positions (eagle-train --prompt-positions): chains start anywhere in a sequence,
    so step 1 scores every position that has a next feature, against the target's own
    distribution there; without it only from the last prompt token on. Training with it keeps
    the sequences whose prompts fill max_seq_len (their prompt positions are scored) and leaves
    them out of validation, which stays on response positions."""
    from eagle_deploy.train.trainer import _chain_ok, make_batch, scored_sequences, step_losses

    data, feats = tiny_data
    idx = list(range(8))
    plain, every = (make_batch(data, feats, idx, "cpu", 1024, prompt_positions=p) for p in (False, True))
    for b, i in enumerate(idx):
        L, first = len(feats[i]), int(data.prompt_lens[i]) - 1
        assert bool(every.chain_start_ok[b, : L - 1].all()) and not bool(every.chain_start_ok[b, L - 1:].any())
        assert not bool(plain.chain_start_ok[b, :first].any()) and bool(plain.chain_start_ok[b, first: L - 1].all())
    assert torch.equal(_chain_ok(every, 1), every.valid)
    with torch.no_grad():  # the loss scores them all
        _, ms = step_losses(random_head(gqa.hf, seed=1).eval(), every, TrainConfig(unroll=1), train=False)
    assert ms[0]["n"] == int(every.valid.sum()) > int(_chain_ok(plain, 1).sum())
    for s in (2, 3):  # later unrolled steps: chains that started s - 1 positions back
        assert torch.equal(_chain_ok(every, s)[:, s - 1:], every.valid[:, s - 1:])
        assert not bool(_chain_ok(every, s)[:, : s - 1].any())

    cut = int(np.median(np.asarray(data.prompt_lens)))
    scored = scored_sequences(data, cut)
    lines = []
    cfg = TrainConfig(epochs=1, batch_tokens=2 * cut, max_seq_len=cut, val_fraction=0.2, warmup_steps=1, seed=0,
                      prompt_positions=True)
    history = train_head(random_head(gqa.hf, seed=1), data, feats, cfg, "cpu", log=lines.append)
    train_idx, val_idx = split(data, cfg.val_fraction, cfg.seed)
    assert not any("skipped" in line for line in lines)
    assert history["train_sequences"] == len(train_idx) and history["val_sequences"] == int(scored[val_idx].sum())


def test_draft_vocabulary_cross_entropy(gqa, tiny_data):
    """An EAGLE-1/2 head's loss over the draft vocabulary (target_lm: the LM-head rows of its
    ids): over every id it is the full-vocabulary loss; over fewer ids the regression part is
    unchanged and the cross-entropy and agreement are those of the restricted distributions."""
    from eagle_deploy.train.trainer import _chain_ok, make_batch, step_losses

    data, feats = tiny_data
    cfg = TrainConfig(unroll=2, batch_tokens=512)
    head = random_head(gqa.hf, seed=1).eval()
    batch = make_batch(data, feats, list(range(8)), "cpu", cfg.max_seq_len)
    W = gqa.hf.get_output_embeddings().weight.detach()
    with torch.no_grad():
        full, m_full = step_losses(head, batch, cfg, train=False)
        every, m_every = step_losses(head, batch, cfg, train=False, target_lm=W.clone())
        ids = torch.arange(0, W.shape[0], 4)
        few, m_few = step_losses(head, batch, cfg, train=False, target_lm=W[ids])
    assert torch.allclose(full, every, rtol=1e-5)
    assert all(a == pytest.approx(b, rel=1e-4) for a, b in zip(m_full, m_every)) and len(m_full) == 2
    for a, b in zip(m_full, m_few):
        assert a["reg"] == b["reg"] and a["n"] == b["n"] and a["ce"] != b["ce"]
    ok = _chain_ok(batch, 1)  # the positions step 1 scores
    with torch.no_grad():
        pred = unrolled_forward(head, batch.feats.float(), batch.tokens, 1)[0][ok]
    t = batch.target.float()[ok]
    p, logq = torch.softmax(t @ W[ids].t(), -1), torch.log_softmax(pred @ W[ids].t(), -1)
    assert m_few[0]["ce"] == pytest.approx(float(-(p * logq).sum(-1).mean()), rel=1e-5)


@pytest.mark.parametrize("ce_topk", [0, 5])
def test_every_unrolled_step_scores_against_its_own_positions_soft_labels(gqa, tiny_data, ce_topk):
    """The target's soft labels are computed once over step 1's positions and indexed for the
    later steps: each step's cross-entropy and agreement equal those computed from that step's
    own positions (a later step's positions are a subset of step 1's)."""
    from eagle_deploy.train.trainer import _chain_ok, make_batch, step_losses

    data, feats = tiny_data
    cfg = TrainConfig(unroll=3, batch_tokens=512, ce_topk=ce_topk)
    head = random_head(gqa.hf, seed=3).eval()
    batch = make_batch(data, feats, list(range(8)), "cpu", cfg.max_seq_len)
    W = gqa.hf.get_output_embeddings().weight.detach()
    with torch.no_grad():
        _, metrics = step_losses(head, batch, cfg, train=False)
        preds = unrolled_forward(head, batch.feats.float(), batch.tokens, 3)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m, pred in zip(metrics, preds):
        ok = _chain_ok(batch, m["step"])
        assert bool((ok <= _chain_ok(batch, 1)).all()) and m["n"] == int(ok.sum()) > 0
        t_logits, logq = batch.target.float()[ok] @ W.t(), torch.log_softmax(pred[ok] @ W.t(), -1)
        p = torch.softmax(t_logits, -1)
        if ce_topk:
            tp, ti = torch.topk(p, ce_topk, dim=-1)
            ce = -(tp / tp.sum(-1, keepdim=True) * logq.gather(-1, ti)).sum(-1).mean()
        else:
            ce = -(p * logq).sum(-1).mean()
        assert m["ce"] == pytest.approx(float(ce), rel=1e-5)
        assert m["acc"] == pytest.approx(float((logq.argmax(-1) == t_logits.argmax(-1)).float().mean()))


# ---------------------------------------------------------------- EAGLE-3 heads

TAPS = (0, 1)


def _eagle3_head(gqa, seed=2):
    from eagle_deploy.heads.eagle3 import random_eagle3_head

    return random_eagle3_head(gqa.hf, seed=seed, feature_layers=TAPS)


def test_eagle3_unrolled_forward_matches_the_drafting_chain(gqa):
    """Training-time test (arXiv 2503.01840 §3.2): step s at position i equals drafting depth
    s - 1 of a chain whose real context ends at i - s + 1: the first call fuses the target's taps
    with fc, later calls feed the head's own outputs."""
    from eagle_deploy.exporter.target import ExportableTarget

    head = _eagle3_head(gqa).eval()
    n = 16
    tokens = torch.randint(1, 256, (1, n), generator=torch.Generator().manual_seed(0))
    dims = gqa.hf.config
    empty_t = torch.zeros(0, 1, dims.num_key_value_heads, dims.hidden_size // dims.num_attention_heads)
    empty = torch.zeros(0, 1, head.dims.num_kv_heads, head.dims.head_dim)
    with torch.no_grad():
        taps = ExportableTarget(gqa.hf, feature_layers=TAPS)(tokens, torch.arange(n)[None], _causal(n),
                                                             torch.zeros(1, 1, dtype=torch.long),
                                                             *[empty_t] * (2 * dims.num_hidden_layers))[2]
        preds = unrolled_forward(head, taps[:, :-1], tokens[:, 1:], 3)
        H = head.dims.hidden
        for i in (3, 8, 14):
            for s in (1, 2, 3):
                c = i - s + 1
                x, K, V = head(taps[:, : c + 1], torch.zeros(1, 0, H), tokens[:, 1: c + 2], torch.arange(c + 1)[None],
                               _causal(c + 1), empty, empty)
                g = x[:, -1:]
                for d in range(1, s):
                    g, k, v = head(torch.zeros(1, 0, taps.shape[-1]), g, tokens[:, c + 1 + d: c + 2 + d],
                                   torch.tensor([[c + d]]), torch.ones(1, 1, K.shape[0] + 1, dtype=torch.bool), K, V)
                    K, V = torch.cat([K, k]), torch.cat([V, v])
                assert torch.allclose(g[0, 0], preds[s - 1][0, i], atol=1e-5), (i, s)


def test_eagle3_every_unrolled_step_scores_against_its_own_positions_soft_labels(gqa, tiny_data):
    """EAGLE-3's losses compute the target's soft labels once over step 1's positions, as
    step_losses does: each step's cross-entropy and agreement equal those computed from that
    step's own positions' final features."""
    from eagle_deploy.train.head_init import new_eagle3_head
    from eagle_deploy.train.trainer import _chain_ok, make_batch, step_losses

    data, _ = tiny_data
    feats = compute_features(gqa.hf, data, "cpu", batch_tokens=1024, feature_layers=TAPS)
    counts = data.response_counts(gqa.hf.config.vocab_size)
    head = new_eagle3_head(gqa.hf, counts, TAPS, 64, seed=5, eos_ids=[gqa.hf.config.eos_token_id]).eval()
    target_lm = gqa.hf.get_output_embeddings().weight.detach()[head.draft_to_target]
    cfg = TrainConfig(unroll=3, batch_tokens=512)
    batch = make_batch(data, feats, list(range(8)), "cpu", cfg.max_seq_len)
    W = len(TAPS) * gqa.hf.config.hidden_size
    with torch.no_grad():
        _, metrics = step_losses(head, batch, cfg, train=False, target_lm=target_lm)
        preds = unrolled_forward(head, batch.feats[..., :W].float(), batch.tokens, 3)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m, pred in zip(metrics, preds):
        ok = _chain_ok(batch, m["step"])
        assert m["n"] == int(ok.sum()) > 0
        t_logits = batch.target[..., W:].float()[ok] @ target_lm.t()
        with torch.no_grad():  # the head's own LM head carries gradients
            logq = torch.log_softmax(head.logits(pred[ok]), -1)
        assert m["ce"] == pytest.approx(float(-(torch.softmax(t_logits, -1) * logq).sum(-1).mean()), rel=1e-5)
        assert m["acc"] == pytest.approx(float((logq.argmax(-1) == t_logits.argmax(-1)).float().mean()))


def test_eagle3_short_training_lowers_the_loss_and_the_head_decodes_losslessly(gqa, tiny_data, tmp_path):
    from eagle_deploy.heads.eagle3_checkpoint import save_eagle3_head

    data, _ = tiny_data
    feats = compute_features(gqa.hf, data, "cpu", batch_tokens=1024, feature_layers=TAPS)
    assert feats[0].shape[-1] == 3 * gqa.hf.config.hidden_size  # two taps, then the final features
    from eagle_deploy.train.head_init import new_eagle3_head

    # the 128 most frequent response tokens (+ EOS)
    counts = data.response_counts(gqa.hf.config.vocab_size)
    head = new_eagle3_head(gqa.hf, counts, TAPS, 128, seed=2, eos_ids=[gqa.hf.config.eos_token_id])
    assert head.cfg.draft_vocab == 128 and 0 in head.draft_to_target.tolist()
    target_lm = gqa.hf.get_output_embeddings().weight.detach()[head.draft_to_target]
    cfg = TrainConfig(epochs=12, lr=3e-3, warmup_steps=5, batch_tokens=512, unroll=2, val_fraction=0.2, seed=0)
    _, val_idx = split(data, cfg.val_fraction, cfg.seed)
    train_idx = np.setdiff1d(np.arange(len(data)), val_idx)
    before = evaluate(head, data, feats, train_idx, cfg, "cpu", target_lm)
    history = train_head(head, data, feats, cfg, "cpu", log=lambda *_: None, target_lm=target_lm)
    after = evaluate(head, data, feats, train_idx, cfg, "cpu", target_lm)
    # the cross-entropy is floored by the entropy of the random target's flat next-token
    # distribution, so top-1 agreement shows the learning; both steps learn, the second on the
    # head's own outputs
    for b, a in zip(before, after):
        assert a["ce"] < b["ce"] - 0.05 and a["acc"] > b["acc"] + 0.15, (b, a)
    assert not head.embed.weight.requires_grad and head.lm_head.weight.requires_grad
    assert history["steps_done"] == history["steps"] > 0
    save_eagle3_head(head, tmp_path / "head")
    rt_dir = export(str(gqa.target_dir), str(tmp_path / "head"), tmp_path / "exports",
                    ExportOptions(max_length=128, name="e3"), progress=None)
    from eagle_deploy.runtime.api import EagleRuntime

    rt = EagleRuntime.load(rt_dir, threads=1, drafter_kind="eagle", planned=False)  # the head's tau
    prompt = data.sequence(int(train_idx[0]))[: int(data.prompt_lens[int(train_idx[0])])].tolist()
    result = rt.generate(prompt, max_new_tokens=24)
    assert result.token_ids == gqa.expected(prompt, 24)
    assert result.stats.mean_accept_len > 1.2  # the trained head's drafts are accepted


def test_steps_for_budget_counts_what_the_rest_of_the_budget_holds():
    # 20 steps in 25 s at 1.2 s/step: (600 - 25) * 0.95 / 1.2 = 455 more
    assert steps_for_budget(20, 25.0, 1.2, 600.0, 10_000) == 475
    assert steps_for_budget(20, 25.0, 1.2, 600.0, 300) == 300  # the epochs end first
    assert steps_for_budget(20, 700.0, 1.2, 600.0, 300) == 21  # already over: one more step, not fewer than done


def test_a_time_budget_plans_a_step_count_that_max_steps_repeats_exactly(gqa, tiny_data, monkeypatch):
    """--time-budget-min turns into a step count after the first steps are timed and the lr
    schedule depends on steps only, so --max-steps with the logged count gives the same weights
    (the reproducibility a wall-clock-driven schedule lacked). The clock advances one second
    per training step, so the plan does not depend on this machine."""
    from eagle_deploy.train import trainer

    data, feats = tiny_data
    now = [0.0]
    real = trainer.step_losses

    def one_second_per_step(*a, train=False, **kw):
        now[0] += 1.0 if train else 0.0
        return real(*a, train=train, **kw)

    monkeypatch.setattr(trainer, "step_losses", one_second_per_step)
    cfg = TrainConfig(epochs=50, lr=3e-3, warmup_steps=4, batch_tokens=512, unroll=2, val_fraction=0.2, seed=0,
                      time_budget_s=40.0)
    lines = []
    budget_head = random_head(gqa.hf, seed=3)
    history = train_head(budget_head, data, feats, cfg, "cpu", log=lines.append, clock=lambda: now[0])
    # timed over steps 2-4 (1 s each): 4 + (40 - 4) * 0.95 = 38 steps of the 50 epochs' hundreds
    assert history["steps"] == history["steps_done"] == 38, history
    assert any("--max-steps 38 reproduces" in line for line in lines), lines
    fixed_head = random_head(gqa.hf, seed=3)
    fixed = train_head(fixed_head, data, feats, TrainConfig(**{**cfg.to_json(), "max_steps": 38}), "cpu",
                       log=lambda *_: None, clock=lambda: now[0])
    assert fixed["steps_done"] == fixed["steps"] == 38
    for name, value in budget_head.state_dict().items():
        assert torch.equal(value, fixed_head.state_dict()[name]), name
