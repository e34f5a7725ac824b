"""The reduced draft vocabulary: which target tokens the draft head may propose.

A reduced draft vocabulary only limits what the head can propose (as FR-Spec and EAGLE-3's
d2t do): its LM head keeps the rows of those tokens, so a draft step's LM-head matmul and
top-k shrink by vocab / size. Verification stays over the full vocabulary, so output stays
lossless; a token outside the set can still be generated (by the target's own correction
token), it just cannot be drafted.

Default size (every head): DEFAULT_SIZE tokens, or a quarter of the vocabulary when that is
larger (Llama-3's 128k vocabulary -> 32064, the size EAGLE-3 and FR-Spec use); the full
vocabulary when it has at most DEFAULT_SIZE tokens. `--draft-vocab full` (or 0) opts out.

Ranking, in this order of preference:
  token_counts  the head's `token_counts.npy` (response-token frequencies written by
                eagle-train): the best coverage of a head's responses.
  merge_rank    the tokenizer's BPE merge order (a token made by an earlier merge is more
                frequent in the tokenizer's own training corpus): needs no data and no
                forward pass, and covers less. Calibrating on the project's prompt sets instead
                (prompt-token counts of the evaluation prompts, merge rank after) covered
                a point more, from the evaluation prompts themselves, so it is not used.
  token_id      token id order, for tokenizers without a merge list (byte-level BPE vocabularies
                are numbered in merge order anyway).
Coverage of each: docs/decisions.md, 'Reduced draft vocabulary, measured'.
Special (added) tokens and the EOS ids are always in the set.
"""
from __future__ import annotations

import json
from pathlib import Path

from eagle_deploy.heads.files import TOKEN_COUNTS_FILE

DEFAULT_SIZE = 8192


def default_size(vocab: int) -> int:
    """The default draft vocabulary size for a target vocabulary of `vocab` tokens (== vocab:
    not reduced)."""
    return vocab if vocab <= DEFAULT_SIZE else max(DEFAULT_SIZE, vocab // 4)


def _tokenizer_json(tokenizer_dir: Path | None) -> dict | None:
    if tokenizer_dir is None:
        return None
    path = Path(tokenizer_dir) / "tokenizer.json"
    if path.is_file():
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
    try:  # a slow-tokenizer folder: let transformers convert it
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), trust_remote_code=False)
        return json.loads(tok.backend_tokenizer.to_str())
    except Exception:
        return None


def merge_rank(tokenizer_dir: Path | None, vocab: int):
    """(rank [vocab] float64, lower = more frequent, source) from the tokenizer in
    `tokenizer_dir`: "merge_rank" (BPE: the index of the merge that makes the token; single
    characters 0; added/special tokens -1; tokens no merge makes after all merges), Unigram
    models by descending score (also "merge_rank"), else token id order ("token_id")."""
    import numpy as np

    ids = np.arange(vocab, dtype=np.float64)
    data = _tokenizer_json(tokenizer_dir)
    model = (data or {}).get("model") or {}
    rank = None
    if model.get("type") == "BPE" and isinstance(model.get("vocab"), dict) and model.get("merges"):
        table, merges = model["vocab"], model["merges"]
        rank = np.full(vocab, len(merges) + 1, dtype=np.float64)
        for token, tid in table.items():
            if isinstance(tid, int) and 0 <= tid < vocab and len(token) == 1:
                rank[tid] = 0
        for i, merge in enumerate(merges):
            pair = merge.split(" ", 1) if isinstance(merge, str) else merge
            tid = table.get("".join(pair)) if len(pair) == 2 else None
            if isinstance(tid, int) and 0 <= tid < vocab:
                rank[tid] = min(rank[tid], i + 1)
    elif model.get("type") == "Unigram" and isinstance(model.get("vocab"), list):
        rank = np.full(vocab, np.inf)
        for tid, entry in enumerate(model["vocab"][:vocab]):
            rank[tid] = -float(entry[1])
    if rank is None:
        return ids, "token_id"
    for added in (data or {}).get("added_tokens", []):
        tid = added.get("id")
        if isinstance(tid, int) and 0 <= tid < vocab:
            rank[tid] = -np.inf
    return rank, "merge_rank"


def draft_vocab_ids(head_dir: Path | None, size: int, vocab: int, eos_ids: list[int],
                    tokenizer_dir: Path | None = None):
    """(ids, source): the `size` most frequent target tokens, EOS ids always included, sorted
    by id (torch int64), ranked by the head's token_counts.npy when it has one, else by the
    tokenizer in `tokenizer_dir` (merge_rank). (None, None) for the full vocabulary (size 0 or
    >= vocab). Raises ValueError on a token_counts.npy of the wrong shape."""
    import numpy as np
    import torch

    if not size or size >= vocab:
        return None, None
    counts_path = Path(head_dir) / TOKEN_COUNTS_FILE if head_dir else None
    if counts_path is not None and counts_path.exists():
        counts = np.load(counts_path).astype(np.float64)
        if counts.shape != (vocab,):
            raise ValueError(f"{counts_path} has shape {counts.shape}, expected ({vocab},)")
        score, source = -counts, "token_counts"
    else:
        score, source = merge_rank(tokenizer_dir, vocab)
    return torch.from_numpy(best_ranked(score, size, eos_ids)), source


def best_ranked(score, size: int, eos_ids):
    """The `size` ids with the lowest `score` ([vocab], lower = more frequent; ties by id), the
    EOS ids always among them, sorted by id (int64). `score` is not modified."""
    import numpy as np

    score = np.array(score, dtype=np.float64)
    score[[e for e in eos_ids if 0 <= e < len(score)]] = -np.inf
    return np.sort(np.argsort(score, kind="stable")[:size]).astype(np.int64)
