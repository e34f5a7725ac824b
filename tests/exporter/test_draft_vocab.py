"""The default reduced draft vocabulary (exporter/draft_vocab.py): its size rule, the ranking
by token_counts.npy or, for heads without one, the tokenizer's merge rank, and the
`--draft-vocab full` opt-out."""
from __future__ import annotations

import json

import numpy as np
import pytest

from eagle_deploy.exporter import cli
from eagle_deploy.exporter.draft_vocab import DEFAULT_SIZE, default_size, draft_vocab_ids, merge_rank
from eagle_deploy.heads.files import TOKEN_COUNTS_FILE


@pytest.mark.parametrize("vocab, size", [(256, 256), (8192, 8192), (32000, 8192), (49152, 12288),
                                         (128256, 32064)])
def test_default_size_is_8192_or_a_quarter_never_more_than_the_vocabulary(vocab, size):
    assert DEFAULT_SIZE == 8192 and default_size(vocab) == size


def _bpe_folder(tmp_path, merges, vocab, added=()):
    data = {"model": {"type": "BPE", "vocab": vocab, "merges": merges},
            "added_tokens": [{"id": i, "content": f"<s{i}>", "special": True} for i in added]}
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    return tmp_path


def test_merge_rank_orders_tokens_by_the_merge_that_makes_them(tmp_path):
    # ids deliberately not in merge order; "ab" is merged before "cd" before "abcd"
    vocab = {"a": 0, "b": 1, "c": 2, "d": 3, "abcd": 4, "cd": 5, "ab": 6, "<s7>": 7, "zz": 8}
    folder = _bpe_folder(tmp_path, ["a b", ["c", "d"], "ab cd"], vocab, added=(7,))
    rank, source = merge_rank(folder, 9)
    assert source == "merge_rank"
    assert rank[7] < rank[0] == rank[1] == rank[2] == rank[3] < rank[6] < rank[5] < rank[4] < rank[8]
    ids, source = draft_vocab_ids(None, 6, 9, eos_ids=[8], tokenizer_dir=folder)
    # the special token, the 4 single characters and EOS (8, never merged: kept anyway)
    assert source == "merge_rank" and ids.tolist() == [0, 1, 2, 3, 7, 8]


def test_unigram_and_missing_tokenizers(tmp_path):
    data = {"model": {"type": "Unigram", "vocab": [["a", -1.0], ["b", -3.0], ["c", -2.0]]}}
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    rank, source = merge_rank(tmp_path, 3)
    assert source == "merge_rank" and list(np.argsort(rank)) == [0, 2, 1]
    rank, source = merge_rank(None, 5)
    assert source == "token_id" and rank.tolist() == [0, 1, 2, 3, 4]


def test_token_counts_beside_the_head_win_over_the_tokenizer(tmp_path):
    counts = np.array([5, 0, 9, 1, 7, 3], dtype=np.int64)
    np.save(tmp_path / TOKEN_COUNTS_FILE, counts)
    ids, source = draft_vocab_ids(tmp_path, 3, 6, eos_ids=[1], tokenizer_dir=None)
    assert source == "token_counts" and ids.tolist() == [1, 2, 4]  # EOS kept, then the two most frequent
    np.save(tmp_path / TOKEN_COUNTS_FILE, counts[:5])
    with pytest.raises(ValueError, match="expected \\(6,\\)"):
        draft_vocab_ids(tmp_path, 3, 6, eos_ids=[], tokenizer_dir=None)
    assert draft_vocab_ids(tmp_path, 0, 6, eos_ids=[]) == (None, None)  # full vocabulary


def test_cli_draft_vocab_takes_full_or_a_count(capsys):
    p = cli.build_parser()
    assert p.parse_args(["--model", "m", "--draft-vocab", "full"]).draft_vocab == 0
    assert p.parse_args(["--model", "m", "--draft-vocab", "4096"]).draft_vocab == 4096
    assert p.parse_args(["--model", "m"]).draft_vocab is None
    with pytest.raises(SystemExit):
        p.parse_args(["--model", "m", "--draft-vocab", "half"])
    assert "expected a token count or 'full'" in capsys.readouterr().err


def test_smollm2_merge_rank_matches_the_vocabulary_order():
    """For a byte-level BPE vocabulary numbered in merge order (SmolLM2, GPT-2 style) the merge
    rank is the id order; checked on the converted SmolLM2 tokenizer when it is cached."""
    from eagle_deploy.exporter.models import cache_root

    found = sorted(cache_root().glob("gguf/*/tokenizer.json"))
    if not found:
        pytest.skip("no converted SmolLM2 checkpoint in the cache")
    rank, source = merge_rank(found[0].parent, 49152)
    assert source == "merge_rank"
    first = np.argsort(rank, kind="stable")[:8192]
    assert len(set(first.tolist()) & set(range(8192))) > 8000
