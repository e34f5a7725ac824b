"""The eagle-train CLI on the tiny model: every stage caches in --work, a second run reuses
them all, an interrupted run resumes from the finished stages, and changed settings retrain;
plus the training prompts are disjoint from the evaluation sets."""
from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file

from eagle_deploy.train import cache, cli
from eagle_deploy.train import data as train_data
from eagle_deploy.train.data import prompt_set

SMALL = ["--limit", "6", "--modes", "0", "--max-new-tokens", "8", "--gen-batch", "4", "--epochs", "1",
         "--batch-tokens", "64", "--time-budget-min", "0", "--device", "cpu"]


@pytest.fixture()
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"count to {i} please"}) + "\n" for i in range(6)))
    return path


def _train(gqa, prompts, out, work, capsys, *extra, status=0):
    code = cli.main(["--model", str(gqa.target_dir), "--out", str(out), "--work", str(work), "--prompts", str(prompts),
                     *SMALL, *extra])
    assert code == status
    return capsys.readouterr().err


def _stamps(work):
    return {p.name: p.stat().st_mtime_ns for p in [*sorted((work / "data").glob("part-*.npz")),
                                                   work / cache.FEATURES_DIR, work / cache.HEAD_FILE]}


def test_stages_are_cached_and_an_interrupted_run_resumes(gqa, prompts, tmp_path, capsys):
    out, work = tmp_path / "head", tmp_path / "work"
    log = _train(gqa, prompts, out, work, capsys)
    assert "features: cached" not in log and "train: cached head" not in log
    first = load_file(out / "model.safetensors")
    stamps = _stamps(work)
    assert set(stamps) == {"part-00000.npz", cache.FEATURES_DIR, cache.HEAD_FILE}
    train_log = json.loads((out / "train_log.json").read_text())
    assert train_log["data"]["sequences"] == 6 and train_log["train"]["config"]["warmup_steps"] == 100

    log = _train(gqa, prompts, out, work, capsys)  # everything cached: nothing is rewritten
    assert "features: cached" in log and "train: cached head" in log
    assert _stamps(work) == stamps
    assert all((load_file(out / "model.safetensors")[k] == v).all() for k, v in first.items())

    shutil.rmtree(work / cache.FEATURES_DIR)  # interrupted after the data stage
    (work / cache.HEAD_FILE).unlink()
    log = _train(gqa, prompts, out, work, capsys)
    assert "features: cached" not in log and "train: cached head" not in log
    assert _stamps(work)["part-00000.npz"] == stamps["part-00000.npz"]  # the generated data was reused
    again = load_file(out / "model.safetensors")
    assert all((again[k] == v).all() for k, v in first.items())  # same data + seed -> the same head


def test_changed_settings_retrain_but_reuse_data_and_features(gqa, prompts, tmp_path, capsys):
    out, work = tmp_path / "head", tmp_path / "work"
    _train(gqa, prompts, out, work, capsys)
    first = load_file(out / "model.safetensors")
    log = _train(gqa, prompts, out, work, capsys, "--seed", "1")
    assert "train: cached head" not in log and "features: cached" in log
    second = load_file(out / "model.safetensors")
    assert any(not (second[k] == v).all() for k, v in first.items())
    log = _train(gqa, prompts, out, work, capsys, "--draft-vocab", "16")  # CE over 16 ids (< ce_topk 32): retrained
    assert "train: cached head" not in log and "cross-entropy over the 16 most frequent response tokens" in log
    assert json.loads((out / "train_log.json").read_text())["draft_vocab"] == 16
    # --max-seq-len reaches the trainer and keys the head cache: a cut that skips every prompt retrains and fails
    seqs = json.loads((out / "train_log.json").read_text())["train"]["train_sequences"]
    log = _train(gqa, prompts, out, work, capsys, "--draft-vocab", "16", "--max-seq-len", "4000")
    assert "train: cached head" not in log
    train_log = json.loads((out / "train_log.json").read_text())["train"]
    assert train_log["config"]["max_seq_len"] == 4000 and train_log["train_sequences"] == seqs
    log = _train(gqa, prompts, out, work, capsys, "--draft-vocab", "16", "--max-seq-len", "2", status=2)
    assert "no training sequence has a response position within max_seq_len 2" in log
    # --prompt-positions reaches the trainer and keys the head cache: the same cut trains on prompt positions
    log = _train(gqa, prompts, out, work, capsys, "--draft-vocab", "16", "--max-seq-len", "2", "--prompt-positions")
    assert "train: cached head" not in log and "skipped" not in log
    train_log = json.loads((out / "train_log.json").read_text())["train"]
    assert train_log["config"]["prompt_positions"] is True and train_log["train_sequences"] > 0


def test_prompts_alone_train_a_head_on_their_positions(gqa, prompts, tmp_path, capsys):
    """--max-new-tokens 0 --prompt-positions: the data stage writes the chat-formatted prompts
    alone (one sequence per prompt whatever --modes, no forward), and the head trains on their
    positions; validation has no response position to score, so it is empty."""
    from eagle_deploy.train.data import TokenData

    out, work = tmp_path / "head", tmp_path / "work"
    log = _train(gqa, prompts, out, work, capsys, "--max-new-tokens", "0", "--modes", "0,0.7", "--prompt-positions")
    part = TokenData.load(work / "data" / "part-00000.npz")
    assert len(part) == 6 and part.response_tokens == 0 and (np.diff(part.offsets) == part.prompt_lens).all()
    assert f"data: part-00000.npz: 6 prompts alone, {len(part.tokens)} tokens (nothing generated)" in log
    train_log = json.loads((out / "train_log.json").read_text())
    assert train_log["train"]["steps_done"] > 0 and train_log["train"]["val_sequences"] == 0
    assert train_log["train"]["config"]["prompt_positions"] is True


def test_init_head_continues_from_a_trained_head(gqa, prompts, tmp_path, capsys):
    """--init-head: training starts from that head's weights (at lr 0 the written head is that
    head, tensor for tensor), the head cache keys on it, and the written token counts add its
    own to the data's."""
    import numpy as np

    first, work = tmp_path / "first", tmp_path / "work"
    _train(gqa, prompts, first, work, capsys)
    start = load_file(first / "model.safetensors")
    counts = np.load(first / "token_counts.npy")
    assert counts.sum() > 0

    still = tmp_path / "still"
    log = _train(gqa, prompts, still, work, capsys, "--init-head", str(first), "--lr", "0")
    assert "train: cached head" not in log and f"init: starting from the head in {first}" in log
    kept = load_file(still / "model.safetensors")
    assert set(kept) == set(start) and all((kept[k] == v).all() for k, v in start.items())
    assert (np.load(still / "token_counts.npy") == 2 * counts).all()  # the same data counted twice
    assert json.loads((still / "train_log.json").read_text())["init_head"]["path"] == str(first)

    moved = tmp_path / "moved"
    log = _train(gqa, prompts, moved, work, capsys, "--init-head", str(first), "--warmup-steps", "3")
    assert "train: cached head" not in log
    assert json.loads((moved / "train_log.json").read_text())["train"]["config"]["warmup_steps"] == 3
    tuned = load_file(moved / "model.safetensors")
    assert any(not (tuned[k] == v).all() for k, v in start.items())
    log = _train(gqa, prompts, moved, work, capsys, "--init-head", str(first), "--warmup-steps", "3")
    assert "train: cached head" in log


def test_a_bad_init_head_fails_before_any_stage(gqa, prompts, tmp_path, capsys):
    work = tmp_path / "w"
    base = ["--model", str(gqa.target_dir), "--out", str(tmp_path / "h"), "--work", str(work), "--prompts",
            str(prompts), *SMALL]
    assert cli.main([*base, "--init-head", str(tmp_path / "none")]) == 2
    assert "--init-head" in capsys.readouterr().err and not (work / "data").exists()
    # an EAGLE-1/2 head where --arch eagle3 is asked for
    assert cli.main([*base, "--init-head", str(gqa.head_dir), "--arch", "eagle3", "--feature-layers", "0,1"]) == 2
    err = capsys.readouterr().err
    assert "is an EAGLE-1/2 head but --arch is eagle3" in err and not (work / "data").exists()
    assert cli.main([*base, "--init-head", str(gqa.head_dir), "--init-from-layer", "0"]) == 2
    assert "--init-head and --init-from-layer" in capsys.readouterr().err and not (work / "data").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli.main([*base, "--init-head", str(empty)]) == 2
    assert f"draft head folder {empty} has no config.json" in capsys.readouterr().err and not (work / "data").exists()


def _normalise(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def test_training_prompts_are_disjoint_from_the_evaluation_sets():
    """No evaluation prompt (HumanEval, the chat set) appears in the training prompts, nor
    contains or is contained in one (whitespace and case ignored)."""
    train = {_normalise(p["prompt"]) for p in prompt_set("train")}
    assert len(train) > 1000
    for name in ("humaneval", "chat"):
        evaluation = [_normalise(p["prompt"]) for p in prompt_set(name)]
        assert evaluation
        assert not train.intersection(evaluation), name
        long_eval = [e for e in evaluation if len(e) >= 40]
        overlaps = [e[:60] for e in long_eval if any(e in t for t in train)]
        overlaps += [t[:60] for t in train if len(t) >= 40 and any(t in e for e in evaluation)]
        assert not overlaps, (name, overlaps[:3])


def test_eagle3_arch_writes_a_loadable_eagle3_head(gqa, prompts, tmp_path, capsys):
    """--arch eagle3: the taps are cached with the features, the head is written in the
    yuhuili/SpecForge layout with its draft vocabulary (d2t/t2d), and loads back as EAGLE-3."""
    from eagle_deploy.heads.api import load_head
    from eagle_deploy.heads.eagle3 import Eagle3Head

    out, work = tmp_path / "head3", tmp_path / "work3"
    _train(gqa, prompts, out, work, capsys, "--arch", "eagle3", "--feature-layers", "0,1", "--draft-vocab", "64",
           "--unroll", "2")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 64
    assert config["eagle_aux_hidden_state_layer_ids"] == [0, 1]
    tensors = load_file(out / "model.safetensors")
    assert {"d2t", "t2d", "fc.weight", "midlayer.hidden_norm.weight", "lm_head.weight"} <= set(tensors)
    assert tensors["lm_head.weight"].shape == (64, 64) and int(tensors["t2d"].sum()) == 64
    head = load_head(out, gqa.hf)
    assert isinstance(head, Eagle3Head) and head.cfg.feature_layers == (0, 1)
    log = _train(gqa, prompts, out, work, capsys, "--arch", "eagle3", "--feature-layers", "0,1", "--draft-vocab", "64",
                 "--unroll", "2")
    assert "features: cached" in log and "train: cached head" in log
    with pytest.raises(SystemExit):
        cli.main(["--model", str(gqa.target_dir), "--out", str(out), "--arch", "eagle3", "--feature-layers", "x"])
    assert cli.main(["--model", str(gqa.target_dir), "--out", str(tmp_path / "bad"), "--work", str(work),
                     "--prompts", str(prompts), *SMALL, "--arch", "eagle3", "--feature-layers", "1,0"]) == 2
    assert "--feature-layers" in capsys.readouterr().err


def test_bad_data_and_draft_vocab_fail_before_any_stage(gqa, tmp_path, capsys):
    work = tmp_path / "w"
    rc = cli.main(["--model", str(gqa.target_dir), "--out", str(tmp_path / "h"), "--work", str(work),
                   "--data", str(tmp_path / "nope.npz")])
    assert rc == 2 and "--data" in capsys.readouterr().err and not work.exists()
    rc = cli.main(["--model", str(gqa.target_dir), "--out", str(tmp_path / "h"), "--work", str(work), "--arch",
                   "eagle3", "--feature-layers", "0,1", "--draft-vocab", "999999", "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 2 and "--draft-vocab 999999 must be in [1, 256]" in err
    assert not (work / "data").exists() and not (work / cache.FEATURES_DIR).exists()


def test_prompt_files_in_the_usual_chat_layouts(tmp_path):
    from eagle_deploy.train.data import read_jsonl

    rows = [{"prompt": "plain one", "category": "qa"},
            {"conversations": [{"from": "system", "value": "be nice"}, {"from": "human", "value": "sharegpt one"},
                               {"from": "gpt", "value": "an answer"}]},
            {"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "openai one"}],
             "source": "oasst"}]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    array = tmp_path / "p.json"
    array.write_text(json.dumps(rows))
    for path in (jsonl, array):
        got = read_jsonl(path)
        assert [r["prompt"] for r in got] == ["plain one", "sharegpt one", "openai one"]
        assert [r["category"] for r in got] == ["qa", "default", "oasst"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"conversations": [{"from": "gpt", "value": "a"}]}))
    with pytest.raises(ValueError, match=r"bad.jsonl:2: no user turn"):
        read_jsonl(bad)
    bad.write_text("{oops\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: not JSON"):
        read_jsonl(bad)
    # JSON strings may hold U+2028 / U+0085 / U+001C unescaped: only "\n" ends a JSONL record
    # (str.splitlines() split the 573rd prompt of the licensed training set in two)
    odd = tmp_path / "odd.jsonl"
    text = json.dumps({"prompt": "a\u2028b\x85c\x1cd"}, ensure_ascii=False)
    odd.write_text(text + "\n" + json.dumps({"prompt": "e"}), encoding="utf-8")
    assert [r["prompt"] for r in read_jsonl(odd)] == ["a\u2028b\x85c\x1cd", "e"]


def test_decontamination_drops_prompts_that_share_13_words_with_an_evaluation_set(tmp_path):
    from eagle_deploy.train.data import decontaminate, evaluation_texts

    spec = tmp_path / "question.jsonl"
    quote = "the quick brown fox jumps over the lazy dog while thirteen words make a gram here"
    spec.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": [f"Q: {quote}?", "second turn"]}) + "\n")
    texts = evaluation_texts([spec])
    assert any(quote in t for t in texts) and "second turn" in texts
    prompts = [{"prompt": f"Please answer: {quote.upper()} now", "category": "qa"},
               {"prompt": "the quick brown fox jumps over the lazy dog", "category": "qa"},  # 9 words only
               {"prompt": "write code", "category": "code"}]
    kept, dropped = decontaminate(prompts, texts)
    assert [p["prompt"] for p in kept] == [prompts[1]["prompt"], "write code"] and dropped == {"qa": 1}


def test_the_train_log_counts_sequences_by_category(gqa, tmp_path, capsys):
    path = tmp_path / "cats.jsonl"
    rows = [{"prompt": f"count to {i} please", "category": "math" if i % 2 else "chat"} for i in range(6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out, work = tmp_path / "head", tmp_path / "work"
    log = _train(gqa, path, out, work, capsys)
    by = json.loads((out / "train_log.json").read_text())["data"]["by_category"]
    assert {c: v["sequences"] for c, v in by.items()} == {"chat": 3, "math": 3}
    assert all(v["response_tokens"] > 0 for v in by.values())
    assert "data by category: chat 3 seq /" in log


def test_data_parts_resume_from_a_data_dir_and_refuse_other_settings(gqa, prompts, tmp_path, capsys):
    """--stop-after data writes only the parts, into --data-dir; a later run with the same prompts
    and settings reuses them (a committed folder resumes on another machine); a part made with
    other generation settings or for other prompts is refused, naming what differs."""
    parts, work = tmp_path / "tokens", tmp_path / "work"
    log = _train(gqa, prompts, tmp_path / "head", work, capsys, "--data-dir", str(parts), "--stop-after", "data")
    assert "stopped after the data stage" in log and "tok/s" in log
    assert [p.name for p in parts.glob("*")] == ["part-00000.npz"]
    assert not (work / cache.FEATURES_DIR).exists() and not (tmp_path / "head").exists()
    made = parts.joinpath("part-00000.npz").stat().st_mtime_ns
    _train(gqa, prompts, tmp_path / "head", tmp_path / "elsewhere", capsys, "--data-dir", str(parts))
    assert parts.joinpath("part-00000.npz").stat().st_mtime_ns == made and (tmp_path / "head" / "config.json").exists()

    argv = ["--model", str(gqa.target_dir), "--out", str(tmp_path / "h2"), "--data-dir", str(parts),
            "--prompts", str(prompts), *SMALL]
    argv[argv.index("--max-new-tokens") + 1] = "9"
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "part-00000.npz was generated with other settings (max_new_tokens: 8 there, 9 here)" in err
    assert "--data-dir" in err
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"name {i} colours"}) + "\n" for i in range(6)))
    argv = ["--model", str(gqa.target_dir), "--out", str(tmp_path / "h3"), "--data-dir", str(parts),
            "--prompts", str(other), *SMALL]
    assert cli.main(argv) == 2
    assert "holds other prompts than this run's chunk (6 of its ids are not in" in capsys.readouterr().err
    (tmp_path / "same").mkdir()  # the same file name and ids, other texts: refused too
    (tmp_path / "same" / "prompts.jsonl").write_text(prompts.read_text().replace("count to", "spell"))
    argv[argv.index("--prompts") + 1] = str(tmp_path / "same" / "prompts.jsonl")
    assert cli.main(argv) == 2
    assert "(the same ids with other texts: another prompt file)" in capsys.readouterr().err
    argv[argv.index("--prompts") + 1] = str(prompts)  # a larger --limit cannot grow the short last part
    argv[argv.index("--limit") + 1] = "5"
    assert cli.main(argv) == 2
    argv[argv.index("--limit") + 1] = "7"
    (tmp_path / "seven.jsonl").write_text(prompts.read_text() + json.dumps({"id": "p6", "prompt": "more"}) + "\n")
    argv[argv.index("--prompts") + 1] = str(tmp_path / "seven.jsonl")
    assert cli.main(argv) == 2
    assert "this run's chunk has 1 more prompts: a larger --limit" in capsys.readouterr().err


def test_parts_of_another_target_and_damaged_caches(gqa, mha, prompts, tmp_path, capsys):
    """A part made by another target is refused; a part that cannot be read is an error naming
    it; a feature block that cannot be read is recomputed."""
    parts, work = tmp_path / "tokens", tmp_path / "work"
    _train(gqa, prompts, tmp_path / "head", work, capsys, "--data-dir", str(parts))
    argv = ["--model", str(mha.target_dir), "--out", str(tmp_path / "h2"), "--data-dir", str(parts),
            "--prompts", str(prompts), *SMALL]
    assert cli.main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(err) == 1 and "was generated with other settings (target:" in err[0]

    block = work / cache.FEATURES_DIR / "block-00000.pt"
    block.write_bytes(block.read_bytes()[:100])
    log = _train(gqa, prompts, tmp_path / "head", work, capsys, "--data-dir", str(parts))
    assert f"features: {block} cannot be read" in log and "train: cached head" in log  # same features again
    part = parts / "part-00000.npz"
    part.write_text("version https://git-lfs.github.com/spec/v1\n")
    argv[1] = str(gqa.target_dir)
    assert cli.main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(err) == 1 and f"{part} is not a readable token-data part" in err[0]


def test_bad_chunk_settings_fail_before_any_stage(gqa, prompts, tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # --device cuda is refused as on a CPU machine
    work = tmp_path / "w"
    base = ["--model", str(gqa.target_dir), "--out", str(tmp_path / "h"), "--work", str(work), "--prompts",
            str(prompts), *SMALL]
    assert cli.main([*base, "--features-time-budget-min", "5", "--no-cache-features"]) == 2
    assert "drop --no-cache-features" in capsys.readouterr().err
    assert cli.main([*base, "--gen-time-budget-min", "-1"]) == 2
    assert "must be >= 0" in capsys.readouterr().err
    assert cli.main([*base, "--max-steps", "-3"]) == 2
    assert "--max-steps must be >= 0" in capsys.readouterr().err
    assert cli.main([*base, "--max-seq-len", "1"]) == 2
    assert "--max-seq-len must be >= 2" in capsys.readouterr().err
    for flags, message in ((["--epochs", "0"], "--epochs must be > 0, got 0.0"), (["--lr", "-1"], "--lr must be >= 0"),
                           (["--unroll", "0"], "--unroll must be >= 1"),
                           (["--gen-batch", "0"], "--gen-batch must be >= 1"),
                           (["--modes", "0,x"], "--modes: comma-separated sampling temperatures >= 0"),
                           (["--device", "cuda"], "--device cuda: no CUDA device is usable here"),
                           (["--max-new-tokens", "0"], "--max-new-tokens 0 answers no prompt"),
                           (["--max-new-tokens", "-1"], "--max-new-tokens must be >= 0")):
        assert cli.main([*base, *flags]) == 2, flags
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(err) == 1 and message in err[0] and not work.exists(), (flags, err)
    from eagle_deploy.train.trainer import TrainConfig

    assert cli.MAX_SEQ_LEN == TrainConfig.max_seq_len  # the flag's default is the trainer's
    (tmp_path / "afile").write_text("x")
    assert cli.main([*base, "--data-dir", str(tmp_path / "afile")]) == 2
    assert "--data-dir" in capsys.readouterr().err and not work.exists()
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    base[base.index("--prompts") + 1] = str(empty)
    assert cli.main(base) == 2
    assert f"no prompts to answer in {empty}" in capsys.readouterr().err


def test_bf16_data_and_features_on_a_cpu(gqa, prompts, tmp_path, capsys, monkeypatch):
    """--torch-dtype bf16 on a CPU: refused without native bf16; with it, a bf16 copy makes the
    data and features (checked against fp32 in the log) and the fp32 model stays fp32."""

    assert train_data.cpu_has_native_bf16("flags\t: fpu avx2 avx512f avx512_bf16\n")
    assert train_data.cpu_has_native_bf16("flags\t: fpu amx_bf16 amx_tile\n")
    assert not train_data.cpu_has_native_bf16("flags\t: fpu avx2 avx512f avx512_vnni\nbugs\t: avx512_bf16\n")
    monkeypatch.setattr(train_data, "cpu_has_native_bf16", lambda cpuinfo=None: False)
    assert cli.main(["--model", str(gqa.target_dir), "--out", str(tmp_path / "h"), "--work", str(tmp_path / "w"),
                     "--prompts", str(prompts), *SMALL, "--torch-dtype", "bf16"]) == 2
    assert "needs native bf16 instructions" in capsys.readouterr().err and not (tmp_path / "w").exists()
    monkeypatch.setattr(train_data, "cpu_has_native_bf16", lambda cpuinfo=None: True)
    log = _train(gqa, prompts, tmp_path / "head", tmp_path / "work", capsys, "--torch-dtype", "bf16")
    found = re.search(r"features checked against fp32 on 6 sequences: cosine similarity >= ([0-9.]+) per sequence "
                      r"\(mean\), >= ([0-9.]+) per position", log)
    assert 0.999 <= float(found[1]) <= 1.0 and 0.99 <= float(found[2]) <= float(found[1])
    part = train_data.TokenData.load(tmp_path / "work" / "data" / "part-00000.npz")
    assert part.header["generation"]["torch_dtype"] == "bf16"
    # the bf16 parts resume on a CPU without native bf16 (fp32): kept, said, not regenerated
    made = (tmp_path / "work" / "data" / "part-00000.npz").stat().st_mtime_ns
    monkeypatch.setattr(train_data, "cpu_has_native_bf16", lambda cpuinfo=None: False)
    log = _train(gqa, prompts, tmp_path / "head", tmp_path / "work", capsys, "--stop-after", "data")
    assert "part-00000.npz was generated in bf16, this run generates in fp32: kept" in log
    assert (tmp_path / "work" / "data" / "part-00000.npz").stat().st_mtime_ns == made


def test_features_go_in_blocks_that_a_time_budget_splits_across_runs(gqa, prompts, tmp_path, capsys, monkeypatch):
    """Features are cached per block of sequences; with a spent time budget every run finishes
    one more block and stops, the last run trains on all of them, as one uninterrupted run does."""
    monkeypatch.setattr(cache, "FEATURE_BLOCK", 2)  # 6 sequences: 3 blocks
    work = tmp_path / "work"
    for left in (2, 1):  # exit status 3: run the same command again
        log = _train(gqa, prompts, tmp_path / "head", work, capsys, "--features-time-budget-min", "1e-9",
                     status=cli.UNFINISHED)
        assert f"with {left} of 3 blocks left" in log and not (tmp_path / "head").exists()
    assert sorted(p.name for p in (work / cache.FEATURES_DIR).iterdir()) == [f"block-0000{i}.pt" for i in range(2)]
    log = _train(gqa, prompts, tmp_path / "head", work, capsys, "--features-time-budget-min", "1e-9")
    assert "3 of 3 blocks done" in log and "blocks left" not in log
    _train(gqa, prompts, tmp_path / "whole", tmp_path / "work2", capsys)
    one = load_file(tmp_path / "whole" / "model.safetensors")
    assert all((one[k] == v).all() for k, v in load_file(tmp_path / "head" / "model.safetensors").items())


def test_a_generation_budget_makes_a_part_per_run_and_says_when_prompts_are_left(gqa, prompts, tmp_path, capsys,
                                                                                   monkeypatch):
    """--stop-after data with a spent --gen-time-budget-min: every run adds one part and exits
    with status 3 while prompts are left, then 0; the parts are those of one uninterrupted run."""
    monkeypatch.setattr(cache, "PART_PROMPTS", 2)  # 6 prompts, --gen-batch 2: 3 parts
    parts = tmp_path / "tokens"
    chunked = ["--gen-batch", "2", "--data-dir", str(parts), "--stop-after", "data"]
    for n, left in ((1, 4), (2, 2)):
        log = _train(gqa, prompts, tmp_path / "h", tmp_path / "w", capsys, *chunked, "--gen-time-budget-min", "1e-9",
                     status=cli.UNFINISHED)
        assert len(list(parts.glob("part-*.npz"))) == n and f"{left} prompts left: run the same command again" in log
    log = _train(gqa, prompts, tmp_path / "h", tmp_path / "w", capsys, *chunked, "--gen-time-budget-min", "1e-9")
    assert len(list(parts.glob("part-*.npz"))) == 3 and "prompts left" not in log
    whole = tmp_path / "whole"
    _train(gqa, prompts, tmp_path / "h", tmp_path / "w2", capsys, "--gen-batch", "2", "--data-dir", str(whole),
           "--stop-after", "data")
    for name in ("part-00000.npz", "part-00001.npz", "part-00002.npz"):
        a, b = train_data.TokenData.load(parts / name), train_data.TokenData.load(whole / name)
        assert (a.tokens == b.tokens).all() and (a.offsets == b.offsets).all()


def test_a_generation_budget_starts_no_part_it_would_overrun():
    """The next part starts only if the last part's duration still fits in the budget."""
    assert cache.part_fits(10.0, 20.0, 0.0)  # no budget
    assert cache.part_fits(30.0, 20.0, 60.0) and cache.part_fits(40.0, 20.0, 60.0)
    assert not cache.part_fits(41.0, 20.0, 60.0)  # 41 + 20 > 60: it would end past the budget
    assert not cache.part_fits(70.0, 0.0, 60.0)  # already past it


def test_the_data_key_sees_the_order_of_sequences():
    from eagle_deploy.train.data import TokenData

    a = TokenData.from_sequences([[1, 2, 3], [4, 5]], [1, 1], [{}, {}])
    b = TokenData.from_sequences([[4, 5], [1, 2, 3]], [1, 1], [{}, {}])
    c = TokenData.from_sequences([[1, 2, 3], [4, 5]], [2, 1], [{}, {}])
    assert len({json.dumps(cache.data_key(d)) for d in (a, b, c)}) == 3
    assert cache.data_key(a) == cache.data_key(TokenData.from_sequences([[1, 2, 3], [4, 5]], [1, 1], [{}, {}]))


def test_answers_from_an_export_of_the_target(gqa, mha, prompts, tmp_path, capsys):
    """--answers-from: the export's target graph writes the data stage's answers, each exactly
    what that export's own greedy vanilla decoding gives the same prompt ids, recorded in the
    part's header; an export of other weights and sampled --modes are refused before any part."""
    parts = tmp_path / "tokens"
    _train(gqa, prompts, tmp_path / "head", tmp_path / "work", capsys, "--data-dir", str(parts), "--stop-after",
           "data", "--answers-from", str(gqa.export_dir))
    part = train_data.TokenData.load(parts / "part-00000.npz")
    assert part.header["generation"]["answers_from"]["quant"] == gqa.manifest.target.quant
    assert len(part) == 6 and part.response_tokens > 0
    rt = gqa.runtime()
    for i in range(len(part)):
        seq, n = part.sequence(i), int(part.prompt_lens[i])
        alone = rt.generate([int(t) for t in seq[:n]], max_new_tokens=8, mode="vanilla").token_ids
        assert list(seq[n:]) == list(alone)

    for extra, says in [(["--answers-from", str(mha.export_dir)], "was exported from other weights than --model's"),
                        (["--answers-from", str(gqa.export_dir), "--modes", "0,0.7"], "answers greedily only")]:
        argv = ["--model", str(gqa.target_dir), "--out", str(tmp_path / "h2"), "--data-dir", str(tmp_path / "t2"),
                "--prompts", str(prompts), *SMALL, *extra]
        assert cli.main(argv) == 2
        assert says in capsys.readouterr().err and not (tmp_path / "t2").exists()


def test_head_layers_trains_and_writes_a_deeper_eagle_head(gqa, prompts, tmp_path, capsys):
    """--head-layers 2: a 2-layer EAGLE-1/2 head (config num_hidden_layers 2, layer 1 with its
    input norm) that loads back; with --init-from-layer L its layer i starts as target layer
    L + i; a start past the target's layers, or an --init-head of another depth, is refused
    before any stage."""
    import torch
    from safetensors.torch import load_file as load_torch

    from eagle_deploy.heads.api import load_head

    out, work = tmp_path / "deep", tmp_path / "work"
    log = _train(gqa, prompts, out, work, capsys, "--head-layers", "2")
    assert "arch eagle (2 head layers)" in log and "train: cached head" not in log
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2
    tensors = load_file(out / "model.safetensors")
    assert "layers.1.input_layernorm.weight" in tensors and "layers.0.input_layernorm.weight" not in tensors
    assert load_head(out, gqa.hf).dims.num_layers == 2

    copied = tmp_path / "copied"  # lr 0: the written head is its start, the target's layers 0 and 1
    log = _train(gqa, prompts, copied, work, capsys, "--head-layers", "2", "--init-from-layer", "0", "--lr", "0")
    assert "train: cached head" not in log
    head, target = load_torch(str(copied / "model.safetensors")), gqa.hf.state_dict()
    for i in (0, 1):
        for name in ("self_attn.q_proj.weight", "mlp.down_proj.weight", "post_attention_layernorm.weight"):
            assert torch.equal(head[f"layers.{i}.{name}"], target[f"model.layers.{i}.{name}"]), (i, name)
    assert torch.equal(head["layers.1.input_layernorm.weight"], target["model.layers.1.input_layernorm.weight"])

    fresh = tmp_path / "fresh"
    assert cli.main(["--model", str(gqa.target_dir), "--out", str(tmp_path / "x"), "--work", str(fresh),
                     "--prompts", str(prompts), *SMALL, "--head-layers", "2", "--init-from-layer", "1"]) == 2
    assert ("--init-from-layer 1 needs target layers 1..2, but the target has layers 0..1"
            in capsys.readouterr().err) and not (fresh / "data").exists()
    assert cli.main(["--model", str(gqa.target_dir), "--out", str(tmp_path / "x"), "--work", str(fresh),
                     "--prompts", str(prompts), *SMALL, "--init-head", str(out)]) == 2
    assert f"--init-head {out} has 2 decoder layers, not --head-layers 1" in capsys.readouterr().err
    assert not (fresh / "data").exists()
