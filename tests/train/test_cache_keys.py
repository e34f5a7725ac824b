"""The keys eagle-train's caches are checked against, written out by hand: a token-data part's
header (`generation`, `chunk`, `recipe`), a feature block's key and `head.pt`'s key. Parts
committed under data/tokens/ and caches made by earlier runs are accepted only while these stay
byte for byte what they were, so a change here is a change of every cache."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eagle_deploy.train import cache, cli
from eagle_deploy.train.data import TokenData

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "data" / "tokens" / "smollm2-135m" / "cpu-r2"


def test_chunk_digest_data_key_and_target_fingerprint_are_pinned(tmp_path):
    rows = [{"id": f"p{i}", "prompt": f"count to {i} please"} for i in range(6)]
    assert cache.chunk_digest(rows) == "7dedb1ee2103824de7c2d5a7c56ffdb02ea6934b27286b1da71baa6b079cf8f5"
    assert cache.chunk_digest(rows[::-1]) == cache.chunk_digest(rows)  # the set of prompts, not their order
    odd = [{"id": "b", "prompt": "zwei \u00e9"}, {"id": "a", "prompt": "one"}]  # non-ASCII kept as UTF-8
    assert cache.chunk_digest(odd) == "97b50a1588dd8264668b6faa662def5c355ec854444b55619af161cf0d2a8842"
    data = TokenData.from_sequences([[1, 2, 3], [4, 5]], [1, 1], [{}, {}])
    assert cache.data_key(data) == {"sequences": 2, "tokens": 5, "sha256": "bb95a39a1d51abb0c59fd95ae9030eff7f74dcd97"
                                                                          "46b35805d4eeb462fd39f1c"}

    class Checkpoint:
        name, source, hf_dir = "tiny", tmp_path, tmp_path

    (tmp_path / "config.json").write_bytes(b'{"vocab_size": 8}\n')
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    (tmp_path / "extra.bin").write_bytes(b"y" * 3)
    assert cache.target_fingerprint(Checkpoint) == {
        "name": "tiny", "sha256": "ffa5e23c7d71315a2ecb44759a8be9c4d32453c8aa98e73d825edb1b05c5943e"}
    Checkpoint.source = tmp_path / "one.gguf"  # one file: its own sha256
    Checkpoint.source.write_bytes(b"GGUF0123")
    Checkpoint.name = "g"
    assert cache.target_fingerprint(Checkpoint) == {
        "name": "g", "sha256": "9bbe023286f6afcf1c52a671ed7076dacde4a1876ade72c19738588d3f804f32"}


@pytest.mark.skipif(not COMMITTED.is_dir(), reason="no committed token data")
def test_the_committed_parts_have_the_generation_header_todays_code_writes():
    """SmolLM2's committed parts (greedy, 256 new tokens, bf16) carry the `generation` header
    that a run with those settings expects (check_part accepts exactly this dict)."""
    target = {"name": "smollm2-135m", "sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"}
    expected = {"modes": [0.0], "max_new_tokens": 256, "torch_dtype": "bf16", "seed": None, "target": target}
    for path in sorted(COMMITTED.glob("part-*.npz")):
        part = TokenData.load(path)
        assert part.header["generation"] == expected, path
        assert json.dumps(part.header["generation"]) == json.dumps(expected)
        rows = [{"id": m["id"], "prompt": ""} for m in part.meta]
        with pytest.raises(ValueError, match="holds other prompts"):  # its settings pass; the chunk is checked next
            cache.check_part(path, part, expected, rows)


def test_a_run_writes_the_part_header_block_key_and_head_key_as_before(gqa, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"count to {i} please"}) + "\n" for i in range(6)))
    work = tmp_path / "work"
    argv = ["--model", str(gqa.target_dir), "--out", str(tmp_path / "head"), "--work", str(work), "--prompts",
            str(prompts), "--limit", "6", "--modes", "0,0.5", "--max-new-tokens", "8", "--gen-batch", "4",
            "--epochs", "1", "--batch-tokens", "64", "--time-budget-min", "0", "--device", "cpu", "--seed", "3",
            "--arch", "eagle3", "--feature-layers", "0,1", "--draft-vocab", "64", "--unroll", "2", "--max-steps", "2",
            "--max-seq-len", "512", "--prompt-positions"]
    assert cli.main(argv) == 0
    capsys.readouterr()
    part = TokenData.load(work / "data" / "part-00000.npz")
    target = part.header["generation"]["target"]
    assert set(target) == {"name", "sha256"} and len(target["sha256"]) == 64
    assert list(part.header) == ["generation", "chunk", "recipe", "prompts", "seconds"]
    assert json.dumps(part.header["generation"]) == json.dumps(
        {"modes": [0.0, 0.5], "max_new_tokens": 8, "torch_dtype": "fp32", "seed": 3, "target": target})
    assert part.header["chunk"] == "7dedb1ee2103824de7c2d5a7c56ffdb02ea6934b27286b1da71baa6b079cf8f5"
    recipe = {"limit": 6, "modes": "0,0.5", "max_new_tokens": 8, "gen_batch": 4, "epochs": 1.0, "batch_tokens": 64,
              "lr": 0.0006, "ce_topk": 32, "unroll": 2, "time_budget_min": 0.0, "warmup_steps": 100}
    assert json.dumps(part.header["recipe"]) == json.dumps(recipe)
    assert part.header["prompts"] == str(prompts)

    block = torch.load(work / cache.FEATURES_DIR / "block-00000.pt", weights_only=True)
    assert set(block) == {"key", "features"} and len(block["features"]) == len(part) == 12
    assert block["key"] == {**cache.data_key(part), "torch_dtype": "fp32", "target": target, "feature_layers": [0, 1]}
    assert list(block["key"]) == ["sequences", "tokens", "sha256", "torch_dtype", "target", "feature_layers"]

    head = torch.load(work / cache.HEAD_FILE, weights_only=False)
    assert set(head) == {"key", "state", "history"}
    expected = {"data": cache.data_key(part), "settings": recipe, "seed": 3, "init_from_layer": None,
                "torch_dtype": "fp32", "target": target, "max_steps": 2, "max_seq_len": 512,
                "prompt_positions": True, "arch": "eagle3", "draft_vocab": 64, "feature_layers": [0, 1]}
    assert head["key"] == expected and list(head["key"]) == list(expected)
    assert json.dumps(head["key"]["settings"]) == json.dumps(recipe)
