"""One eagle-train run from Python: `run(settings) -> TrainResult`, the same run as the
command line (eagle-train builds its `TrainSettings` from the flags and calls this).

    from eagle_deploy.train.pipeline import CPU_QUICK, TrainSettings, run
    result = run(TrainSettings(model="smollm2-135m", out=Path("heads/mine"),
                               recipe=dataclasses.replace(CPU_QUICK, limit=100)))
    result.head, result.timings        # the written head folder, seconds per stage

`run` checks the settings, reads the inputs (so a bad file fails before the target loads),
then runs stages.py's data -> features -> train -> export, each timed and cached in the work
folder (cache.py). It raises ValueError / FileNotFoundError / RuntimeError for bad input or a
refused cache. Importing this module loads no torch: `run` does, once the settings are checked.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from eagle_deploy.common.prompts import prompt_set

from .settings import CPU_QUICK, GPU, MAX_SEQ_LEN, PRESETS, Recipe, TrainSettings

__all__ = ["CPU_QUICK", "GPU", "MAX_SEQ_LEN", "PRESETS", "Recipe", "TrainResult", "TrainSettings", "UNFINISHED",
           "run"]

UNFINISHED = 3  # exit status: a time budget ended the data or feature stage first; run the same command again


@dataclass(frozen=True)
class TrainResult:
    """What a run did. `finished` is False when --gen-time-budget-min or
    --features-time-budget-min ended the data or feature stage first: run it again."""

    finished: bool
    head: Path | None = None  # the written head (settings.out); None when the run stopped before
    timings: dict = field(default_factory=dict)  # seconds: data_s, features_s, train_s, total_s (those run)
    history: dict | None = None  # the trainer's history (train_log.json's "train")
    log: list[str] = field(default_factory=list)

    @property
    def status(self) -> int:
        """eagle-train's exit status: 0, or UNFINISHED."""
        return 0 if self.finished else UNFINISHED


def training_prompts(settings: TrainSettings) -> list[dict] | None:
    """The --prompts rows (common.prompts.prompt_set), read before the target loads so a
    missing, malformed or empty prompt file fails at once; None with --data (nothing is
    generated). Raises ValueError."""
    if settings.data:
        return None
    rows = prompt_set(settings.prompts)
    if not rows:
        raise ValueError(f"no prompts to answer in {settings.prompts}: expected {{\"prompt\": ...}} records, one per "
                         "line")
    return rows


def run(settings: TrainSettings) -> TrainResult:
    """data -> features -> train -> export, each stage timed; see the module docstring."""
    t_start = time.perf_counter()
    settings.check()
    # the one deferred import: torch and transformers load here, after the settings passed
    from . import cache, head_init, stages

    given = [cache.read_part(p, "--data") for p in settings.data]  # a bad file fails before the target loads
    prompts = training_prompts(settings)  # and a missing, empty or malformed prompt file
    session = stages.open_session(settings)
    session.prompts, session.given = prompts, given
    checkpoint, hf, tokenizer, eos = stages.load_target_for_training(session)
    vocab = hf.config.vocab_size
    if settings.draft_vocab is not None and not 1 <= settings.draft_vocab <= vocab:
        raise ValueError(f"--draft-vocab {settings.draft_vocab} must be in [1, {vocab}]")
    head_init.feature_layers(settings, hf)  # bad --feature-layers fail here, before the data and feature stages
    head_init.check_init_from_layer(settings, hf)  # and an --init-from-layer past the target's layers
    init = head_init.load_init_head(settings, hf, session.log)  # and a bad --init-head
    timings = {}
    t = time.perf_counter()
    data = stages.data_stage(session, hf, tokenizer, eos)
    timings["data_s"] = round(time.perf_counter() - t, 1)
    if settings.stop_after == "data":
        session.log(f"stopped after the data stage ({timings['data_s']} s): parts in {settings.parts_dir}"
                    + (f"; {session.prompts_left} prompts left: run the same command again (exit status "
                       f"{UNFINISHED})" if session.prompts_left else ""))
        return TrainResult(not session.prompts_left, timings=timings, log=session.log_lines)
    t = time.perf_counter()
    features = stages.features_stage(session, hf, data)
    timings["features_s"] = round(time.perf_counter() - t, 1)
    if features is None or settings.stop_after == "features":
        session.log(f"stopped after the feature stage ({timings['features_s']} s)"
                    + (f": blocks left, run the same command again (exit status {UNFINISHED})"
                       if features is None else ""))
        return TrainResult(features is not None, timings=timings, log=session.log_lines)
    t = time.perf_counter()
    counts = head_init.response_counts(data, vocab, init)
    head, history = stages.train_stage(session, hf, data, features, counts, eos, init)
    timings["train_s"] = round(time.perf_counter() - t, 1)
    timings["total_s"] = round(time.perf_counter() - t_start, 1)
    stages.export_stage(session, checkpoint, head, counts, data, history, timings, init)
    return TrainResult(True, settings.out, timings, history, session.log_lines)
