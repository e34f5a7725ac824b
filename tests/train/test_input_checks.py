"""eagle-train and eagle-eval refuse bad input at once, in one line naming the flag or file and
what is accepted: before the target or the export is loaded (`--model` / `--engines` name
nothing here, so a check that came later would report them instead), never after the work."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle_deploy.train import cli
from eagle_deploy.train import evaluate as ev
from tests.tiny_export import prompt_file, tiny_export

NO_MODEL = "no-such-model"  # resolved only after the checks under test


@pytest.fixture()
def prompts(tmp_path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"count to {i}"}) + "\n" for i in range(3)))
    return path


def _error(capsys) -> str:
    """The command's one stderr line (asserted to be one)."""
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


def _train(tmp_path, prompts, *extra) -> list[str]:
    return ["--model", NO_MODEL, "--out", str(tmp_path / "head"), "--work", str(tmp_path / "work"),
            "--prompts", str(prompts), "--device", "cpu", *extra]


def test_train_refuses_an_output_path_that_is_a_file_before_any_work(tmp_path, prompts, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    argv = _train(tmp_path, prompts)
    argv[argv.index("--out") + 1] = str(afile)
    assert cli.main(argv) == 2
    assert _error(capsys) == f"eagle-train: error: --out {afile} is a file, not a folder"
    assert not (tmp_path / "work").exists()
    assert cli.main(_train(tmp_path, prompts, "--work", str(afile / "sub"))) == 2
    assert _error(capsys) == f"eagle-train: error: --work {afile / 'sub'}: {afile} is a file, not a folder"
    assert cli.main(_train(tmp_path, prompts, "--data-dir", str(afile))) == 2
    assert _error(capsys) == f"eagle-train: error: --data-dir {afile} is a file, not a folder"
    assert not (tmp_path / "work").exists()


@pytest.mark.parametrize("flags, message", [
    (["--lr", "nan"], "--lr must be a finite number >= 0, got nan"),
    (["--lr", "inf"], "--lr must be a finite number >= 0, got inf"),
    (["--time-budget-min", "nan"], "--time-budget-min must be a finite number >= 0, got nan"),
    (["--time-budget-min", "inf"], "--time-budget-min must be a finite number >= 0, got inf"),
    (["--gen-time-budget-min", "nan"], "--gen-time-budget-min must be a finite number >= 0, got nan"),
    (["--features-time-budget-min", "nan"], "--features-time-budget-min must be a finite number >= 0, got nan"),
    (["--epochs", "nan"], "--epochs must be a finite number > 0, got nan"),
    (["--epochs", "inf"], "--epochs must be a finite number > 0, got inf"),
    (["--modes", "0,inf"], "--modes: comma-separated sampling temperatures >= 0 (0 = greedy), got '0,inf'"),
])
def test_train_refuses_nan_and_inf_settings(flags, message, tmp_path, prompts, capsys):
    assert cli.main(_train(tmp_path, prompts, *flags)) == 2
    assert _error(capsys) == f"eagle-train: error: {message}"
    assert not (tmp_path / "work").exists()


def test_train_refuses_feature_layers_without_eagle3(tmp_path, prompts, capsys):
    assert cli.main(_train(tmp_path, prompts, "--feature-layers", "1,2,3")) == 2  # --arch eagle, the default
    assert _error(capsys) == ("eagle-train: error: --feature-layers has no effect with --arch eagle: only an EAGLE-3 "
                              "head (--arch eagle3) taps several layers (an EAGLE-1/2 head reads the last layer's "
                              "features)")
    assert not (tmp_path / "work").exists()


@pytest.mark.parametrize("device", ["tpu", "cuda0", "cuda:x", "CPU", ""])
def test_train_refuses_an_unknown_device_up_front(device, tmp_path, prompts, capsys):
    argv = _train(tmp_path, prompts)
    argv[argv.index("--device") + 1] = device
    assert cli.main(argv) == 2
    assert _error(capsys) == (f"eagle-train: error: --device {device!r} is not a device this command runs on: "
                              "expected auto, cpu, cuda or cuda:N (N: a GPU index)")


def test_train_refuses_a_cuda_index_past_the_devices(tmp_path, prompts, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    argv = _train(tmp_path, prompts)
    argv[argv.index("--device") + 1] = "cuda:3"
    assert cli.main(argv) == 2
    assert _error(capsys) == ("eagle-train: error: --device cuda:3: this machine has 1 CUDA device(s): expected "
                              "cuda:0 to cuda:0, cuda, cpu or auto")


def test_train_refuses_data_that_is_not_a_token_data_part(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "hi"}\n')
    argv = ["--model", NO_MODEL, "--out", str(tmp_path / "head"), "--work", str(tmp_path / "work"), "--data", str(bad)]
    assert cli.main(argv) == 2
    assert _error(capsys) == (f"eagle-train: error: --data {bad} is not token data (not an .npz archive): expected a "
                              "token-data part written by eagle-train (WORK/data/part-*.npz, or --data-dir's)")
    import numpy as np

    other = tmp_path / "other.npz"  # an .npz, but not of eagle-train's arrays
    np.savez(other, x=np.zeros(3))
    argv[-1] = str(other)
    assert cli.main(argv) == 2
    err = _error(capsys)
    assert err.startswith(f"eagle-train: error: --data {other} is not token data (KeyError: ") and err.endswith(
        "expected a token-data part written by eagle-train (WORK/data/part-*.npz, or --data-dir's)")
    assert not (tmp_path / "work").exists()


def test_train_refuses_missing_prompt_and_decontamination_files(tmp_path, prompts, capsys):
    missing = tmp_path / "nosuch.jsonl"
    assert cli.main(_train(tmp_path, missing)) == 2
    assert _error(capsys) == (f"eagle-train: error: prompt file {missing} does not exist: expected humaneval, chat, "
                              "train or an existing JSONL file ({\"prompt\": ...} per line)")
    assert cli.main(_train(tmp_path, prompts, "--decontaminate", str(missing))) == 2
    assert _error(capsys) == (f"eagle-train: error: --decontaminate {missing} does not exist (a prompt file: JSONL, "
                              "e.g. Spec-Bench's question.jsonl)")
    assert not (tmp_path / "work").exists()


def _eval(tmp_path, *extra) -> list[str]:
    return ["--engines", str(tmp_path / "no-export"), "--max-new-tokens", "4", "--threads", "1", *extra]


def test_eval_refuses_a_json_path_it_cannot_write_before_the_export_opens(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert ev.main(_eval(tmp_path, "--prompts", "chat", "--json", str(afile / "x.json"))) == 2
    assert _error(capsys) == f"eagle-eval: error: --json {afile / 'x.json'}: {afile} is a file, not a folder"
    assert ev.main(_eval(tmp_path, "--prompts", "chat", "--json", str(tmp_path))) == 2
    assert _error(capsys) == f"eagle-eval: error: --json {tmp_path} is a folder, not a file"


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory) -> Path:
    return tiny_export(tmp_path_factory)


def test_eval_creates_the_json_folders_as_eagle_bench_does(export_dir, tmp_path, capsys):
    out = tmp_path / "new" / "dir" / "x.json"
    rc = ev.main(["--engines", str(export_dir), "--prompts", str(prompt_file(tmp_path)), "--limit", "1",
                  "--max-new-tokens", "4", "--threads", "1", "--json", str(out)])
    assert rc == 0 and json.loads(out.read_text())["max_new_tokens"] == 4


@pytest.mark.parametrize("text, line", [('{"prompt": "hi"}\n\n{"prompt": ""}\n', 3),
                                        ('{"prompt": "hi"}\n{"prompt": "  \\n "}\n', 2),
                                        ('[{"prompt": "hi"}, {"prompt": "ok"}, {"prompt": ""}]', 3)])
def test_eval_refuses_an_empty_prompt_naming_its_line(text, line, tmp_path, capsys):
    path = tmp_path / "f.jsonl"
    path.write_text(text)
    assert ev.main(_eval(tmp_path, "--prompts", str(path))) == 2
    assert _error(capsys) == (f"eagle-eval: error: {path}:{line}: the prompt is empty: every record needs a "
                              "non-empty prompt")
    assert ev.main(_eval(tmp_path, "--prompts", str(path), "--limit", "1")) == 2  # the first prompt alone runs:
    assert "no-export" in _error(capsys)  # past the prompt checks, on to the (missing) export


@pytest.mark.parametrize("text", ["", "\n\n", "[]"])
def test_eval_refuses_an_empty_prompt_file(text, tmp_path, capsys):
    path = tmp_path / "empty.jsonl"
    path.write_text(text)
    assert ev.main(_eval(tmp_path, "--prompts", str(path))) == 2
    assert _error(capsys) == (f"eagle-eval: error: {path} holds no prompts: expected a JSONL file with one "
                              "{\"prompt\": ...} per line")
    if text == "[]":
        return  # not Spec-Bench's layout (a JSON array), refused as such
    assert ev.main(_eval(tmp_path, "--specbench", str(path))) == 2
    assert _error(capsys) == (f"eagle-eval: error: --specbench {path} holds no prompts: expected Spec-Bench's "
                              "question.jsonl")


def test_eval_says_a_missing_prompt_file_does_not_exist(tmp_path, capsys):
    assert ev.main(_eval(tmp_path, "--prompts", "nosuch.jsonl")) == 2
    assert _error(capsys) == ("eagle-eval: error: prompt file nosuch.jsonl does not exist: expected humaneval, chat, "
                              "train or an existing JSONL file ({\"prompt\": ...} per line)")
    assert ev.main(_eval(tmp_path, "--prompts", "no-such-set")) == 2  # a set's name: as before
    assert _error(capsys) == ("eagle-eval: error: unknown prompt set 'no-such-set': expected humaneval, chat, train "
                              "or a JSONL file ({\"prompt\": ...} per line)")


def test_train_refuses_head_layers_with_eagle3_or_below_one(tmp_path, prompts, capsys):
    assert cli.main(_train(tmp_path, prompts, "--head-layers", "2", "--arch", "eagle3")) == 2
    assert _error(capsys) == ("eagle-train: error: --head-layers 2 applies to EAGLE-1/2 heads only (--arch eagle): an "
                              "EAGLE-3 head has one decoder layer")
    assert cli.main(_train(tmp_path, prompts, "--head-layers", "0")) == 2
    assert _error(capsys) == "eagle-train: error: --head-layers must be an integer >= 1, got 0"
    assert not (tmp_path / "work").exists()
