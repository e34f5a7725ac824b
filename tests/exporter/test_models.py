"""Model resolution (exporter.models) and its CLI errors: fail fast, one clear message, no
traceback, nothing written."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eagle_deploy.exporter.cli import main
from eagle_deploy.exporter.models import ModelNotAvailableError, resolve_draft, resolve_model
from eagle_deploy.exporter.target import FAMILIES, UnsupportedModelError, check_family

FAMILY_NAMES = list(FAMILIES)


def _cli(args, tmp_path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_DISABLE_TELEMETRY": "1"}
    return subprocess.run([sys.executable, "-m", "eagle_deploy.exporter.cli", *args,
                           "--out", str(tmp_path / "engines")], capture_output=True, text=True, timeout=120, env=env)


def _one_error(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("eagle-export: error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def test_unknown_hub_id_fails_fast_with_download_steps(tmp_path):
    repo = "no-such-org-eagle/definitely-not-a-model"
    t0 = time.perf_counter()
    proc = _cli(["--model", repo], tmp_path)
    elapsed = time.perf_counter() - t0
    assert proc.returncode == 2
    line = _one_error(proc.stderr)
    assert repo in line and "--local-dir" in line and "--model <dir>" in line
    command = re.search(r"`([^`]+)`", line).group(1).split()
    assert command[1:3] == ["download", repo]
    # the command the message names exists in this environment
    assert shutil.which(command[0]) or (Path(sys.executable).parent / command[0]).exists(), command[0]
    assert elapsed < 60, f"took {elapsed:.1f}s: resolution must not wait on the network"
    assert not (tmp_path / "engines").exists()


def test_missing_hub_alias_names_both_downloads_and_flags(tmp_path, monkeypatch):
    """An alias whose target is not cached: one line naming the target and head downloads and
    the --model/--draft flags to use instead."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotAvailableError) as err:
        resolve_model("llama2-7b")
    msg = str(err.value)
    assert "`hf download meta-llama/Llama-2-7b-chat-hf --local-dir <model-dir>`" in msg
    assert "`hf download yuhuili/EAGLE-llama2-chat-7B --local-dir <head-dir>`" in msg
    assert "--model <model-dir> --draft <head-dir>" in msg and "\n" not in msg


@pytest.mark.parametrize("alias, target, head", [
    ("llama3.1-8b", "meta-llama/Llama-3.1-8B-Instruct", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"),
    ("llama3.1-8b-speculators", "meta-llama/Llama-3.1-8B-Instruct", "RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3"),
])
def test_eagle3_aliases_fail_offline_with_the_same_message(alias, target, head, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotAvailableError) as err:
        resolve_model(alias)
    msg = str(err.value)
    assert f"`hf download {target} --local-dir <model-dir>`" in msg
    assert f"`hf download {head} --local-dir <head-dir>`" in msg
    assert "--model <model-dir> --draft <head-dir>" in msg and "\n" not in msg


def test_unknown_hub_draft_names_download_steps():
    with pytest.raises(ModelNotAvailableError, match=r"download no-such-org-eagle/head .*--draft <dir>"):
        resolve_draft("no-such-org-eagle/head")


def test_unknown_name_lists_aliases(tmp_path, capsys):
    rc = main(["--model", "not-a-model-name", "--out", str(tmp_path / "engines")])
    line = _one_error(capsys.readouterr().err)
    assert rc == 2
    assert "'not-a-model-name'" in line and "smollm2-135m" in line
    assert not (tmp_path / "engines").exists()


def test_gpt2_folder_is_refused_listing_supported_families(tmp_path, capsys):
    from transformers import GPT2Config

    folder = tmp_path / "gpt2"
    cfg = GPT2Config(n_layer=1, n_embd=32, n_head=2)
    cfg.architectures = ["GPT2LMHeadModel"]
    cfg.save_pretrained(folder)
    with pytest.raises(UnsupportedModelError):
        resolve_model(str(folder))
    rc = main(["--model", str(folder), "--out", str(tmp_path / "engines")])
    line = _one_error(capsys.readouterr().err)
    assert rc == 2
    assert "GPT2LMHeadModel" in line and all(f in line for f in FAMILY_NAMES)
    assert not (tmp_path / "engines").exists()


@pytest.mark.parametrize("content", ['{"model_type": "llama", ', "", "[1, 2]"])
def test_corrupt_config_json_gives_one_clear_error(tmp_path, content, capsys):
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "config.json").write_text(content)
    # in-process (the CLI's exit code through a real child process: test_unknown_hub_id_fails_fast_...)
    rc = main(["--model", str(folder), "--out", str(tmp_path / "engines")])
    assert rc == 2
    line = _one_error(capsys.readouterr().err)
    assert str(folder / "config.json") in line
    assert not (tmp_path / "engines").exists()


def test_folder_without_config_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UnsupportedModelError, match="no config.json"):
        resolve_model(str(tmp_path / "empty"))


def test_existing_non_model_file_is_refused(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"x")
    with pytest.raises(UnsupportedModelError, match="neither a Hugging Face model folder nor a .gguf"):
        resolve_model(str(path))


def test_corrupt_gguf_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE_DEPLOY_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + b"\0" * 60)
    with pytest.raises(UnsupportedModelError, match="cannot load GGUF file"):
        resolve_model(str(path))
    assert not any((tmp_path / "cache").rglob("config.json"))


def test_tiny_folder_resolves(mha):
    ckpt = resolve_model(str(mha.target_dir))
    assert ckpt.hf_dir == mha.target_dir.resolve() and ckpt.name == mha.target_dir.name
    assert ckpt.default_draft is None


@pytest.mark.parametrize("kind, kwargs, message", [
    ("llama", {"hidden_act": "gelu"}, "hidden_act"),
    ("mistral", {"sliding_window": 16}, "sliding-window"),
])
def test_unsupported_configurations_are_named(kind, kwargs, message):
    from transformers import LlamaConfig, MistralConfig

    cfg = (LlamaConfig if kind == "llama" else MistralConfig)(**kwargs)
    cfg.architectures = ["LlamaForCausalLM" if kind == "llama" else "MistralForCausalLM"]
    with pytest.raises(UnsupportedModelError, match=message):
        check_family(cfg)


def test_supported_families_accepted():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    for cls, arch in ((LlamaConfig, "LlamaForCausalLM"), (MistralConfig, "MistralForCausalLM"),
                      (Qwen2Config, "Qwen2ForCausalLM")):
        cfg = cls(sliding_window=None) if cls is not LlamaConfig else cls()
        cfg.architectures = [arch]
        assert check_family(cfg).architecture == arch
    gguf_style = LlamaConfig()
    gguf_style.architectures = None  # a GGUF-converted config names only its model_type
    assert check_family(gguf_style).architecture == "LlamaForCausalLM"


def test_existing_export_is_not_overwritten_without_force(mha, capsys):
    before = sorted(p.name for p in mha.export_dir.iterdir())
    rc = main(["--model", str(mha.target_dir), "--draft", str(mha.head_dir), "--out", str(mha.export_dir.parent),
               "--name", mha.name])
    line = _one_error(capsys.readouterr().err)
    assert rc == 2 and "--force" in line
    assert sorted(p.name for p in mha.export_dir.iterdir()) == before


@pytest.mark.parametrize("name", [".", "..", "/tmp/elsewhere", "a/b", ".hidden", ""])
def test_name_must_be_a_plain_folder_name_and_nothing_is_touched(mha, tmp_path, capsys, name):
    """--name . / .. with --force would replace --out itself or its parent: refused up front."""
    out_root = tmp_path / "outer" / "engines"
    keep = tmp_path / "outer" / "sibling" / "important.txt"
    keep.parent.mkdir(parents=True)
    keep.write_text("keep me")
    (out_root / "old").mkdir(parents=True)
    rc = main(["--model", str(mha.target_dir), "--draft", str(mha.head_dir), "--out", str(out_root), "--name", name,
               "--force", "--max-length", "64"])
    line = _one_error(capsys.readouterr().err)
    assert rc == 2 and "--name must be a plain folder name" in line
    assert keep.read_text() == "keep me" and sorted(p.name for p in out_root.iterdir()) == ["old"]


def test_force_onto_a_regular_file_is_refused(mha, tmp_path, capsys):
    out_root = tmp_path / "engines"
    out_root.mkdir()
    (out_root / "afile").write_text("x")
    rc = main(["--model", str(mha.target_dir), "--draft", str(mha.head_dir), "--out", str(out_root), "--name", "afile",
               "--force", "--max-length", "64"])
    line = _one_error(capsys.readouterr().err)
    assert rc == 2 and "not an export folder" in line
    assert (out_root / "afile").read_text() == "x" and sorted(p.name for p in out_root.iterdir()) == ["afile"]


def test_force_never_replaces_a_folder_that_is_not_an_export(mha, tmp_path, capsys):
    out_root = tmp_path / "engines"
    (out_root / "mine").mkdir(parents=True)
    (out_root / "mine" / "precious.txt").write_text("keep me")
    rc = main(["--model", str(mha.target_dir), "--draft", str(mha.head_dir), "--out", str(out_root), "--name", "mine",
               "--force", "--max-length", "64"])
    line = _one_error(capsys.readouterr().err)
    assert rc == 2 and "no manifest.json, not an export: --force replaces only an export folder" in line
    assert (out_root / "mine" / "precious.txt").read_text() == "keep me"
    assert sorted(p.name for p in out_root.iterdir()) == ["mine"]


def test_max_length_zero_is_refused_not_taken_as_the_default(mha, tmp_path, capsys):
    rc = main(["--model", str(mha.target_dir), "--draft", str(mha.head_dir), "--out", str(tmp_path / "e"),
               "--max-length", "0"])
    line = _one_error(capsys.readouterr().err)
    assert rc == 2 and "--max-length 0 must be in [2, " in line
    assert not (tmp_path / "e").exists() or list((tmp_path / "e").iterdir()) == []


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_model_folder_with_damaged_weights_is_one_clear_error(mha, tmp_path, capsys, damage):
    folder = tmp_path / "model"
    shutil.copytree(mha.target_dir, folder)
    weights = folder / "model.safetensors"
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:1000])
    else:
        weights.unlink()
    rc = main(["--model", str(folder), "--draft", "random", "--out", str(tmp_path / "engines"), "--max-length", "64"])
    line = _one_error(capsys.readouterr().err)
    assert rc == 2 and "cannot load the checkpoint" in line and all(f in line for f in FAMILY_NAMES)
    assert not (tmp_path / "engines").exists() or list((tmp_path / "engines").iterdir()) == []


def test_draft_vocab_smaller_than_graph_top_k_fails_before_export(mha, tmp_path, capsys):
    rc = main(["--model", str(mha.target_dir), "--draft", str(mha.head_dir), "--out", str(tmp_path / "engines"),
               "--max-length", "64", "--draft-vocab", "5"])
    line = _one_error(capsys.readouterr().err)
    assert rc == 2 and "--draft-vocab 5" in line and "--graph-top-k 10" in line
    assert not (tmp_path / "engines").exists() or list((tmp_path / "engines").iterdir()) == []


@pytest.mark.parametrize("flag", ["--total-tokens", "--depth", "--tree-top-k"])
def test_static_tree_with_size_flags_is_refused(mha, tmp_path, capsys, flag):
    rc = main(["--model", str(mha.target_dir), "--draft", str(mha.head_dir), "--out", str(tmp_path / "engines"),
               "--tree", "eagle1", flag, "3"])
    line = _one_error(capsys.readouterr().err)
    assert rc == 2 and "--tree eagle1" in line and flag in line


@pytest.mark.parametrize("flags, message", [
    (["--triton-instances", "0"], "--triton-instances must be >= 1, got 0"),
    (["--triton-instances", "2", "--triton-repo-is-a-file"], "is a file, not a folder"),
])
def test_triton_repo_flags_are_checked_before_the_export(mha, tmp_path, capsys, flags, message):
    afile = tmp_path / "afile"
    afile.write_text("x")
    repo = afile if "--triton-repo-is-a-file" in flags else tmp_path / "repo"
    flags = [f for f in flags if f != "--triton-repo-is-a-file"]
    rc = main(["--model", str(mha.target_dir), "--draft", str(mha.head_dir), "--out", str(tmp_path / "e"),
               "--max-length", "64", "--triton-repo", str(repo), *flags])
    line = _one_error(capsys.readouterr().err)
    assert rc == 2 and message in line
    assert not (tmp_path / "e").exists()  # nothing was exported first


@pytest.mark.parametrize("flags, message", [
    (["--model", ""], "--model is empty: give a model alias"),
    (["--model", "x", "--out", "{afile}"], "--out {afile} is a file, not a folder"),
    (["--model", "x", "--graph-top-k", "0"], "--graph-top-k must be an integer >= 1 (the draft graph's top-k output"),
])
def test_empty_model_and_out_that_is_a_file_are_named(tmp_path, capsys, flags, message):
    afile = tmp_path / "afile"
    afile.write_text("x")
    flags = [f.format(afile=afile) for f in flags]
    argv = flags if "--out" in flags else [*flags, "--out", str(tmp_path / "e")]
    rc = main(argv)
    line = _one_error(capsys.readouterr().err)
    assert rc == 2 and message.format(afile=afile) in line


def test_alias_end_of_turn_tokens_join_the_generation_config_once(tmp_path):
    """`Alias.eos_tokens` (qwen2.5-coder-0.5b: <|im_end|> and <|endoftext|>, where the GGUF keeps
    only the first) are appended to a converted folder's generation_config.json, which
    sources.eos_ids reads first; a folder that has them already is not rewritten."""
    import json

    from eagle_deploy.exporter.models import _add_eos
    from eagle_deploy.exporter.sources import eos_ids

    (tmp_path / "tokenizer.json").write_text(json.dumps({
        "model": {"vocab": {"a": 0, "b": 1}},
        "added_tokens": [{"id": 7, "content": "<|endoftext|>"}, {"id": 9, "content": "<|im_end|>"}]}))
    gen = tmp_path / "generation_config.json"
    gen.write_text(json.dumps({"eos_token_id": 9, "bos_token_id": 7}))
    _add_eos(tmp_path, ("<|im_end|>", "<|endoftext|>"))
    assert json.loads(gen.read_text())["eos_token_id"] == [9, 7]
    assert eos_ids(tmp_path, None, None) == [9, 7]
    before = gen.stat()
    _add_eos(tmp_path, ("<|im_end|>", "<|endoftext|>"))
    assert (gen.stat().st_ino, gen.stat().st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    with pytest.raises(UnsupportedModelError, match=re.escape("'<|eot_id|>' is not in its tokenizer")):
        _add_eos(tmp_path, ("<|eot_id|>",))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["generation_config.json", "tokenizer.json"]
