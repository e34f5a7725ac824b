"""eagle-train's caches and the keys they are checked against, so an interrupted run resumes
where it stopped and a cache made with other settings is refused or remade:

- token-data parts (`WORK/data/part-*.npz` or --data-dir; PART_PROMPTS prompts each): the
  header records `generation_header` (compared), the chunk's `chunk_digest` (compared) and
  the recipe (recorded);
- feature blocks (`WORK/features/block-*.pt`, FEATURE_BLOCK sequences each): {"key":
  `block_key`, "features"}; an unreadable block is recomputed;
- the trained head (`WORK/head.pt`): {"key": `head_key`, "state", "history"}.

The keys are what earlier runs wrote (tests/train/test_cache_keys.py spells them out): a
change here refuses every committed part (data/tokens/) and remakes every cache.
"""
from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import numpy as np
import torch

from eagle_deploy.contract.verify import sha256_file

from .data import TokenData
from .settings import MAX_SEQ_LEN, TrainSettings

# prompts per token-data part: enough that the few long prompts of a part (documents of 1-2k
# tokens) fill batches of similar length (256 left them in batches of 1-2 rows, whose decode
# steps cost nearly what a 64-row step does: docs/decisions.md, 'eagle-train on two CPU cores')
PART_PROMPTS = 1024
FEATURES_DIR = "features"
FEATURE_BLOCK = 512  # sequences per cached feature block (docs/decisions.md, 'eagle-train settings, measured')
HEAD_FILE = "head.pt"


def target_fingerprint(checkpoint) -> dict:
    """{"name", "sha256"} of the target every cached part, block and head was made by: the
    sha256 of its source file (a GGUF or one checkpoint file), else of its config.json with the
    names and sizes of its weight files."""
    source = Path(checkpoint.source)
    if source.is_file():
        return {"name": checkpoint.name, "sha256": sha256_file(source)}
    folder = Path(checkpoint.hf_dir)
    digest = hashlib.sha256((folder / "config.json").read_bytes() if (folder / "config.json").is_file() else b"")
    for f in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")):
        digest.update(f"{f.name}:{f.stat().st_size}".encode())
    return {"name": checkpoint.name, "sha256": digest.hexdigest()}


def data_key(data: TokenData) -> dict:
    """Identifies token data for the feature and head caches: counts and a sha256 of the ids,
    the sequence boundaries and the prompt lengths (so the same sequences in another order are
    other data)."""
    digest = hashlib.sha256()
    for a in (data.tokens, data.offsets, data.prompt_lens):
        digest.update(np.ascontiguousarray(a, dtype=np.int64).tobytes())
    return {"sequences": len(data), "tokens": int(data.tokens.size), "sha256": digest.hexdigest()}


# --- token-data parts ---------------------------------------------------------------------------

def generation_header(settings: TrainSettings, target: dict, answers_from: dict | None = None) -> dict:
    """What a part was generated with (its header's "generation", compared on resume): the
    answers' temperatures, length and precision, the seed when any answer is sampled (greedy
    parts: the seed only orders the prompts), the target and --answers-from's export."""
    modes = settings.recipe.temperatures
    generation = {"modes": modes, "max_new_tokens": settings.recipe.max_new_tokens,
                  "torch_dtype": settings.torch_dtype, "seed": settings.seed if any(m > 0 for m in modes) else None,
                  "target": target}
    if answers_from is not None:
        generation["answers_from"] = answers_from
    return generation


def part_header(generation: dict, rows: list[dict], settings: TrainSettings, seconds: float) -> dict:
    """A new part's header: its generation settings, its chunk's digest (both checked on resume),
    the recipe, the prompt set and how long the part took."""
    return {"generation": generation, "chunk": chunk_digest(rows), "recipe": settings.recipe.as_dict(),
            "prompts": str(settings.prompts), "seconds": seconds}


def chunk_digest(rows: list[dict]) -> str:
    """sha256 of a chunk's prompts (the set of ids with their texts; a part's answers do not
    depend on their order): what a part was generated from."""
    lines = sorted(json.dumps([row["id"], row["prompt"]], ensure_ascii=False) for row in rows)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def part_fits(elapsed_s: float, last_part_s: float, budget_s: float) -> bool:
    """Whether --gen-time-budget-min leaves room for another part (0 budget: no limit): the
    last part's duration must still fit, so a run ends within its budget (give or take one
    part's variation) instead of starting a part it will overrun. Every run makes one part at
    least (the caller asks only after one)."""
    return not budget_s or elapsed_s + last_part_s <= budget_s


def read_part(path: Path, flag: str | None = None) -> TokenData:
    """TokenData.load, or ValueError naming the file when it is not a readable part (`flag`: the
    option that named the file, e.g. --data; else a part of --data-dir)."""
    try:
        return TokenData.load(path)
    except Exception as err:  # truncated, a git-LFS pointer, not an npz, missing arrays ...
        if flag is not None:  # numpy's own words for a text file are about pickled data
            why = ("not an .npz archive" if not zipfile.is_zipfile(path) else
                   f"{type(err).__name__}: {' '.join(str(err).split())[:120]}")
            raise ValueError(f"{flag} {path} is not token data ({why}): expected a token-data part written by "
                             "eagle-train (WORK/data/part-*.npz, or --data-dir's)") from None
        raise ValueError(f"{path} is not a readable token-data part ({type(err).__name__}: "
                         f"{' '.join(str(err).split())[:120]}): restore it (an un-fetched git-LFS file?) or "
                         "delete it to regenerate it") from None


def check_part(path: Path, part: TokenData, generation: dict, rows: list[dict], log=None) -> None:
    """A data part must hold this chunk's prompts (chunk_digest), generated by this target with
    these settings; the precision it was generated in may differ (bf16 parts from a CPU with
    native bf16 resume on one without: both are the target's own answers; `log` says so).
    Raises ValueError naming the difference."""
    made = part.header.get("generation")
    fix = "use another --data-dir (or --work), or delete the part to regenerate it"
    if isinstance(made, dict) and made.get("torch_dtype") != generation["torch_dtype"] and "torch_dtype" in made:
        if log is not None:
            log(f"data: {path.name} was generated in {made['torch_dtype']}, this run generates in "
                f"{generation['torch_dtype']}: kept (both are the target's own answers)")
        made = {**made, "torch_dtype": generation["torch_dtype"]}
    if made != generation:
        made = made or {}
        differ = sorted(k for k in {*made, *generation} if made.get(k) != generation.get(k))
        raise ValueError(f"{path} was generated with other settings ("
                         + "; ".join(f"{k}: {made.get(k)} there, {generation.get(k)} here" for k in differ)
                         + f"): {fix}")
    if part.header.get("chunk") != chunk_digest(rows):
        ids, have = {r["id"] for r in rows}, {m["id"] for m in part.meta}
        if have < ids:
            why = (f"this run's chunk has {len(ids - have)} more prompts: a larger --limit adds parts after full "
                   f"ones of {PART_PROMPTS} but cannot grow a short last part")
        elif have == ids:
            why = "the same ids with other texts: another prompt file"
        else:
            why = f"{len(have - ids)} of its ids are not in this run's chunk: another prompt file, --seed or --limit"
        raise ValueError(f"{path} holds other prompts than this run's chunk ({why}): {fix}")


# --- feature blocks -----------------------------------------------------------------------------

def feature_blocks(sequences: int) -> list[list[int]]:
    """The sequence indices of each feature block (FEATURE_BLOCK at a time)."""
    return [list(range(b, min(b + FEATURE_BLOCK, sequences))) for b in range(0, sequences, FEATURE_BLOCK)]


def block_key(part: TokenData, settings: TrainSettings, target: dict, layers) -> dict:
    """What a feature block was computed from: its sequences, the precision, the target and
    (EAGLE-3) the tapped layers."""
    return {**data_key(part), "torch_dtype": settings.torch_dtype, "target": target,
            **({"feature_layers": list(layers)} if layers else {})}


def read_block(path: Path, key: dict, log) -> list | None:
    """The features of the block at `path` when it was written with `key`; None when there is
    none, it has another key, or it cannot be read (truncated, not a block: it is then
    recomputed and overwritten, with a log line)."""
    if not path.exists():
        return None
    try:
        cached = torch.load(path, weights_only=True)
    except Exception as err:  # truncated zip, not a torch file, a git-LFS pointer ...
        log(f"features: {path} cannot be read ({type(err).__name__}); recomputing it")
        return None
    if not isinstance(cached, dict) or not isinstance(cached.get("features"), list):
        log(f"features: {path} is not a feature block; recomputing it")
        return None
    return cached["features"] if cached.get("key") == key else None


def write_block(path: Path, key: dict, features: list) -> None:
    """Save a block (through a temporary file: an interrupted write leaves no half block)."""
    path.parent.mkdir(exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"key": key, "features": [f.cpu() for f in features]}, tmp)
    tmp.replace(path)


# --- the trained head ---------------------------------------------------------------------------

def head_key(data: TokenData, settings: TrainSettings, target: dict, init_head: str | None = None) -> dict:
    """What a trained head was made from: the data, the recipe, seed, precision and target, the
    starting head (`init_head`: its sha256) and the settings that change training when set."""
    s = settings
    key = {"data": data_key(data), "settings": s.recipe.as_dict(), "seed": s.seed,
           "init_from_layer": s.init_from_layer, "torch_dtype": s.torch_dtype, "target": target,
           **({"init_head": init_head} if init_head is not None else {}),
           **({"max_steps": s.max_steps} if s.max_steps else {}),
           **({"max_seq_len": s.max_seq_len} if s.max_seq_len != MAX_SEQ_LEN else {}),
           **({"prompt_positions": True} if s.prompt_positions else {}),
           **({"head_layers": s.head_layers} if s.head_layers != 1 else {})}
    if s.arch == "eagle3":  # feature_layers as the flag parsed them: a list (a tuple is another key)
        key.update(arch="eagle3", draft_vocab=s.draft_vocab,
                   feature_layers=list(s.feature_layers) if s.feature_layers is not None else None)
    elif s.draft_vocab:
        key.update(draft_vocab=s.draft_vocab)
    return key


def read_head(work: Path, key: dict) -> dict | None:
    """{"state", "history"} of the head cached in WORK/head.pt when it has `key`, else None."""
    path = work / HEAD_FILE
    cached = torch.load(path, weights_only=False) if path.exists() else None
    return cached if cached is not None and cached.get("key") == key else None


def write_head(work: Path, key: dict, head, history: dict) -> None:
    torch.save({"key": key, "state": head.state_dict(), "history": history}, work / HEAD_FILE)
