"""`eagle-bench`: EAGLE vs vanilla decoding on the same engine, plus opt-in baselines, on prompt sets.

    eagle-bench --engines engines/smollm2-135m --limit 5 --max-new-tokens 64
    eagle-bench --engines engines/smollm2-135m --temperatures 0,0.7,1.0 --baselines hf,llamacpp
    eagle-bench --engines engines/smollm2-135m --backends ort,trt
    eagle-bench --engines /tmp/eng/smollm2-135m --extra-engines /tmp/eng/smollm2-135m-int4 \\
        --baselines ort-genai,openvino --limit 3 --threads 2     # peer CPU runtimes, README
    eagle-bench --engines engines/smollm2-135m --baselines openvino-eagle3 \\
        --eagle3-head data/heads/smollm2-135m-eagle3     # OpenVINO GenAI's own EAGLE-3 decoding
    eagle-bench --engines engines/smollm2-135m --tune       # pick the tree, write it to the manifest
    eagle-bench serve --url http://127.0.0.1:8000 --concurrency 1,2,4,8   # load mode: a running eagle-serve

Per prompt and aggregated: tokens/s, tau (tokens per target forward), speed-up over vanilla
decoding (run interleaved with EAGLE, alternating order), EAGLE's time split
(draft/verify/commit/other), TTFT, peak memory, and for greedy prompts whether EAGLE matched
vanilla token for token (each divergence classified "numerics" or "bug"; see
bench/divergence.py). Baselines, only with --baselines (greedy, same prompt token ids,
same thread count): hf (transformers generate), hf-lookup (prompt_lookup_num_tokens=10),
llamacpp and llamacpp-lookup (llama-cpp-python on the export's GGUF; skipped with a note
when that package is absent), and the peer runtimes ort-genai (= ort-genai-fp32,
ort-genai-int4: onnxruntime-genai's model builder) and openvino (= openvino-fp32, -int8,
-int4: optimum-cli export + OpenVINO GenAI LLMPipeline) and openvino-eagle3 (= -fp32, -int8,
-int4: OpenVINO GenAI's EAGLE-3 speculative decoding over those models, drafting with the
EAGLE-3 head given by --eagle3-head), converted from the export's HF checkpoint folder once and
cached (bench/peers.py; skipped with a note naming what is missing: a package, or the head).
On a 2-core CPU with SmolLM2-135M at 128 new tokens, EAGLE + vanilla take about 4 s per
prompt, hf and hf-lookup about 5 s each more, llamacpp about 1 s and llamacpp-lookup 2 s
(after a one-off ~6 min build of llama-cpp-python); by default 10 prompts of each set are
run, so the default run takes about 2 minutes.
Writes a JSON file and a PNG plot beside it. Needs the `bench` extra (matplotlib for the plot,
psutil for the memory probe): without it eagle-bench stops before any work, with one line
naming `pip install 'eagle-deploy[bench]'`.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import importlib.util
import json
import os
import sys
from pathlib import Path

from eagle_deploy.common.cli_args import (
    add_tree_args,
    check_at_least,
    cli_error,
    interruptible,
    number_list,
    tree_from_args,
)

from .peers import expand
from .systems import BASELINES, PEERS

DEFAULT_BASELINES = ""  # none: the quick default is EAGLE vs vanilla on the export's engine; baselines are opt-in
SETS_DEFAULT = "humaneval,chat"
DEFAULT_LIMIT = 10  # prompts per built-in set by default: 20 prompts, about 2 min at 128 tokens on 2 CPU cores


_floats = number_list(float, 0, "temperatures")


def _names(allowed):
    def parse(text: str) -> list[str]:
        names = list(allowed) if text.strip() == "all" else [x.strip() for x in text.split(",") if x.strip()]
        bad = [n for n in names if n not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(bad)}; choose from {', '.join(allowed)}")
        return names
    return parse


def _baselines(text: str) -> list[str]:
    """--baselines: names from BASELINES, peer families (expanded to every precision), or "all"."""
    return expand(_names(BASELINES + tuple(PEERS))(text if text.strip() != "all" else ",".join(BASELINES)))


def build_parser() -> argparse.ArgumentParser:
    from eagle_deploy.runtime.backends import BACKENDS

    p = argparse.ArgumentParser(prog="eagle-bench", description=__doc__,
                                usage="%(prog)s --engines DIR [options]\n       %(prog)s serve --url URL "
                                      "[options]   (load mode; see: eagle-bench serve -h)",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", type=Path, required=True, help="export folder written by eagle-export")
    p.add_argument("--sets", default=None,
                   help=f"prompt sets: humaneval, chat (comma-separated; default: {SETS_DEFAULT}; "
                        "none with --specbench)")
    p.add_argument("--prompts", type=Path, action="append", default=[],
                   help="a JSONL prompt file ({\"prompt\": ...} per line); replaces --sets")
    p.add_argument("--limit", type=int, default=None,
                   help=f"first N prompts of each set, 0 = all (default: {DEFAULT_LIMIT} of each built-in set, "
                        "all of a --prompts file; humaneval has 164 prompts, chat 48)")
    p.add_argument("--specbench", type=Path, default=None, metavar="QUESTION_JSONL",
                   help="also run Spec-Bench (hemingkx/Spec-Bench's question.jsonl, given by path; not shipped): "
                        "reported per task (mt_bench, translation, summarization, qa, math_reasoning, rag); "
                        "--limit applies per task; first turns only")
    p.add_argument("--drafters", type=_names(("hybrid", "lookup")), default=["hybrid"],
                   help="more systems per engine beside plain EAGLE (the configured tree every round) and vanilla: "
                        "eagle-hybrid (head + context lookup in one tree, cost-aware: the commands' default), "
                        "eagle-lookup; comma-separated")
    p.add_argument("--no-drafters", action="store_true", help="plain EAGLE and vanilla only (no --drafters systems)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per generation (default: 128)")
    p.add_argument("--temperatures", type=_floats, default=[0.0], help="comma-separated, 0 = greedy (e.g. 0,0.7,1.0)")
    p.add_argument("--seed", type=int, default=0, help="sampled runs use seed + prompt index")
    p.add_argument("--baselines", type=_baselines, default=None,
                   help=f"opt-in systems to compare with, comma-separated: {','.join(BASELINES)}, the peer families "
                        f"{','.join(PEERS)} (every precision), or 'all' "
                        "(default: none, EAGLE vs vanilla only). On a 2-core CPU with SmolLM2-135M, each HF baseline "
                        "adds about as much time per prompt as EAGLE + vanilla together; llamacpp needs "
                        "pip install '.[llamacpp]', the peers pip install '.[peers]' (both, and OpenVINO's converter: "
                        "docs/guide-benchmarking.md)")
    p.add_argument("--extra-engines", type=Path, action="append", default=[],
                   help="another export of the same model (e.g. an int4 one), run interleaved on the first backend "
                        "as eagle@<folder name> and vanilla@<folder name>; repeatable")
    p.add_argument("--eagle3-head", type=Path, default=None,
                   help="EAGLE-3 draft head (config.json + model.safetensors in the EAGLE-3 reference layout, "
                        "e.g. data/heads/smollm2-135m-eagle3) that the openvino-eagle3-* peers draft with "
                        "(OpenVINO GenAI's own EAGLE-3 speculative decoding); without it they are skipped")
    p.add_argument("--no-baselines", action="store_true",
                   help="EAGLE and vanilla only (the default; overrides --baselines)")
    p.add_argument("--backends", type=_names(BACKENDS), default=["ort"],
                   help="comma-separated: ort, ort-cuda, trt (first = plain names)")
    p.add_argument("--threads", type=int, default=os.cpu_count(),
                   help="threads for every system (ORT sessions, torch, llama.cpp)")
    p.add_argument("--no-warmup", action="store_true", help="skip the short warm-up generation per system")
    p.add_argument("--no-memory", action="store_true",
                   help="skip the memory probe (by default EAGLE's and vanilla's peak RSS are measured on the first "
                        "prompt, each in a fresh process, vanilla with the target graph alone; ~2 loads + 2 decodes)")
    p.add_argument("--out", type=Path, default=None,
                   help="result JSON (default bench_results/<export>-<time>.json); the PNG goes beside it")
    p.add_argument("--json", action="store_true",
                   help="print the aggregate as JSON on stdout (the table goes to stderr)")
    p.add_argument("-q", "--quiet", action="store_true", help="no per-prompt progress lines")
    t = p.add_argument_group("tuning (--tune)")
    t.add_argument("--tune", action="store_true",
                   help="measure cost curves and acceptance, pick the tree, write it to the manifest")
    t.add_argument("--calib", type=int, default=4,
                   help="calibration prompts for --tune, spread over --prompts / --sets / --specbench (Spec-Bench "
                        "alone: its questions, every task)")
    t.add_argument("--repeats", type=int, default=5, help="timed rounds per cost-curve point (its fastest)")
    t.add_argument("--no-save", action="store_true", help="--tune: report the choice without writing the manifest")
    add_tree_args(p, "the export's manifest")
    return p


def _default_out(engines: Path) -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("bench_results") / f"{engines.resolve().name}-{stamp}.json"


def check_bench_extra(memory: bool = True) -> None:
    """Raise ModuleNotFoundError (one line naming the pip command) when a package of the
    `bench` extra that a benchmark run needs is missing: matplotlib (the plot), and psutil with
    the memory probe (`memory`). Checked before any work, so no run ends without its plot."""
    needed = ["matplotlib", *(["psutil"] if memory else [])]
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        raise ModuleNotFoundError(f"eagle-bench needs {' and '.join(missing)} (the bench extra): "
                                  "pip install 'eagle-deploy[bench]'")


def _bench(args, tree, say) -> int:
    from . import report
    from .run import BenchConfig, run_bench

    chosen = args.baselines if args.baselines is not None else [b for b in DEFAULT_BASELINES.split(",") if b]
    baselines = [] if args.no_baselines else chosen
    sets = _prompt_sets(args)
    limit = args.limit if args.limit is not None else (0 if args.prompts else DEFAULT_LIMIT)
    cfg = BenchConfig(args.engines, sets, limit, args.max_new_tokens, args.temperatures, baselines, args.backends,
                      args.threads, tree, args.seed, not args.no_warmup, memory=not args.no_memory,
                      extra_engines=list(args.extra_engines), eagle3_head=args.eagle3_head,
                      drafters=[] if args.no_drafters else args.drafters, specbench=args.specbench)
    result = run_bench(cfg, log=(lambda m: None) if args.quiet else say)
    out = args.out or _default_out(args.engines)
    report.write_json(result, out)  # the measurements first, whatever happens to the plot
    summary = report.format_summary(result)
    png = report.plot(result, out.with_suffix(".png"))
    if args.json:
        print(summary, file=sys.stderr)
        print(json.dumps({"aggregate": result["aggregate"], "greedy_identity": result["greedy_identity"],
                          "baselines": result["baselines"], "memory": result["memory"],
                          "json": str(out), "png": str(png)}))
    else:
        print(summary)
        print(f"wrote {out} and {png}")
    return 0


def _prompt_sets(args) -> list[str]:
    """The prompt sets named by --prompts (files) or --sets; the built-in ones by default, none
    when --specbench alone is given."""
    names = args.sets if args.sets is not None else ("" if args.specbench is not None else SETS_DEFAULT)
    return [str(p) for p in args.prompts] or [s.strip() for s in names.split(",") if s.strip()]


def _tune(args, tree, say) -> int:
    from eagle_deploy.common.prompts import load_prompts

    from .tune import TuneConfig, tune

    prompts = load_prompts(_prompt_sets(args), 0, args.specbench)  # all of each set; --calib of them, spread
    cfg = TuneConfig(args.engines, prompts, calib=args.calib, max_new_tokens=min(args.max_new_tokens, 64),
                     repeats=args.repeats, threads=args.threads, backend=args.backends[0], save=not args.no_save)
    record = tune(cfg, log=(lambda m: None) if args.quiet else say)
    chosen = record["chosen"]
    line = (f"chosen tree: total_tokens={chosen['total_tokens']} depth={chosen['depth']} top_k={chosen['top_k']} "
            f"({record['chosen_measured_tokens_per_s']:.1f} tokens/s measured, "
            f"{record['speedup_vs_vanilla']:.2f}x vanilla; "
            f"{'written to the manifest' if cfg.save else 'not saved (--no-save)'})")
    if args.json:
        print(line, file=sys.stderr)
        print(json.dumps(record))
    else:
        print(line)
    return 0


@interruptible("eagle-bench")
def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:  # load mode: drive a running eagle-serve (bench/load.py)
        from .load import main as load_main

        return load_main(argv[1:], prog="eagle-bench serve")
    args = build_parser().parse_args(argv)
    from eagle_deploy.contract.manifest import Manifest, ManifestError
    from eagle_deploy.contract.tree_config import TreeConfigError

    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    try:
        check_at_least([("--max-new-tokens", args.max_new_tokens, 1), ("--limit", args.limit, 0),
                        ("--threads", args.threads, 1)])
        if not args.tune:
            check_bench_extra(memory=not args.no_memory)
        manifest = Manifest.load(args.engines)
        tree = None  # the manifest's own tree unless a tree flag is given
        if any(v is not None for v in (args.tree, args.total_tokens, args.depth, args.tree_top_k)):
            tree = tree_from_args(args, manifest.tree).validate(manifest.draft.graph_top_k)
        return _tune(args, tree, say) if args.tune else _bench(args, tree, say)
    except (ManifestError, TreeConfigError, FileNotFoundError, ModuleNotFoundError, ValueError) as err:
        return cli_error("eagle-bench", err)


if __name__ == "__main__":
    sys.exit(main())
