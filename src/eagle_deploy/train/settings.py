"""What one eagle-train run is asked to do: `TrainSettings` (every flag, typed, with its
default) and `Recipe` (the values a --preset bundles; `CPU_QUICK` and `GPU` are the presets).
The one home of these defaults: the CLI's flags read them from here, and
`trainer.TrainConfig` reads `MAX_SEQ_LEN`.

    from eagle_deploy.train.pipeline import GPU, TrainSettings, run
    result = run(TrainSettings(model="smollm2-135m", out=Path("heads/mine"), recipe=GPU))

`check()` refuses what the settings alone show wrong (one line naming the flag), before
anything is read or loaded. Imports nothing heavy: `eagle-train --help` reads it.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from eagle_deploy.common.cli_args import check_at_least, check_output_path

MAX_SEQ_LEN = 1024  # tokens of a sequence trained on (--max-seq-len; TrainConfig.max_seq_len)
ARCHS = ("eagle", "eagle3")
STAGES = ("data", "features")
DTYPES = ("fp32", "bf16")
DEVICES = "auto, cpu, cuda or cuda:N (N: a GPU index)"  # what --device accepts


@dataclass(frozen=True)
class Recipe:
    """The values a --preset bundles, each overridable by its own flag. `as_dict()` is what the
    data parts record ("recipe") and the head cache is keyed by ("settings")."""

    limit: int  # prompts answered (0: all)
    modes: str  # comma-separated sampling temperatures of the answers, 0 = greedy
    max_new_tokens: int  # the most tokens per answer (0: the prompts alone)
    gen_batch: int  # sequences generated at a time
    epochs: float
    batch_tokens: int  # tokens per training step
    lr: float
    ce_topk: int  # EAGLE-1/2 soft labels: 0 = the whole distribution, K = its top-K
    unroll: int  # training-time unrolling steps
    time_budget_min: float  # training minutes (0: none)
    warmup_steps: int

    def __post_init__(self):
        for f in fields(self):  # 1 -> 1.0, as `--epochs 1` parses: the same cache keys from Python as from the CLI
            value = getattr(self, f.name)
            if f.type == "float" and isinstance(value, int) and not isinstance(value, bool):
                object.__setattr__(self, f.name, float(value))

    @property
    def temperatures(self) -> list[float]:
        """The sampling temperatures of the answers ([0.0] when none are generated: the prompts alone)."""
        return [float(m) for m in str(self.modes).split(",")] if self.max_new_tokens else [0.0]

    def as_dict(self) -> dict:
        return asdict(self)

    def check(self) -> None:
        """Raise ValueError naming the first value out of its range (NaN and inf included)."""
        least = {"limit": 0, "max_new_tokens": 0, "gen_batch": 1, "batch_tokens": 1, "ce_topk": 0, "unroll": 1,
                 "time_budget_min": 0, "warmup_steps": 0, "lr": 0}  # lr 0: the starting head unchanged
        check_at_least(((f"--{name.replace('_', '-')}", getattr(self, name), low) for name, low in least.items()),
                       finite=True)
        if not abs(self.epochs) < float("inf"):  # nan or inf
            raise ValueError(f"--epochs must be a finite number > 0, got {self.epochs}")
        if not self.epochs > 0:
            raise ValueError(f"--epochs must be > 0, got {self.epochs}")
        try:
            temperatures = [float(t) for t in str(self.modes).split(",")]
        except ValueError:
            temperatures = [-1.0]
        if not all(0 <= t < float("inf") for t in temperatures):
            raise ValueError(f"--modes: comma-separated sampling temperatures >= 0 (0 = greedy), got {self.modes!r}")


# fits a 2-core CPU's 30-minute training cap, data generation included (docs/decisions.md,
# 'eagle-train settings, measured')
CPU_QUICK = Recipe(limit=900, modes="0", max_new_tokens=160, gen_batch=32, epochs=6.0, batch_tokens=2048, lr=6e-4,
                   ce_topk=32, unroll=1, time_budget_min=30.0, warmup_steps=100)
# a GPU recipe (minutes on one H100/H200 for SmolLM2; hours for 7B targets)
GPU = Recipe(limit=0, modes="0,0.7", max_new_tokens=256, gen_batch=512, epochs=6.0, batch_tokens=32768, lr=1e-3,
             ce_topk=0, unroll=3, time_budget_min=0.0, warmup_steps=100)
PRESETS = {"cpu-quick": CPU_QUICK, "gpu": GPU}


@dataclass(frozen=True)
class TrainSettings:
    """One eagle-train run: the target, where its stages cache and write, the recipe and the
    flags around it (see `eagle-train --help` for each; a field is its flag's name)."""

    model: str  # alias, Hugging Face folder or .gguf file
    out: Path  # folder of the trained head
    work: Path | None = None  # stage caches (default: `work_dir`)
    arch: str = "eagle"
    recipe: Recipe = CPU_QUICK
    draft_vocab: int | None = None
    feature_layers: tuple[int, ...] | None = None  # eagle3 taps (default: the reference's)
    max_sequences: int = 0
    prompts: str = "train"  # 'train' or a prompt file
    decontaminate: tuple[Path, ...] = ()
    data: tuple[Path, ...] = ()  # existing token data (skips generation)
    device: str = "auto"
    seed: int = 0
    max_steps: int = 0
    max_seq_len: int = MAX_SEQ_LEN
    prompt_positions: bool = False
    init_from_layer: int | None = None
    head_layers: int = 1  # decoder layers of an EAGLE-1/2 head (heads/eagle12.py)
    init_head: Path | None = None
    torch_dtype: str = "fp32"
    cache_features: bool = True  # --no-cache-features: False
    gen_time_budget_min: float = 0.0
    features_time_budget_min: float = 0.0
    data_dir: Path | None = None  # generated token-data parts (default: WORK/data)
    answers_from: Path | None = None
    stop_after: str | None = None  # a STAGES name

    def __post_init__(self):  # str paths and lists from Python callers, as the CLI's types give them
        for name in ("out", "work", "init_head", "data_dir", "answers_from"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, Path(getattr(self, name)))
        object.__setattr__(self, "decontaminate", tuple(Path(p) for p in self.decontaminate))
        object.__setattr__(self, "data", tuple(Path(p) for p in self.data or ()))
        if self.feature_layers is not None:
            object.__setattr__(self, "feature_layers", tuple(self.feature_layers))

    @property
    def work_dir(self) -> Path:
        """--work, default OUT/../<out name>.work."""
        return self.work or self.out.parent / (self.out.name + ".work")

    @property
    def parts_dir(self) -> Path:
        """Where generated token-data parts go: --data-dir, default WORK/data."""
        return self.data_dir or self.work_dir / "data"

    def check(self) -> None:
        """Raise ValueError (FileNotFoundError for a missing --data or --decontaminate file) for
        what the settings alone show wrong, before anything is read or loaded: --device's form,
        --feature-layers without --arch eagle3, --head-layers below 1 or with --arch eagle3, a
        missing input file, an output folder (--out,
        --work, --data-dir) that is a file or cannot be written (found once at the end of a run
        that had generated data for half an hour), then the values out of range."""
        for flag, value, choices in (("--arch", self.arch, ARCHS), ("--torch-dtype", self.torch_dtype, DTYPES),
                                     ("--stop-after", self.stop_after, (None, *STAGES))):  # argparse's choices
            if value not in choices:
                raise ValueError(f"{flag} {value!r} is not one of {', '.join(map(str, choices))}")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"--device {self.device!r} is not a device this command runs on: expected {DEVICES}")
        if self.feature_layers is not None and self.arch != "eagle3":
            raise ValueError("--feature-layers has no effect with --arch eagle: only an EAGLE-3 head (--arch eagle3) "
                             "taps several layers (an EAGLE-1/2 head reads the last layer's features)")
        if isinstance(self.head_layers, bool) or not isinstance(self.head_layers, int) or self.head_layers < 1:
            raise ValueError(f"--head-layers must be an integer >= 1, got {self.head_layers!r}")
        if self.head_layers != 1 and self.arch == "eagle3":
            raise ValueError(f"--head-layers {self.head_layers} applies to EAGLE-1/2 heads only (--arch eagle): an "
                             "EAGLE-3 head has one decoder layer")
        missing = [str(p) for p in self.data if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"--data {missing[0]} does not exist (token data written by eagle-train, .npz)")
        missing = [str(p) for p in self.decontaminate if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"--decontaminate {missing[0]} does not exist (a prompt file: JSONL, e.g. "
                                    "Spec-Bench's question.jsonl)")
        for flag, folder in (("--out", self.out), ("--work", self.work_dir), ("--data-dir", self.data_dir)):
            check_output_path(flag, folder, folder=True)
        self.recipe.check()
        check_at_least([("--gen-time-budget-min", self.gen_time_budget_min, 0),
                        ("--features-time-budget-min", self.features_time_budget_min, 0)], finite=True)
        if self.max_steps < 0:
            raise ValueError(f"--max-steps must be >= 0 (0: from --epochs), got {self.max_steps}")
        if self.recipe.max_new_tokens == 0 and not self.prompt_positions and self.stop_after != "data":
            raise ValueError("--max-new-tokens 0 answers no prompt (the prompts alone): train on their positions "
                             "with --prompt-positions")
        if self.max_seq_len < 2:
            raise ValueError(f"--max-seq-len must be >= 2 (a prompt token and a response token), got "
                             f"{self.max_seq_len}")
        if self.features_time_budget_min and not self.cache_features:
            raise ValueError("--features-time-budget-min needs the feature cache (a block computed and not kept "
                             "would be computed again by every run): drop --no-cache-features")
