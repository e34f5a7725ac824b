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
features with --features-time-budget-min, each resumed by the same command. From Python:
eagle_deploy.train.pipeline.run(TrainSettings(...)) runs the same stages.

Exit status: 0 when the asked stages finished, 3 when --gen-time-budget-min or
--features-time-budget-min ended the data or feature stage first (run the same command again
until it exits 0; --time-budget-min only shortens training and never gives 3), 2 on bad input
or a refused cache, 130 when interrupted.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import fields, replace
from pathlib import Path

from eagle_deploy.common.cli_args import cli_error, interruptible, number_list

from .pipeline import UNFINISHED, run  # noqa: F401  (UNFINISHED: exit status 3, named for callers)
from .settings import ARCHS, CPU_QUICK, DTYPES, GPU, MAX_SEQ_LEN, PRESETS, STAGES, Recipe, TrainSettings


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="eagle-train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="target: alias, Hugging Face folder or .gguf file (as eagle-export)")
    p.add_argument("--out", type=Path, required=True, help="folder for the trained head (published EAGLE layout)")
    p.add_argument("--work", type=Path, default=None,
                   help="cache folder for the stages (default: OUT/../<out name>.work)")
    p.add_argument("--arch", choices=ARCHS, default=TrainSettings.arch,
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
    p.add_argument("--max-sequences", type=int, default=TrainSettings.max_sequences,
                   help="train on a random subset of this many sequences of the data (0: all; CPU recipes)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu-quick",
                   help="settings bundle: cpu-quick (900 prompts; measured 29 min on 2 CPU cores: data 10, "
                        "features 3, training 15 of its 30-min cap) or gpu (all prompts, sampled answers too, "
                        "3-step unrolling); any flag below overrides one value (default: cpu-quick)")
    p.add_argument("--prompts", default=TrainSettings.prompts,
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
    p.add_argument("--device", default=TrainSettings.device, help="auto | cpu | cuda")
    p.add_argument("--seed", type=int, default=TrainSettings.seed,
                   help="seed for sampled data, head initialisation, noise and batch order (default: 0)")
    meaning = {"ce_topk": "; EAGLE-1/2 heads: the soft labels of the cross-entropy term: 0 = the target's whole "
                          "distribution (softmax over the --draft-vocab ids when given), K = its top-K probabilities "
                          "renormalised (the head's log-probabilities stay over all the ids scored)",
               "modes": "; sampling temperatures of the generated answers, 0 = greedy",
               "max_new_tokens": "; the most tokens generated per answer. 0 = no answers: the prompts alone "
                                 "are the data (nothing generated; train on them with --prompt-positions)",
               "time_budget_min": "; training minutes: the steps it fits, planned from the warm-up steps' "
                                  "time, are where the cosine schedule ends (0: none)"}
    for name, default in CPU_QUICK.as_dict().items():
        p.add_argument("--" + name.replace("_", "-"), type=type(default), default=None,
                       help=f"preset value (cpu-quick: {default}; gpu: {getattr(GPU, name)}{meaning.get(name, '')})")
    p.add_argument("--max-steps", type=int, default=TrainSettings.max_steps,
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
    p.add_argument("--head-layers", type=int, default=TrainSettings.head_layers, metavar="N",
                   help="--arch eagle: decoder layers of the head (config.json num_hidden_layers). The first takes "
                        "fc's output without an input norm, as in EAGLE; the others are ordinary pre-norm layers. "
                        "1 is the published EAGLE-1/2 head; more layers cost more per draft forward (refused with "
                        "--arch eagle3: one layer) (default: %(default)s)")
    p.add_argument("--init-from-layer", type=int, default=None,
                   help="initialise the head's layer from this target layer (with --head-layers N: head layer i "
                        "from this target layer + i, the N of them all target layers)")
    p.add_argument("--init-head", type=Path, default=None, metavar="HEAD_DIR",
                   help="start from this trained head (published layout, of --arch's kind, for the same target) "
                        "instead of a random one (SmolLM2's shipped head: src/eagle_deploy/data/heads/smollm2-135m): "
                        "continue training on new data (e.g. the shipped head on a new "
                        "prompt mix). Its token_counts.npy, if any, is added to the data's counts for the draft "
                        "vocabulary and the written token_counts.npy; an EAGLE-3 head keeps its own draft "
                        "vocabulary and taps")
    p.add_argument("--torch-dtype", choices=DTYPES, default=TrainSettings.torch_dtype,
                   help="target precision for data generation and features. bf16 on CUDA: the target is converted "
                        "(large targets); on a CPU with native bf16 (avx512_bf16 or amx_bf16 in /proc/cpuinfo): a "
                        "bf16 copy runs the data and feature stages (measured 1.7x faster generation, 1.8x faster "
                        "features than fp32 on SmolLM2) and the first feature batch is checked against fp32 "
                        "(mean cosine >= 0.999 per sequence, >= 0.99 per position). The head keeps fp32 weights and "
                        "trains under bf16 autocast (a CPU step measured 1.35x faster) (default: fp32)")
    p.add_argument("--no-cache-features", action="store_true",
                   help="keep features in memory only (large data on a GPU)")
    p.add_argument("--gen-time-budget-min", type=float,
                   default=TrainSettings.gen_time_budget_min,
                   help="minutes from the start of the data stage: start no new part (1,024 prompts, or "
                        "--gen-batch if larger; one answer per --modes value each) that the last part's duration "
                        "says would end later (0: no limit; one part at least); with --stop-after data, a bounded "
                        "chunk of a long generation that a later run resumes")
    p.add_argument("--features-time-budget-min", type=float,
                   default=TrainSettings.features_time_budget_min,
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
                        "sequences at a time in batched forwards (BatchRuntime). "
                        "A quantised export answers several times faster than torch on a CPU (docs/decisions.md); "
                        "its answers are the quantised graph's. Features and training still run the torch target")
    p.add_argument("--stop-after", choices=STAGES, default=None,
                   help="stop after this stage (data: generate in bounded chunks; features: fill the cache)")
    return p


def settings_from_args(args: argparse.Namespace) -> TrainSettings:
    """The parsed flags as one `TrainSettings`: --preset's recipe with each value flag given
    over it."""
    recipe = replace(PRESETS[args.preset], **{f.name: getattr(args, f.name) for f in fields(Recipe)
                                              if getattr(args, f.name) is not None})
    return TrainSettings(
        model=args.model, out=args.out, work=args.work, arch=args.arch, recipe=recipe, draft_vocab=args.draft_vocab,
        feature_layers=args.feature_layers, max_sequences=args.max_sequences, prompts=args.prompts,
        decontaminate=args.decontaminate, data=args.data or (), device=args.device, seed=args.seed,
        max_steps=args.max_steps, max_seq_len=args.max_seq_len, prompt_positions=args.prompt_positions,
        init_from_layer=args.init_from_layer, head_layers=args.head_layers, init_head=args.init_head,
        torch_dtype=args.torch_dtype,
        cache_features=not args.no_cache_features, gen_time_budget_min=args.gen_time_budget_min,
        features_time_budget_min=args.features_time_budget_min, data_dir=args.data_dir,
        answers_from=args.answers_from, stop_after=args.stop_after)


@interruptible("eagle-train")
def main(argv=None) -> int:
    settings = settings_from_args(build_parser().parse_args(argv))
    try:
        result = run(settings)
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        return cli_error("eagle-train", err)
    if result.head is not None:
        print(result.head)
    return result.status


if __name__ == "__main__":
    sys.exit(main())
