"""The stages of one eagle-train run (pipeline.run calls them in order): open a `Session`
(device, work folder, log), load the target, then

  data:     `data_stage`: --data, or the target's answers generated part by part into
            --data-dir (default WORK/data; cache.py's parts)
  features: `features_stage`: the target's features, computed and cached in blocks
  train:    `train_stage`: the head trained on them (cached in WORK/head.pt)
  export:   `export_stage`: the head in the published layout, its token counts and train log

Every stage reads the run's `TrainSettings` from the session; the caches' keys are cache.py's.
"""
from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm
from transformers import AutoTokenizer

from eagle_deploy.contract.manifest import Manifest
from eagle_deploy.exporter.models import resolve_model
from eagle_deploy.exporter.sources import eos_ids, load_target, weight_digests
from eagle_deploy.heads.api import random_head, save_head
from eagle_deploy.heads.files import TOKEN_COUNTS_FILE

from . import cache
from . import data as train_data  # cpu_has_native_bf16 is looked up at call time (tests replace it)
from .data import (
    TokenData,
    category_counts,
    compute_features,
    decontaminate,
    evaluation_texts,
    export_answers,
    generate_data,
)
from .head_init import InitHead, draft_ids, feature_layers, init_from_layer, new_eagle3_head
from .settings import TrainSettings
from .trainer import TrainConfig, train_head


@dataclass
class Session:
    """What every stage of one eagle-train run shares: settings, device, work folder, log."""

    settings: TrainSettings
    device: str
    prompts: list | None = None  # the --prompts rows (training_prompts); None with --data
    given: list = field(default_factory=list)  # the --data parts (TokenData), read before the target loads
    target: dict = field(default_factory=dict)  # which target the caches were made by (cache.target_fingerprint)
    source: Path | None = None  # its checkpoint file or folder (--answers-from checks the export against it)
    log_lines: list = field(default_factory=list)
    by_category: dict = field(default_factory=dict)  # {category: {"sequences", "response_tokens"}} of the data
    prompts_left: int = 0  # prompts the generation time budget left unanswered

    @property
    def work(self) -> Path:
        return self.settings.work_dir

    @property
    def stage_dtype(self) -> torch.dtype:
        """The target's torch dtype in the data and feature stages."""
        return torch.bfloat16 if self.settings.torch_dtype == "bf16" else torch.float32

    def log(self, msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        self.log_lines.append(line)
        tqdm.write(line, file=sys.stderr)


def open_session(settings: TrainSettings) -> Session:
    """Pick the device (refusing one this machine lacks, and --torch-dtype bf16 on a CPU that
    emulates bf16) and create the work folder."""
    device = ("cuda" if torch.cuda.is_available() else "cpu") if settings.device == "auto" else settings.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: no CUDA device is usable here (torch {torch.__version__}); "
                         "use --device cpu or auto")
    if device.startswith("cuda:") and int(device[5:]) >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s): "
                         f"expected cuda:0 to cuda:{torch.cuda.device_count() - 1}, cuda, cpu or auto")
    if device.startswith("cuda"):
        torch.set_float32_matmul_precision("high")  # TF32 matmuls for generation/features
    if settings.torch_dtype == "bf16" and not device.startswith("cuda") and not train_data.cpu_has_native_bf16():
        raise ValueError("--torch-dtype bf16 on a CPU needs native bf16 instructions (avx512_bf16 or amx_bf16 in "
                         "/proc/cpuinfo); this CPU emulates bf16, slower than fp32: use --torch-dtype fp32")
    settings.work_dir.mkdir(parents=True, exist_ok=True)
    return Session(settings, device)


def load_target_for_training(session: Session):
    """(checkpoint, HF model in the training dtype, tokenizer, EOS ids) of --model."""
    s = session.settings
    checkpoint = resolve_model(s.model)
    hf = load_target(checkpoint)
    session.target, session.source = cache.target_fingerprint(checkpoint), Path(checkpoint.source)
    if s.torch_dtype == "bf16" and session.device.startswith("cuda"):
        hf.to(torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint.hf_dir))
    eos = eos_ids(checkpoint.hf_dir, hf.config, tokenizer)
    session.log(f"target {checkpoint.name} on {session.device}; arch {s.arch}"
                + (f" ({s.head_layers} head layers)" if s.head_layers != 1 else "") + "; settings "
                f"{json.dumps(s.recipe.as_dict())}"
                + (f"; data {[str(p) for p in s.data]} (generation settings unused)" if s.data else "")
                + (f"; max_sequences {s.max_sequences}" if s.max_sequences else ""))
    return checkpoint, hf, tokenizer, eos


# --- data ---------------------------------------------------------------------------------------

def data_stage(session: Session, hf, tokenizer, eos) -> TokenData:
    """Stage 1: --data files, else the target's own responses (parts cached in --data-dir)."""
    s = session.settings
    if s.data:
        data = TokenData.concat(session.given)  # read by pipeline.run, before the target loaded
        session.log(f"data: {len(data)} sequences, {data.response_tokens} response tokens "
                    f"from {len(s.data)} file(s)")
    else:
        data = generate(session, hf, tokenizer, eos)
    n = s.max_sequences
    if n and n < len(data):
        keep = np.sort(np.random.default_rng(s.seed).choice(len(data), n, replace=False))
        data = data.subset(keep)
        session.log(f"data: a random subset of {len(data)} sequences, {data.response_tokens} response tokens")
    counts = category_counts(data)
    session.log("data by category: " + ", ".join(f"{c} {v['sequences']} seq / {v['response_tokens']} tok"
                                                 for c, v in counts.items()))
    session.by_category = counts
    return data


def generate(session: Session, hf, tokenizer, eos) -> TokenData:
    """Generate responses chunk by chunk into --data-dir (default WORK/data); finished parts are
    reused on resume, after checking they hold this run's prompts and generation settings."""
    s, log = session.settings, session.log
    prompts, dropped = decontaminate(session.prompts, evaluation_texts(list(s.decontaminate)))  # read by run()
    if dropped:
        log(f"decontamination: dropped {sum(dropped.values())} prompt(s) sharing a 13-word n-gram with an "
            f"evaluation set ({', '.join(f'{c} {k}' for c, k in sorted(dropped.items()))})")
    # mix categories across chunks
    prompts = [prompts[i] for i in np.random.default_rng(s.seed).permutation(len(prompts))]
    if s.recipe.limit:
        prompts = prompts[: s.recipe.limit]
    if not prompts:
        raise ValueError(f"no prompts to answer in {s.prompts}" + (" after decontamination" if dropped else ""))
    modes, new_tokens, batch = s.recipe.temperatures, s.recipe.max_new_tokens, s.recipe.gen_batch
    chunk = max(batch, cache.PART_PROMPTS)
    answers_from = None if s.answers_from is None else answers_export(s.answers_from, session.source,
                                                                      session.target, modes)
    generation = cache.generation_header(s, session.target, answers_from)
    parts = s.parts_dir
    parts.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=len(prompts) * len(modes), desc="generate", unit="resp", file=sys.stderr)
    done, made, t0, budget, last_s = [], 0, time.perf_counter(), 60 * s.gen_time_budget_min, 0.0
    try:
        for c0 in range(0, len(prompts), chunk):
            path = parts / f"part-{c0 // chunk:05d}.npz"
            rows = prompts[c0:c0 + chunk]
            if made and not path.exists() and not cache.part_fits(time.perf_counter() - t0, last_s, budget):
                log(f"generation time budget reached after {c0} of {len(prompts)} prompts ({made} new part(s) in "
                    f"{parts}); the same command resumes after them")
                session.prompts_left = len(prompts) - c0
                break
            if not path.exists():
                t = time.perf_counter()
                if s.answers_from is not None:
                    part = export_answers(s.answers_from, tokenizer, rows, new_tokens, batch, progress=bar.update)
                else:
                    part = generate_data(hf, tokenizer, rows, modes, new_tokens, batch, session.device, eos,
                                         seed=s.seed + c0, progress=bar.update, dtype=session.stage_dtype)
                part.header = cache.part_header(generation, rows, s, round(time.perf_counter() - t, 1))
                part.save(path)
                made, last_s = made + 1, part.header["seconds"]
                tok_s = part.response_tokens / max(part.header["seconds"], 1e-9)
                log(f"data: {path.name}: {len(part)} sequences, {part.response_tokens} response tokens in "
                    f"{part.header['seconds']} s ({tok_s:.0f} tok/s)" if new_tokens else
                    f"data: {path.name}: {len(part)} prompts alone, {len(part.tokens)} tokens (nothing generated)")
            else:
                part = cache.read_part(path)
                cache.check_part(path, part, generation, rows, log)
                bar.update(len(rows) * len(modes))
            done.append(part)
    finally:
        bar.close()
    if not done:
        raise RuntimeError(f"no token data: the generation time budget ended before the first part in {parts}")
    data = TokenData.concat(done)
    log(f"data: {len(data)} sequences, {data.response_tokens} response tokens from {len(done)} part(s) in {parts}")
    return data


def answers_export(folder: Path, source: Path, target: dict, modes: list[float]) -> dict:
    """What --answers-from records in each part's generation header ({"quant", "target_sha256"}:
    cache.target_fingerprint's), after checking that the export was made from --model's weights
    (its manifest's source sha256s) and that the run answers greedily. Raises ValueError."""
    if any(m != 0.0 for m in modes):
        raise ValueError(f"--answers-from answers greedily only: use --modes 0 (got {','.join(map(str, modes))})")
    manifest = Manifest.load(folder)
    if dict(manifest.sources.target.sha256) != weight_digests(source):
        raise ValueError(f"--answers-from {folder} was exported from other weights than --model's "
                         f"({manifest.sources.target.path or manifest.sources.target.spec}): export --model again")
    return {"quant": manifest.target.quant, "target_sha256": target["sha256"]}


# --- features -----------------------------------------------------------------------------------

def features_stage(session: Session, hf, data: TokenData) -> list | None:
    """Stage 2: the target's features for every sequence (EAGLE-3: [taps; final] per position),
    computed and cached in blocks of cache.FEATURE_BLOCK sequences (WORK/features/block-*.pt,
    each keyed by its token ids, taps and dtype), so a long stage resumes after its last
    finished block. None when --features-time-budget-min ended the stage first."""
    s, device = session.settings, session.device
    layers = feature_layers(s, hf)
    folder = session.work / cache.FEATURES_DIR
    blocks = cache.feature_blocks(len(data))
    found: list = []
    t0, computed, finished = time.perf_counter(), 0, 0
    checked, budget = session.stage_dtype == next(hf.parameters()).dtype, 60 * s.features_time_budget_min
    with tqdm(total=int(data.tokens.size), desc="features", unit="tok", file=sys.stderr) as bar:  # closed on errors too
        for b, idx in enumerate(blocks):
            part = data.subset(idx)
            key = cache.block_key(part, s, session.target, layers)
            path = folder / f"block-{b:05d}.pt"
            cached = cache.read_block(path, key, session.log) if s.cache_features else None
            if cached is not None:
                found += [f.to(device) for f in cached]
                bar.update(int(part.tokens.size))
                finished += 1
                continue
            if computed and budget and time.perf_counter() - t0 > budget:  # every run finishes one block at least
                continue  # left: the log says how many
            feats = compute_features(hf, part, device, batch_tokens=65536 if device != "cpu" else 4096,
                                     dtype=session.stage_dtype, progress=bar.update, feature_layers=layers)
            computed += int(part.tokens.size)
            if not checked:
                session.log(check_features(hf, part, feats, device, layers))
                checked = True
            if s.cache_features:
                cache.write_block(path, key, feats)
            found += feats
            finished += 1
    left, seconds = len(blocks) - finished, time.perf_counter() - t0
    if not computed:
        session.log("features: cached")
    else:
        session.log(f"features: {computed} tokens computed in {seconds:.1f} s ({computed / max(seconds, 1e-9):.0f} "
                    f"tok/s, {s.torch_dtype}), {finished} of {len(blocks)} blocks done")
    if left:
        session.log(f"features: the time budget ended with {left} of {len(blocks)} blocks left in {folder}; "
                    "the same command resumes after the finished ones")
        return None
    return found


def check_features(hf, data, features, device: str, layers, sequences: int = 8, mean_min: float = 0.999,
                   position_min: float = 0.99) -> str:
    """Features computed in a lower precision against fp32 on the first `sequences` sequences:
    each sequence's mean cosine similarity over its positions must be >= `mean_min` and every
    position's >= `position_min` (bf16 features are that close on a model's own answers, and a
    per-position 0.999 refused good data: docs/decisions.md, 'eagle-train on two CPU cores').
    Returns the log line; raises RuntimeError below either bound."""
    few = data.subset(range(min(sequences, len(data))))
    exact = compute_features(hf, few, device, batch_tokens=4096, dtype=torch.float32, feature_layers=layers)
    cos = [torch.nn.functional.cosine_similarity(a.float(), features[i].float(), dim=-1) for i, a in enumerate(exact)]
    mean, worst = min(float(c.mean()) for c in cos), min(float(c.min()) for c in cos)
    line = (f"features checked against fp32 on {len(few)} sequences: cosine similarity >= {mean:.5f} per sequence "
            f"(mean), >= {worst:.5f} per position")
    if mean < mean_min or worst < position_min:
        raise RuntimeError(line + f", below {mean_min} / {position_min}: use --torch-dtype fp32")
    return line


# --- train and export ---------------------------------------------------------------------------

def train_stage(session: Session, hf, data, features, counts, eos: Sequence[int], init: InitHead | None = None):
    """Stage 3: (head, history): a head trained from `init`'s weights when given, else random
    (`counts`: the response-token counts the draft vocabulary is picked from,
    head_init.response_counts); a finished head for the same data, settings, seed and starting
    head is reused from WORK/head.pt (so a run interrupted during export restarts there)."""
    s = session.settings
    key = cache.head_key(data, s, session.target, init.sha256 if init is not None else None)
    target_lm = None
    if s.arch == "eagle3":
        head = (init.head if init is not None
                else new_eagle3_head(hf, counts, feature_layers(s, hf), s.draft_vocab, s.seed, eos))
        target_lm = hf.get_output_embeddings().weight.detach()[head.draft_to_target].float()
    else:
        head = init.head if init is not None else random_head(hf, seed=s.seed, num_layers=s.head_layers)
        if s.draft_vocab:
            ids = draft_ids(counts, s.draft_vocab, eos)
            target_lm = hf.get_output_embeddings().weight.detach()[torch.from_numpy(ids)].float()
            session.log(f"train: cross-entropy over the {len(ids)} most frequent response tokens (--draft-vocab)")
    cached = cache.read_head(session.work, key)
    if cached is not None:
        head.load_state_dict(cached["state"])
        session.log("train: cached head")
        return head, cached["history"]
    if s.init_from_layer is not None:
        init_from_layer(head, hf, s.init_from_layer)
    r = s.recipe
    cfg = TrainConfig(epochs=r.epochs, lr=r.lr, batch_tokens=r.batch_tokens, ce_topk=r.ce_topk, unroll=r.unroll,
                      seed=s.seed, time_budget_s=60.0 * r.time_budget_min, warmup_steps=r.warmup_steps,
                      max_steps=s.max_steps, max_seq_len=s.max_seq_len, cpu_bf16=s.torch_dtype == "bf16",
                      prompt_positions=s.prompt_positions)
    history = train_head(head, data, features, cfg, session.device, log=session.log, target_lm=target_lm)
    cache.write_head(session.work, key, head, history)
    return head, history


def export_stage(session: Session, checkpoint, head, counts, data, history, timings: dict,
               init: InitHead | None = None) -> None:
    """Stage 4: the head in the published EAGLE layout, token counts and the training log."""
    s, out = session.settings, session.settings.out
    head.to("cpu", torch.float32)
    # an EAGLE-3 head in the "eagle3" layout; an EAGLE-1/2 head's config: the target's geometry
    # (random_head), or the --init-head's own
    save_head(head, out)
    np.save(out / TOKEN_COUNTS_FILE, counts)  # response-token frequencies, for `eagle-export --draft-vocab N`
    card = {"target": {"spec": s.model, "source": str(checkpoint.source),  # its sha256: hashed once, at start
                       "sha256": session.target["sha256"] if checkpoint.source.is_file() else None},
            "init_head": {"path": str(s.init_head), "sha256": init.sha256} if init is not None else None,
            "settings": s.recipe.as_dict(), "draft_vocab": s.draft_vocab, "torch_dtype": s.torch_dtype,
            "train": history, "timings_s": timings,
            "data": {"sequences": len(data), "response_tokens": data.response_tokens, "device": session.device,
                     "by_category": session.by_category}}
    (out / "train_log.json").write_text(json.dumps(card, indent=2) + "\n")
    session.log(f"head written to {out} (total {timings['total_s']} s)")
    (out / "train_log.txt").write_text("\n".join(session.log_lines) + "\n")
