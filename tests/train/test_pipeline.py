"""eagle-train's typed settings and its Python entry point: the presets hold the values the
flags document, the flags and a hand-built `TrainSettings` are the same run, and
`pipeline.run(settings)` is the command's run (the same caches, the same head)."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from eagle_deploy.train import cli, pipeline
from eagle_deploy.train.settings import CPU_QUICK, GPU, MAX_SEQ_LEN, PRESETS, Recipe, TrainSettings


def test_the_presets_are_named_recipes_with_the_documented_values():
    assert PRESETS == {"cpu-quick": CPU_QUICK, "gpu": GPU}
    assert CPU_QUICK.as_dict() == {"limit": 900, "modes": "0", "max_new_tokens": 160, "gen_batch": 32, "epochs": 6.0,
                                   "batch_tokens": 2048, "lr": 6e-4, "ce_topk": 32, "unroll": 1,
                                   "time_budget_min": 30.0, "warmup_steps": 100}
    assert GPU.as_dict() == {"limit": 0, "modes": "0,0.7", "max_new_tokens": 256, "gen_batch": 512, "epochs": 6.0,
                             "batch_tokens": 32768, "lr": 1e-3, "ce_topk": 0, "unroll": 3, "time_budget_min": 0.0,
                             "warmup_steps": 100}
    assert GPU.temperatures == [0.0, 0.7] and replace(GPU, max_new_tokens=0).temperatures == [0.0]
    # an int where the flag parses a float: the recipe (a cache key) is the one `--epochs 1` gives
    assert json.dumps(replace(CPU_QUICK, epochs=1, time_budget_min=0).as_dict()) == json.dumps(
        {**CPU_QUICK.as_dict(), "epochs": 1.0, "time_budget_min": 0.0})


def test_the_flags_build_the_settings_a_python_caller_writes(tmp_path):
    args = cli.build_parser().parse_args(["--model", "m", "--out", str(tmp_path / "h"), "--preset", "gpu",
                                          "--epochs", "2", "--feature-layers", "0,1", "--arch", "eagle3",
                                          "--data", str(tmp_path / "a.npz"), "--no-cache-features"])
    assert cli.settings_from_args(args) == TrainSettings(
        model="m", out=str(tmp_path / "h"), arch="eagle3", recipe=replace(GPU, epochs=2.0), feature_layers=[0, 1],
        data=[str(tmp_path / "a.npz")], cache_features=False)
    defaults = cli.settings_from_args(cli.build_parser().parse_args(["--model", "m", "--out", "h"]))
    assert defaults == TrainSettings(model="m", out=Path("h")) and defaults.recipe == CPU_QUICK
    assert defaults.max_seq_len == MAX_SEQ_LEN and defaults.work_dir == Path("h.work")
    assert defaults.parts_dir == Path("h.work") / "data"


@pytest.mark.parametrize("change, message", [
    ({"arch": "eagle4"}, "--arch 'eagle4' is not one of eagle, eagle3"),
    ({"stop_after": "train"}, "--stop-after 'train' is not one of None, data, features"),
    ({"recipe": replace(CPU_QUICK, unroll=0)}, "--unroll must be >= 1, got 0"),
    ({"max_seq_len": 1}, "--max-seq-len must be >= 2"),
])
def test_settings_check_names_the_flag(change, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        TrainSettings(model="m", out=tmp_path / "h", **change).check()
    assert not (tmp_path / "h.work").exists()


def test_run_from_python_is_the_commands_run(gqa, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"count to {i} please"}) + "\n" for i in range(6)))
    work, out = tmp_path / "work", tmp_path / "head"
    recipe = Recipe(limit=6, modes="0", max_new_tokens=8, gen_batch=4, epochs=1, batch_tokens=64, lr=6e-4, ce_topk=32,
                    unroll=1, time_budget_min=0, warmup_steps=100)
    settings = TrainSettings(model=str(gqa.target_dir), out=out, work=work, prompts=str(prompts), recipe=recipe,
                             device="cpu")
    result = pipeline.run(replace(settings, stop_after="data"))
    assert result.finished and result.status == 0 and result.head is None and list(result.timings) == ["data_s"]
    assert cli.main(["--model", str(gqa.target_dir), "--out", str(out), "--work", str(work), "--prompts", str(prompts),
                     "--limit", "6", "--modes", "0", "--max-new-tokens", "8", "--gen-batch", "4", "--epochs", "1",
                     "--batch-tokens", "64", "--time-budget-min", "0", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.strip() == str(out)  # the command prints the head's folder
    result = pipeline.run(settings)  # the same run: every stage cached, the head written again
    assert result.finished and result.head == out and list(result.timings) == ["data_s", "features_s", "train_s",
                                                                               "total_s"]
    assert any("train: cached head" in line for line in result.log) and any("features: cached" in line
                                                                            for line in result.log)
    assert json.loads(json.dumps(result.history)) == json.loads((out / "train_log.json").read_text())["train"]
