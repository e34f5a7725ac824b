"""`eagle-train`: train an EAGLE-1/2 (--arch eagle) or EAGLE-3 (--arch eagle3) draft head
for a target by self-distillation.

Stages, each cached in --work so an interrupted run resumes where it stopped:
  1. data:     prompts -> the target's own responses (token ids; `data/part-*.npz` of 1024
               prompts, or --data-dir: commit it and another machine resumes)
  2. features: token ids -> target features (`features/block-*.pt` of 512 sequences, fp16;
               EAGLE-3: the three taps and the final features)
  3. train:    head training (`head.pt` once trained, keyed by data, settings and seed)
  4. export:   the head in the published layout (`--out`: config.json + model.safetensors;
               EAGLE-3: the yuhuili/SpecForge layout with d2t/t2d)
Existing token data (e.g. the ids shipped in data/tokens/) can be reused with --data. A long
run goes in bounded chunks: --stop-after data with --gen-time-budget-min, then --stop-after
features with --features-time-budget-min, each resumed by the same command.

Exit status: 0 when the asked stages finished, 3 when --gen-time-budget-min or
--features-time-budget-min ended the data or feature stage first (run the same command again
until it exits 0; --time-budget-min only shortens training and never gives 3), 2 on bad input
or a refused cache, 130 when interrupted.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from eagle_deploy.contract.cli_args import check_at_least, check_output_path, cli_error, interruptible, number_list

FEATURES_DIR = "features"
# prompts per token-data part: enough that the few long prompts of a part (documents of 1-2k
# tokens) fill batches of similar length (256 left them in batches of 1-2 rows, whose decode
# steps cost nearly what a 64-row step does: measured 70 tokens/s over such a part)
PART_PROMPTS = 1024
FEATURE_BLOCK = 512  # sequences per cached feature block (SmolLM2: ~1 minute on 2 cores in bf16)
HEAD_FILE = "head.pt"
MAX_SEQ_LEN = 1024  # TrainConfig.max_seq_len (a test keeps them equal; trainer imports torch)
UNFINISHED = 3  # exit status: a time budget ended the data or feature stage first; run the same command again

PRESETS = {
    # 29 minutes measured on a 2-core CPU, data generation included (the training cap is 30)
    "cpu-quick": dict(limit=900, modes="0", max_new_tokens=160, gen_batch=32, epochs=6.0, batch_tokens=2048,
                      lr=6e-4, ce_topk=32, unroll=1, time_budget_min=30.0, warmup_steps=100),
    # a GPU recipe (minutes on one H100/H200 for SmolLM2; hours for 7B targets)
    "gpu": dict(limit=0, modes="0,0.7", max_new_tokens=256, gen_batch=512, epochs=6.0, batch_tokens=32768,
                lr=1e-3, ce_topk=0, unroll=3, time_budget_min=0.0, warmup_steps=100),
}
ARCHS = ("eagle", "eagle3")
STAGES = ("data", "features")
DEVICES = "auto, cpu, cuda or cuda:N (N: a GPU index)"  # what --device accepts (check_args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="eagle-train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="target: alias, Hugging Face folder or .gguf file (as eagle-export)")
    p.add_argument("--out", type=Path, required=True, help="folder for the trained head (published EAGLE layout)")
    p.add_argument("--work", type=Path, default=None,
                   help="cache folder for the stages (default: OUT/../<out name>.work)")
    p.add_argument("--arch", choices=ARCHS, default="eagle",
                   help="eagle: EAGLE-1/2 head (features of the last layer, feature regression + CE); eagle3: "
                        "EAGLE-3 head (three tapped layers fused by fc, CE over its own draft vocabulary, "
                        "training-time test over --unroll steps) (default: eagle)")
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="draft vocabulary size: the most frequent response tokens of the data plus the EOS ids. "
                        "eagle3: the head's own vocabulary (default: draft_vocab.default_size, a quarter of the "
                        "vocabulary but at least 8192: 12288 for SmolLM2). eagle: the cross-entropy is taken over "
                        "these ids only, as `eagle-export --draft-vocab N` proposes them (SmolLM2's alias exports "
                        "8192), which makes a CPU training step several times cheaper (default: the full "
                        "vocabulary)")
    p.add_argument("--feature-layers", type=number_list(int, 0, "--feature-layers"), default=None,
                   help="eagle3: the target layers whose input hidden states are tapped (default: the reference's "
                        "2, L/2, L-3)")
    p.add_argument("--max-sequences", type=int, default=0,
                   help="train on a random subset of this many sequences of the data (0: all; CPU recipes)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu-quick",
                   help="settings bundle: cpu-quick (900 prompts; measured 29 min on 2 CPU cores: data 10, "
                        "features 3, training 15 of its 30-min cap) or gpu (all prompts, sampled answers too, "
                        "3-step unrolling); any flag below overrides one value (default: cpu-quick)")
    p.add_argument("--prompts", default="train",
                   help="'train' (data/prompts/train_prompts.jsonl) or a prompt file: JSONL (or a JSON array) of "
                        "{\"prompt\": ...}, ShareGPT {\"conversations\": [{\"from\", \"value\"}]} or OpenAI "
                        "{\"messages\": [{\"role\", \"content\"}]} records (the first user turn; an optional "
                        "\"category\" is counted in the log)")
    p.add_argument("--decontaminate", type=Path, action="append", default=[], metavar="FILE",
                   help="also drop training prompts sharing a 13-word n-gram with the prompts of FILE (e.g. "
                        "Spec-Bench's question.jsonl; repeatable). HumanEval and the chat evaluation set are "
                        "always checked")
    p.add_argument("--data", type=Path, nargs="*", default=None,
                   help="existing token-data .npz files to train on (skips generation)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--seed", type=int, default=0,
                   help="seed for sampled data, head initialisation, noise and batch order (default: 0)")
    meaning = {"ce_topk": "; EAGLE-1/2 heads: the soft labels of the cross-entropy term: 0 = the target's whole "
                          "distribution (softmax over the --draft-vocab ids when given), K = its top-K probabilities "
                          "renormalised (the head's log-probabilities stay over all the ids scored)",
               "modes": "; sampling temperatures of the generated answers, 0 = greedy",
               "max_new_tokens": "; the most tokens generated per answer. 0 = no answers: the prompts alone "
                                 "are the data (nothing generated; train on them with --prompt-positions)",
               "time_budget_min": "; training minutes: the steps it fits, planned from the warm-up steps' "
                                  "time, are where the cosine schedule ends (0: none)"}
    for name, default in PRESETS["cpu-quick"].items():
        p.add_argument("--" + name.replace("_", "-"), type=type(default), default=None,
                       help=f"preset value (cpu-quick: {default}; gpu: {PRESETS['gpu'][name]}{meaning.get(name, '')})")
    p.add_argument("--max-steps", type=int, default=0,
                   help="train exactly this many steps (batches of --batch-tokens), the cosine schedule ending "
                        "there; --epochs is then ignored and --time-budget-min only stops a run that reaches "
                        "it. A --time-budget-min run logs the step count it planned after timing its warm-up "
                        "steps: this flag with that count repeats its schedule on any machine (0: from "
                        "--epochs and --time-budget-min)")
    p.add_argument("--max-seq-len", type=int, default=MAX_SEQ_LEN,
                   help="tokens of a sequence (prompt + response) trained on; longer ones are cut there, and one "
                        "whose prompt alone fills them is skipped (logged). Raise it (e.g. 2304) to train on "
                        "summarization / RAG-length documents; a step then holds fewer sequences "
                        "(default: %(default)s)")
    p.add_argument("--prompt-positions", action="store_true",
                   help="also train on the prompts' positions, not only the responses': the target's own "
                        "next-token distribution is the label there too (EAGLE-1 trained on fixed ShareGPT text), "
                        "so a prompt's text adds training positions without more generation (a step costs the "
                        "same); validation stays on response positions. Measured on SmolLM2: no τ gain "
                        "(docs/guide-training.md), so off by default")
    p.add_argument("--init-from-layer", type=int, default=None,
                   help="initialise the head's layer from this target layer")
    p.add_argument("--init-head", type=Path, default=None, metavar="HEAD_DIR",
                   help="start from this trained head (published layout, of --arch's kind, for the same target) "
                        "instead of a random one (SmolLM2's shipped head: src/eagle_deploy/data/heads/smollm2-135m): "
                        "continue training on new data (e.g. the shipped head on a new "
                        "prompt mix). Its token_counts.npy, if any, is added to the data's counts for the draft "
                        "vocabulary and the written token_counts.npy; an EAGLE-3 head keeps its own draft "
                        "vocabulary and taps")
    p.add_argument("--torch-dtype", choices=["fp32", "bf16"], default="fp32",
                   help="target precision for data generation and features. bf16 on CUDA: the target is converted "
                        "(large targets); on a CPU with native bf16 (avx512_bf16 or amx_bf16 in /proc/cpuinfo): a "
                        "bf16 copy runs the data and feature stages (measured 1.7x faster generation, 1.8x faster "
                        "features than fp32 on SmolLM2) and the first feature batch is checked against fp32 "
                        "(mean cosine >= 0.999 per sequence, >= 0.99 per position). The head keeps fp32 weights and "
                        "trains under bf16 autocast (a CPU step measured 1.35x faster) (default: fp32)")
    p.add_argument("--no-cache-features", action="store_true",
                   help="keep features in memory only (large data on a GPU)")
    p.add_argument("--gen-time-budget-min", type=float, default=0.0,
                   help="minutes from the start of the data stage: start no new part (1,024 prompts, or "
                        "--gen-batch if larger; one answer per --modes value each) that the last part's duration "
                        "says would end later (0: no limit; one part at least); with --stop-after data, a bounded "
                        "chunk of a long generation that a later run resumes")
    p.add_argument("--features-time-budget-min", type=float, default=0.0,
                   help="stop computing new feature blocks after this many minutes (0: no limit; one block is "
                        "always computed); the same command resumes after the finished blocks")
    p.add_argument("--data-dir", type=Path, default=None,
                   help="folder of the generated token-data parts (default: WORK/data). Parts are a few MB of token "
                        "ids: commit this folder and a run on another machine with the same prompts, seed and "
                        "generation settings resumes after the last part (a part made with other settings is "
                        "refused)")
    p.add_argument("--answers-from", type=Path, default=None, metavar="EXPORT",
                   help="an eagle-export folder of the same target (its manifest's source sha256 must match) "
                        "whose target graph writes the data stage's answers: greedy (--modes 0), --gen-batch "
                        "sequences at a time in batched forwards (BatchEngine). "
                        "A quantised export answers several times faster than torch on a CPU (docs/decisions.md); "
                        "its answers are the quantised graph's. Features and training still run the torch target")
    p.add_argument("--stop-after", choices=STAGES, default=None,
                   help="stop after this stage (data: generate in bounded chunks; features: fill the cache)")
    return p


def _settings(args) -> dict:
    s = dict(PRESETS[args.preset])
    for k in s:
        v = getattr(args, k)
        if v is not None:
            s[k] = v
    return s


@interruptible("eagle-train")
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    s = _settings(args)
    try:
        return run(args, s)
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        return cli_error("eagle-train", err)


@dataclass
class Session:
    """What every stage of one eagle-train run shares: settings, device, work folder, log."""

    args: argparse.Namespace
    settings: dict
    device: str
    work: Path
    data_dir: Path | None = None  # generated token-data parts (--data-dir, default WORK/data)
    prompts: list | None = None  # the --prompts rows (training_prompts); None with --data
    given: list = field(default_factory=list)  # the --data parts (TokenData), read before the target loads
    target: dict = field(default_factory=dict)  # which target the caches were made by (target_fingerprint)
    source: Path | None = None  # its checkpoint file or folder (--answers-from checks the export against it)
    log_lines: list = field(default_factory=list)
    by_category: dict = field(default_factory=dict)  # {category: {"sequences", "response_tokens"}} of the data
    prompts_left: int = 0  # prompts the generation time budget left unanswered

    @property
    def stage_dtype(self):
        """The target's torch dtype in the data and feature stages."""
        import torch

        return torch.bfloat16 if self.args.torch_dtype == "bf16" else torch.float32

    def log(self, msg: str) -> None:
        from tqdm import tqdm

        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        self.log_lines.append(line)
        tqdm.write(line, file=sys.stderr)


def run(args, s: dict) -> int:
    """data -> features -> train -> export, each stage timed; see the module docstring."""
    t_start = time.perf_counter()
    check_args(args)
    given = [read_part(Path(p), "--data") for p in args.data or ()]  # a bad file fails before the target loads
    prompts = training_prompts(args)  # and a missing, empty or malformed prompt file
    session = open_session(args, s)
    session.prompts, session.given = prompts, given
    checkpoint, hf, tokenizer, eos = load_target_for_training(session)
    vocab = hf.config.vocab_size
    if args.draft_vocab is not None and not 1 <= args.draft_vocab <= vocab:
        raise ValueError(f"--draft-vocab {args.draft_vocab} must be in [1, {vocab}]")
    feature_layers(session, hf)  # bad --feature-layers fail here, before the data and feature stages
    init = load_init_head(session, hf)  # and a bad --init-head
    timings = {}
    t = time.perf_counter()
    data = load_or_generate_data(session, hf, tokenizer, eos)
    timings["data_s"] = round(time.perf_counter() - t, 1)
    if args.stop_after == "data":
        session.log(f"stopped after the data stage ({timings['data_s']} s): parts in {session.data_dir}"
                    + (f"; {session.prompts_left} prompts left: run the same command again (exit status "
                       f"{UNFINISHED})" if session.prompts_left else ""))
        return UNFINISHED if session.prompts_left else 0
    t = time.perf_counter()
    features = features_from_data(session, hf, data)
    timings["features_s"] = round(time.perf_counter() - t, 1)
    if features is None or args.stop_after == "features":
        session.log(f"stopped after the feature stage ({timings['features_s']} s)"
                    + (f": blocks left, run the same command again (exit status {UNFINISHED})"
                       if features is None else ""))
        return UNFINISHED if features is None else 0
    t = time.perf_counter()
    counts = response_counts(data, hf.config.vocab_size, init)
    head, history = head_from_features(session, hf, data, features, counts, init)
    timings["train_s"] = round(time.perf_counter() - t, 1)
    timings["total_s"] = round(time.perf_counter() - t_start, 1)
    write_head(session, checkpoint, head, counts, data, history, timings, init)
    print(args.out)
    return 0


def work_folder(args) -> Path:
    """--work, default OUT/../<out name>.work."""
    return args.work or args.out.parent / (args.out.name + ".work")


def check_args(args) -> None:
    """Raise ValueError for what the flags alone show wrong, before anything is read or loaded:
    --device's form, --feature-layers without --arch eagle3, a missing --data or --decontaminate
    file, and an output folder (--out, --work, --data-dir) that is a file or cannot be written
    (found once at the end of a run that had generated data for half an hour)."""
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", args.device):
        raise ValueError(f"--device {args.device!r} is not a device this command runs on: expected {DEVICES}")
    if args.feature_layers is not None and args.arch != "eagle3":
        raise ValueError("--feature-layers has no effect with --arch eagle: only an EAGLE-3 head (--arch eagle3) "
                         "taps several layers (an EAGLE-1/2 head reads the last layer's features)")
    missing = [str(p) for p in args.data or () if not Path(p).is_file()]
    if missing:
        raise FileNotFoundError(f"--data {missing[0]} does not exist (token data written by eagle-train, .npz)")
    missing = [str(p) for p in args.decontaminate if not Path(p).is_file()]
    if missing:
        raise FileNotFoundError(f"--decontaminate {missing[0]} does not exist (a prompt file: JSONL, e.g. "
                                "Spec-Bench's question.jsonl)")
    for flag, folder in (("--out", args.out), ("--work", work_folder(args)), ("--data-dir", args.data_dir)):
        check_output_path(flag, folder, folder=True)


def training_prompts(args) -> list[dict] | None:
    """The --prompts rows (contract.prompts.prompt_set), read before the target loads so a
    missing, malformed or empty prompt file fails at once; None with --data (nothing is
    generated). Raises ValueError."""
    if args.data:
        return None
    from eagle_deploy.contract.prompts import prompt_set

    rows = prompt_set(args.prompts)
    if not rows:
        raise ValueError(f"no prompts to answer in {args.prompts}: expected {{\"prompt\": ...}} records, one per "
                         "line")
    return rows


def check_settings(s: dict) -> None:
    """Raise ValueError naming the first preset value (after the flags) out of its range (NaN and
    inf included)."""
    least = {"limit": 0, "max_new_tokens": 0, "gen_batch": 1, "batch_tokens": 1, "ce_topk": 0, "unroll": 1,
             "time_budget_min": 0, "warmup_steps": 0, "lr": 0}  # lr 0: the starting head unchanged
    check_at_least(((f"--{name.replace('_', '-')}", s[name], low) for name, low in least.items()), finite=True)
    if not abs(s["epochs"]) < float("inf"):  # nan or inf
        raise ValueError(f"--epochs must be a finite number > 0, got {s['epochs']}")
    if not s["epochs"] > 0:
        raise ValueError(f"--epochs must be > 0, got {s['epochs']}")
    try:
        temperatures = [float(t) for t in str(s["modes"]).split(",")]
    except ValueError:
        temperatures = [-1.0]
    if not all(0 <= t < float("inf") for t in temperatures):
        raise ValueError(f"--modes: comma-separated sampling temperatures >= 0 (0 = greedy), got {s['modes']!r}")


def open_session(args, s: dict) -> Session:
    """Pick the device and create the work folder."""
    import torch

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: no CUDA device is usable here (torch {torch.__version__}); "
                         "use --device cpu or auto")
    if device.startswith("cuda:") and int(device[5:]) >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s): "
                         f"expected cuda:0 to cuda:{torch.cuda.device_count() - 1}, cuda, cpu or auto")
    check_settings(s)
    if device.startswith("cuda"):
        torch.set_float32_matmul_precision("high")  # TF32 matmuls for generation/features
    from .data import cpu_has_native_bf16

    if args.torch_dtype == "bf16" and not device.startswith("cuda") and not cpu_has_native_bf16():
        raise ValueError("--torch-dtype bf16 on a CPU needs native bf16 instructions (avx512_bf16 or amx_bf16 in "
                         "/proc/cpuinfo); this CPU emulates bf16, slower than fp32: use --torch-dtype fp32")
    check_at_least([("--gen-time-budget-min", args.gen_time_budget_min, 0),
                    ("--features-time-budget-min", args.features_time_budget_min, 0)], finite=True)
    if args.max_steps < 0:
        raise ValueError(f"--max-steps must be >= 0 (0: from --epochs), got {args.max_steps}")
    if s["max_new_tokens"] == 0 and not args.prompt_positions and args.stop_after != "data":
        raise ValueError("--max-new-tokens 0 answers no prompt (the prompts alone): train on their positions with "
                         "--prompt-positions")
    if args.max_seq_len < 2:
        raise ValueError(f"--max-seq-len must be >= 2 (a prompt token and a response token), got {args.max_seq_len}")
    if args.features_time_budget_min and args.no_cache_features:
        raise ValueError("--features-time-budget-min needs the feature cache (a block computed and not kept would "
                         "be computed again by every run): drop --no-cache-features")
    work = work_folder(args)  # checked by check_args
    work.mkdir(parents=True, exist_ok=True)
    return Session(args, s, device, work, args.data_dir or work / "data")


def load_target_for_training(session: Session):
    """(checkpoint, HF model in the training dtype, tokenizer, EOS ids) of --model."""
    import torch
    from transformers import AutoTokenizer

    from eagle_deploy.exporter.export import _eos_ids, load_target
    from eagle_deploy.exporter.models import resolve_model

    checkpoint = resolve_model(session.args.model)
    hf = load_target(checkpoint)
    session.target, session.source = target_fingerprint(checkpoint), Path(checkpoint.source)
    if session.args.torch_dtype == "bf16" and session.device.startswith("cuda"):
        hf.to(torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint.hf_dir))
    eos = _eos_ids(checkpoint.hf_dir, hf.config, tokenizer)
    a = session.args
    session.log(f"target {checkpoint.name} on {session.device}; arch {a.arch}; settings {json.dumps(session.settings)}"
                + (f"; data {[str(p) for p in a.data]} (generation settings unused)" if a.data else "")
                + (f"; max_sequences {a.max_sequences}" if a.max_sequences else ""))
    return checkpoint, hf, tokenizer, eos


def load_or_generate_data(session: Session, hf, tokenizer, eos):
    """Stage 1: --data files, else the target's own responses (chunks cached in WORK/data)."""
    from .data import TokenData

    if session.args.data:
        data = TokenData.concat(session.given)  # read by run(), before the target loaded
        session.log(f"data: {len(data)} sequences, {data.response_tokens} response tokens "
                    f"from {len(session.args.data)} file(s)")
    else:
        data = _generate(session, hf, tokenizer, eos)
    n = session.args.max_sequences
    if n and n < len(data):
        import numpy as np

        keep = np.sort(np.random.default_rng(session.args.seed).choice(len(data), n, replace=False))
        data = data.subset(keep)
        session.log(f"data: a random subset of {len(data)} sequences, {data.response_tokens} response tokens")
    session.by_category = log_categories(data, session.log)
    return data


def data_key(data) -> dict:
    """Identifies token data for the feature and head caches: counts and a sha256 of the ids,
    the sequence boundaries and the prompt lengths (so the same sequences in another order are
    other data)."""
    import hashlib

    import numpy as np

    digest = hashlib.sha256()
    for a in (data.tokens, data.offsets, data.prompt_lens):
        digest.update(np.ascontiguousarray(a, dtype=np.int64).tobytes())
    return {"sequences": len(data), "tokens": int(data.tokens.size), "sha256": digest.hexdigest()}


def target_fingerprint(checkpoint) -> dict:
    """{"name", "sha256"} of the target every cached part, block and head was made by: the
    sha256 of its source file (a GGUF or one checkpoint file), else of its config.json with the
    names and sizes of its weight files."""
    import hashlib

    from eagle_deploy.contract.verify import sha256_file

    source = Path(checkpoint.source)
    if source.is_file():
        return {"name": checkpoint.name, "sha256": sha256_file(source)}
    folder = Path(checkpoint.hf_dir)
    digest = hashlib.sha256((folder / "config.json").read_bytes() if (folder / "config.json").is_file() else b"")
    for f in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")):
        digest.update(f"{f.name}:{f.stat().st_size}".encode())
    return {"name": checkpoint.name, "sha256": digest.hexdigest()}


def feature_layers(session: Session, hf):
    """The target layers an EAGLE-3 head taps (exporter.eagle3.default_feature_layers); None for
    --arch eagle."""
    from eagle_deploy.exporter.eagle3 import default_feature_layers

    if session.args.arch != "eagle3":
        return None
    layers = session.args.feature_layers
    if layers is None:
        return default_feature_layers(hf.config.num_hidden_layers)
    if sorted(set(layers)) != list(layers) or layers[-1] >= hf.config.num_hidden_layers:
        raise ValueError(f"--feature-layers {layers} must be distinct ascending layer ids below "
                         f"{hf.config.num_hidden_layers}")
    return tuple(layers)


def features_from_data(session: Session, hf, data) -> list | None:
    """Stage 2: the target's features for every sequence (EAGLE-3: [taps; final] per position),
    computed and cached in blocks of FEATURE_BLOCK sequences (WORK/features/block-*.pt, each
    keyed by its token ids, taps and dtype), so a long stage resumes after its last finished
    block. None when --features-time-budget-min ended the stage first."""
    import torch
    from tqdm import tqdm

    from .data import compute_features

    layers = feature_layers(session, hf)
    args, device = session.args, session.device
    folder = session.work / FEATURES_DIR
    blocks = [list(range(b, min(b + FEATURE_BLOCK, len(data)))) for b in range(0, len(data), FEATURE_BLOCK)]
    features: list = []
    t0, computed, finished = time.perf_counter(), 0, 0
    checked, budget = session.stage_dtype == next(hf.parameters()).dtype, 60 * args.features_time_budget_min
    with tqdm(total=int(data.tokens.size), desc="features", unit="tok", file=sys.stderr) as bar:  # closed on errors too
        for b, idx in enumerate(blocks):
            part = data.subset(idx)
            key = {**data_key(part), "torch_dtype": args.torch_dtype, "target": session.target,
                   **({"feature_layers": list(layers)} if layers else {})}
            path = folder / f"block-{b:05d}.pt"
            cached = _cached_block(path, session.log) if not args.no_cache_features else None
            if cached is not None and cached.get("key") == key:
                features += [f.to(device) for f in cached["features"]]
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
            if not args.no_cache_features:
                folder.mkdir(exist_ok=True)
                tmp = path.with_suffix(".tmp")
                torch.save({"key": key, "features": [f.cpu() for f in feats]}, tmp)
                tmp.replace(path)
            features += feats
            finished += 1
    left, seconds = len(blocks) - finished, time.perf_counter() - t0
    if not computed:
        session.log("features: cached")
    else:
        session.log(f"features: {computed} tokens computed in {seconds:.1f} s ({computed / max(seconds, 1e-9):.0f} "
                    f"tok/s, {args.torch_dtype}), {finished} of {len(blocks)} blocks done")
    if left:
        session.log(f"features: the time budget ended with {left} of {len(blocks)} blocks left in {folder}; "
                    "the same command resumes after the finished ones")
        return None
    return features


def _cached_block(path: Path, log) -> dict | None:
    """A feature block written by features_from_data, or None when there is none or it cannot
    be read (truncated, not a block: it is then recomputed and overwritten, with a log line)."""
    import torch

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
    return cached


def check_features(hf, data, features, device: str, layers, sequences: int = 8, mean_min: float = 0.999,
                   position_min: float = 0.99) -> str:
    """Features computed in a lower precision against fp32 on the first `sequences` sequences:
    each sequence's mean cosine similarity over its positions must be >= `mean_min` and every
    position's >= `position_min` (bf16 on SmolLM2's own answers: means 0.9997-0.9999, single
    positions down to 0.997, so a per-position 0.999 refused good data). Returns the log line;
    raises RuntimeError below either bound."""
    import torch

    from .data import compute_features

    few = data.subset(range(min(sequences, len(data))))
    exact = compute_features(hf, few, device, batch_tokens=4096, dtype=torch.float32, feature_layers=layers)
    cos = [torch.nn.functional.cosine_similarity(a.float(), features[i].float(), dim=-1) for i, a in enumerate(exact)]
    mean, worst = min(float(c.mean()) for c in cos), min(float(c.min()) for c in cos)
    line = (f"features checked against fp32 on {len(few)} sequences: cosine similarity >= {mean:.5f} per sequence "
            f"(mean), >= {worst:.5f} per position")
    if mean < mean_min or worst < position_min:
        raise RuntimeError(line + f", below {mean_min} / {position_min}: use --torch-dtype fp32")
    return line


def head_from_features(session: Session, hf, data, features, counts, init: InitHead | None = None):
    """Stage 3: train a head (from `init`'s weights when given, else random; `counts`: the
    response-token counts the draft vocabulary is picked from, `response_counts`); a finished head
    for the same data, settings, seed and starting head is reused from WORK/head.pt (so a run
    interrupted during export restarts there)."""
    import torch

    from eagle_deploy.exporter.draft_head import random_head

    from .trainer import TrainConfig, train_head

    args, s = session.args, session.settings
    key = {"data": data_key(data), "settings": s, "seed": args.seed, "init_from_layer": args.init_from_layer,
           "torch_dtype": args.torch_dtype, "target": session.target,
           **({"init_head": init.sha256} if init is not None else {}),
           **({"max_steps": args.max_steps} if args.max_steps else {}),
           **({"max_seq_len": args.max_seq_len} if args.max_seq_len != MAX_SEQ_LEN else {}),
           **({"prompt_positions": True} if args.prompt_positions else {})}
    target_lm = None
    if args.arch == "eagle3":
        key.update(arch="eagle3", draft_vocab=args.draft_vocab, feature_layers=args.feature_layers)
        head = (init.head if init is not None
                else new_eagle3_head(hf, counts, feature_layers(session, hf), args.draft_vocab, args.seed))
        target_lm = hf.get_output_embeddings().weight.detach()[head.draft_to_target].float()
    else:
        head = init.head if init is not None else random_head(hf, seed=args.seed)
        if args.draft_vocab:
            key.update(draft_vocab=args.draft_vocab)
            ids = draft_ids(hf, counts, args.draft_vocab)
            target_lm = hf.get_output_embeddings().weight.detach()[torch.from_numpy(ids)].float()
            session.log(f"train: cross-entropy over the {len(ids)} most frequent response tokens (--draft-vocab)")
    head_path = session.work / HEAD_FILE
    cached = torch.load(head_path, weights_only=False) if head_path.exists() else None
    if cached is not None and cached.get("key") == key:
        head.load_state_dict(cached["state"])
        session.log("train: cached head")
        return head, cached["history"]
    if args.init_from_layer is not None:
        _init_from_layer(head, hf, args.init_from_layer)
    cfg = TrainConfig(epochs=s["epochs"], lr=s["lr"], batch_tokens=s["batch_tokens"], ce_topk=s["ce_topk"],
                      unroll=s["unroll"], seed=args.seed, time_budget_s=60.0 * s["time_budget_min"],
                      warmup_steps=s["warmup_steps"], max_steps=args.max_steps, max_seq_len=args.max_seq_len,
                      cpu_bf16=args.torch_dtype == "bf16", prompt_positions=args.prompt_positions)
    history = train_head(head, data, features, cfg, session.device, log=session.log, target_lm=target_lm)
    torch.save({"key": key, "state": head.state_dict(), "history": history}, head_path)
    return head, history


def write_head(session: Session, checkpoint, head, counts, data, history, timings: dict,
               init: InitHead | None = None) -> None:
    """Stage 4: the head in the published EAGLE layout, token counts and the training log."""
    import torch

    from eagle_deploy.exporter.draft_head import save_head
    from eagle_deploy.exporter.eagle3 import Eagle3Head, save_eagle3_head

    args = session.args
    head.to("cpu", torch.float32)
    if isinstance(head, Eagle3Head):
        save_eagle3_head(head, args.out)
    else:  # its config: the target's geometry (random_head), or the --init-head's own
        save_head(head, args.out)
    _save_token_counts(counts, args.out)
    card = {"target": {"spec": args.model, "source": str(checkpoint.source),  # its sha256: hashed once, at start
                       "sha256": session.target["sha256"] if checkpoint.source.is_file() else None},
            "init_head": {"path": str(args.init_head), "sha256": init.sha256} if init is not None else None,
            "settings": session.settings, "draft_vocab": args.draft_vocab, "torch_dtype": args.torch_dtype,
            "train": history, "timings_s": timings,
            "data": {"sequences": len(data), "response_tokens": data.response_tokens, "device": session.device,
                     "by_category": session.by_category}}
    (args.out / "train_log.json").write_text(json.dumps(card, indent=2) + "\n")
    session.log(f"head written to {args.out} (total {timings['total_s']} s)")
    (args.out / "train_log.txt").write_text("\n".join(session.log_lines) + "\n")


def _generate(session: Session, hf, tokenizer, eos):
    """Generate responses chunk by chunk into --data-dir (default WORK/data); finished parts are
    reused on resume, after checking they hold this run's prompts and generation settings."""
    import numpy as np
    from tqdm import tqdm

    from .data import TokenData, decontaminate, evaluation_texts, export_answers, generate_data

    args, s, log = session.args, session.settings, session.log
    prompts, dropped = decontaminate(session.prompts, evaluation_texts(args.decontaminate))  # read by run()
    if dropped:
        log(f"decontamination: dropped {sum(dropped.values())} prompt(s) sharing a 13-word n-gram with an "
            f"evaluation set ({', '.join(f'{c} {k}' for c, k in sorted(dropped.items()))})")
    # mix categories across chunks
    prompts = [prompts[i] for i in np.random.default_rng(args.seed).permutation(len(prompts))]
    if s["limit"]:
        prompts = prompts[: s["limit"]]
    if not prompts:
        raise ValueError(f"no prompts to answer in {args.prompts}" + (" after decontamination" if dropped else ""))
    modes = [float(m) for m in str(s["modes"]).split(",")] if s["max_new_tokens"] else [0.0]  # 0: prompts alone
    chunk = max(s["gen_batch"], PART_PROMPTS)
    generation = {"modes": modes, "max_new_tokens": s["max_new_tokens"], "torch_dtype": args.torch_dtype,
                  "seed": args.seed if any(m > 0 for m in modes) else None,  # greedy parts: seed only orders prompts
                  "target": session.target}
    if args.answers_from is not None:
        generation["answers_from"] = answers_export(args.answers_from, session.source, session.target, modes)
    parts = session.data_dir
    parts.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=len(prompts) * len(modes), desc="generate", unit="resp", file=sys.stderr)
    done, made, t0, budget, last_s = [], 0, time.perf_counter(), 60 * args.gen_time_budget_min, 0.0
    try:
        for c0 in range(0, len(prompts), chunk):
            path = parts / f"part-{c0 // chunk:05d}.npz"
            rows = prompts[c0:c0 + chunk]
            if made and not path.exists() and not part_fits(time.perf_counter() - t0, last_s, budget):
                log(f"generation time budget reached after {c0} of {len(prompts)} prompts ({made} new part(s) in "
                    f"{parts}); the same command resumes after them")
                session.prompts_left = len(prompts) - c0
                break
            if not path.exists():
                t = time.perf_counter()
                if args.answers_from is not None:
                    part = export_answers(args.answers_from, tokenizer, rows, s["max_new_tokens"], s["gen_batch"],
                                          progress=bar.update)
                else:
                    part = generate_data(hf, tokenizer, rows, modes, s["max_new_tokens"], s["gen_batch"],
                                         session.device, eos, seed=args.seed + c0, progress=bar.update,
                                         dtype=session.stage_dtype)
                part.header = {"generation": generation, "chunk": chunk_digest(rows), "recipe": s,
                               "prompts": str(args.prompts), "seconds": round(time.perf_counter() - t, 1)}
                part.save(path)
                made, last_s = made + 1, part.header["seconds"]
                tok_s = part.response_tokens / max(part.header["seconds"], 1e-9)
                log(f"data: {path.name}: {len(part)} sequences, {part.response_tokens} response tokens in "
                    f"{part.header['seconds']} s ({tok_s:.0f} tok/s)" if s["max_new_tokens"] else
                    f"data: {path.name}: {len(part)} prompts alone, {len(part.tokens)} tokens (nothing generated)")
            else:
                part = read_part(path)
                check_part(path, part, generation, rows, log)
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
    target_fingerprint's), after checking that the export was made from
    --model's weights (its manifest's source sha256s) and that the run answers greedily.
    Raises ValueError."""
    from eagle_deploy.contract.manifest import Manifest
    from eagle_deploy.exporter.export import weight_digests

    if any(m != 0.0 for m in modes):
        raise ValueError(f"--answers-from answers greedily only: use --modes 0 (got {','.join(map(str, modes))})")
    manifest = Manifest.load(folder)
    if dict(manifest.sources.target.sha256) != weight_digests(source):
        raise ValueError(f"--answers-from {folder} was exported from other weights than --model's "
                         f"({manifest.sources.target.path or manifest.sources.target.spec}): export --model again")
    return {"quant": manifest.target.quant, "target_sha256": target["sha256"]}


def part_fits(elapsed_s: float, last_part_s: float, budget_s: float) -> bool:
    """Whether --gen-time-budget-min leaves room for another part (0 budget: no limit): the
    last part's duration must still fit, so a run ends within its budget (give or take one
    part's variation) instead of starting a part it will overrun. Every run makes one part at
    least (the caller asks only after one)."""
    return not budget_s or elapsed_s + last_part_s <= budget_s


def chunk_digest(rows: list[dict]) -> str:
    """sha256 of a chunk's prompts (the set of ids with their texts; a part's answers do not
    depend on their order): what a part was generated from."""
    import hashlib

    lines = sorted(json.dumps([row["id"], row["prompt"]], ensure_ascii=False) for row in rows)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def read_part(path: Path, flag: str | None = None):
    """TokenData.load, or ValueError naming the file when it is not a readable part (`flag`: the
    option that named the file, e.g. --data; else a part of --data-dir)."""
    import zipfile

    from .data import TokenData

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


def check_part(path: Path, part, generation: dict, rows: list[dict], log=None) -> None:
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


def log_categories(data, log) -> dict:
    """One log line of sequences and response tokens per prompt category; returns them."""
    from .data import category_counts

    counts = category_counts(data)
    log("data by category: " + ", ".join(f"{c} {v['sequences']} seq / {v['response_tokens']} tok"
                                         for c, v in counts.items()))
    return counts


def _save_token_counts(counts, out: Path) -> None:
    """Response-token frequencies ([vocab] int64) beside the head (for `eagle-export --draft-vocab N`)."""
    import numpy as np

    from eagle_deploy.exporter.draft_head import TOKEN_COUNTS_FILE

    np.save(out / TOKEN_COUNTS_FILE, counts)


@dataclass
class InitHead:
    """A trained head to start from (--init-head): the module, and a sha256 over its files
    (config.json, the weights, token_counts.npy) for the head cache's key."""

    head: object  # EagleHead | Eagle3Head
    sha256: str
    counts: object | None  # [vocab] int64 numpy: its token_counts.npy, or None


def load_init_head(session: Session, hf) -> InitHead | None:
    """--init-head, loaded for `hf` and checked against --arch (and an EAGLE-3 head against
    --feature-layers / --draft-vocab) before any stage runs. Raises ValueError naming the
    mismatch (HeadCheckpointError, a ValueError, for unreadable or misshapen files)."""
    import hashlib

    import numpy as np

    from eagle_deploy.contract.verify import sha256_file
    from eagle_deploy.exporter.draft_head import TOKEN_COUNTS_FILE
    from eagle_deploy.exporter.eagle3 import Eagle3Head
    from eagle_deploy.exporter.heads import load_head

    folder = session.args.init_head
    if folder is None:
        return None
    if session.args.init_from_layer is not None:
        raise ValueError("--init-head and --init-from-layer both set the head's layer: give one")
    if not folder.is_dir():
        raise ValueError(f"--init-head {folder} is not a folder (a trained head: config.json + model.safetensors)")
    head = load_head(folder, hf)
    kind = "eagle3" if isinstance(head, Eagle3Head) else "eagle"
    if kind != session.args.arch:
        raise ValueError(f"--init-head {folder} is an {'EAGLE-3' if kind == 'eagle3' else 'EAGLE-1/2'} head but "
                         f"--arch is {session.args.arch}")
    if kind == "eagle3":
        layers, size = tuple(head.cfg.feature_layers), len(head.draft_to_target)
        if layers != feature_layers(session, hf):
            raise ValueError(f"--init-head {folder} taps layers {list(layers)}, not --feature-layers "
                             f"{list(feature_layers(session, hf))}")
        if session.args.draft_vocab not in (None, size):
            raise ValueError(f"--init-head {folder} has a draft vocabulary of {size}, not --draft-vocab "
                             f"{session.args.draft_vocab}")
    digest = hashlib.sha256()
    for f in sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in (".json", ".safetensors", ".bin",
                                                                              ".npy") and p.name != "train_log.json"):
        digest.update(f"{f.name}:{sha256_file(f)}".encode())
    counts = None
    if (folder / TOKEN_COUNTS_FILE).is_file():
        counts = np.load(folder / TOKEN_COUNTS_FILE)
        if counts.shape != (hf.config.vocab_size,):
            raise ValueError(f"--init-head {folder / TOKEN_COUNTS_FILE} has shape {counts.shape}, not "
                             f"({hf.config.vocab_size},)")
    session.log(f"init: starting from the head in {folder} ({kind})")
    return InitHead(head, digest.hexdigest(), counts)


def response_counts(data, vocab: int, init: InitHead | None = None):
    """[vocab] int64 numpy: the data's response-token counts, plus the starting head's
    token_counts.npy when it has one (the frequencies of everything the head was trained on)."""
    counts = data.response_counts(vocab)
    return counts + init.counts.astype(counts.dtype) if init is not None and init.counts is not None else counts


def new_eagle3_head(hf, counts, layers, size: int | None, seed: int):
    """An EAGLE-3 head for `hf` with the target's geometry, tapping `layers`, over a draft
    vocabulary of the `size` most frequent response tokens by `counts` ([vocab]; EOS ids included; default
    draft_vocab.default_size), its LM head initialised from the target's rows of those tokens
    and its final norm from the target's; the rest random (random_eagle3_head)."""
    import torch

    from eagle_deploy.exporter.draft_vocab import default_size
    from eagle_deploy.exporter.eagle3 import random_eagle3_head

    vocab = hf.config.vocab_size
    ids = draft_ids(hf, counts, size or min(default_size(vocab), vocab))
    head = random_eagle3_head(hf, seed=seed, draft_ids=torch.from_numpy(ids), feature_layers=layers)
    with torch.no_grad():
        head.lm_head.weight.copy_(hf.get_output_embeddings().weight[torch.from_numpy(ids)])
        head.norm.weight.copy_(hf.model.norm.weight)
    return head


def draft_ids(hf, counts, size: int):
    """[size] int64 numpy, sorted: the `size` most frequent response tokens by `counts` ([vocab]
    int64, `response_counts`), the EOS ids always among them (draft_vocab.best_ranked, as
    eagle-export ranks token_counts.npy). Raises ValueError outside [1, vocab]."""
    from eagle_deploy.exporter.draft_vocab import best_ranked

    vocab = hf.config.vocab_size
    if not 1 <= size <= vocab:
        raise ValueError(f"--draft-vocab {size} must be in [1, {vocab}]")
    eos = hf.config.eos_token_id
    eos_ids = [e for e in (eos if isinstance(eos, list) else [eos]) if isinstance(e, int)]
    return best_ranked(-counts, size, eos_ids)


def _init_from_layer(head, hf, layer: int) -> None:
    import torch

    src = hf.model.layers[layer]
    dst = head.layers[0]
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(dst.self_attn, name).weight.copy_(getattr(src.self_attn, name).weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(dst.mlp, name).weight.copy_(getattr(src.mlp, name).weight)
        dst.post_attention_layernorm.weight.copy_(src.post_attention_layernorm.weight)


if __name__ == "__main__":
    sys.exit(main())
