"""`eagle-run`: generate with EAGLE speculative decoding from an export folder."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from eagle_deploy.common.cli_args import (
    LOSSY,
    HelpFormatter,
    add_runtime_args,
    add_tree_args,
    cli_error,
    interruptible,
    threshold_of,
    tree_from_args,
)
from eagle_deploy.contract.errors import max_length_hint


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="eagle-run", description=__doc__, formatter_class=HelpFormatter)
    add_runtime_args(p, "output no longer follows the target distribution")
    p.add_argument("--prompt", required=True, help="user message (the chat template is applied when the model has one)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--max-new-tokens", type=int, default=128, help="at most this many new tokens")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus truncation of the target distribution, in (0, 1] (1 = off)")
    p.add_argument("--top-k", dest="top_k", type=int, default=0,
                   help="top-k truncation of the target distribution (0 = off)")
    p.add_argument("--seed", type=int, default=None, help="makes sampled runs reproducible")
    p.add_argument("--stop", action="append", default=[],
                   help="stop string (repeatable); the text ends before it. "
                        "Taken literally: in bash, $'\\n' is a newline")
    g = p.add_argument_group("logits controls", "each keeps EAGLE's output equal to vanilla decoding's under the "
                                                "same settings (applied per draft-tree node from its own path)")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divide positive / multiply negative logits of tokens in the prompt or output (1 = off)")
    g.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtract this times each token's count in the output, in [-2, 2]")
    g.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtract this from tokens already in the output, in [-2, 2]")
    g.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens less likely than this times the most likely one, in [0, 1] (0 = off)")
    g.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS",
                   help="add BIAS (in [-100, 100]) to token ID's logit (repeatable; -100 bans a token)")
    g.add_argument("--logprobs", type=int, default=None, metavar="K",
                   help="with --json: each generated token's log-probability and its K best alternatives (0-20)")
    fmt = p.add_argument_group("structured output", "the output follows the grammar, exactly as vanilla decoding "
                                                    "under it would; tokens it forces are drafted for free")
    shape = fmt.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", type=Path, default=None, metavar="FILE",
                       help="a JSON schema (strict: keys and punctuation in one layout, ', ' and ': ')")
    shape.add_argument("--json-object", action="store_true", help="any JSON object")
    p.add_argument("--stream", action="store_true", help="print text as tokens are committed")
    which = p.add_mutually_exclusive_group()  # --vanilla --compare-vanilla would compare vanilla with itself
    which.add_argument("--vanilla", action="store_true", help="plain one-token-per-forward decoding on the same export")
    which.add_argument("--compare-vanilla", action="store_true",
                       help="also run vanilla decoding and print the speed-up and whether outputs are identical "
                            "(not with --vanilla)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object instead of text; its 'memory' holds resident memory by stage and peak "
                        "(vanilla's measured before the draft graph is opened), GPU memory on device backends, and "
                        "the export folder's size by file")
    p.add_argument("--prefix-cache-mb", type=float, default=0.0, metavar="MB",
                   help="MiB of KV kept from earlier requests (prompt and answer) and reused, bit for bit, by later "
                        "ones that start with the same tokens (here: the warm-up's prompt); --backend ort only; 0: off")
    add_tree_args(p, "the export's manifest")
    p.set_defaults(drafter=None)  # unset -> RuntimeOptions' default, after _check_no_effect
    return p


def _request(args, mode: str):
    """The flags' Request (runtime.request: every check that needs no model; a SettingError
    names the field, which `cli_error` words as the flag)."""
    from eagle_deploy.contract.errors import SettingError

    from .request import Request

    bias = []
    for item in args.logit_bias:
        token, sep, value = item.partition("=")
        try:
            bias.append((int(token), float(value)))
        except ValueError:
            raise SettingError("logit_bias", f"takes ID=BIAS (a token id and a number), got {item!r}") from None
    response_format = {"type": "json_object"} if args.json_object else None
    if args.json_schema is not None:
        try:
            schema = json.loads(args.json_schema.read_text())
        except OSError as err:
            raise SettingError("response_format", f"cannot read {args.json_schema}: {err.strerror or err}") from None
        except UnicodeDecodeError:
            raise SettingError("response_format", f"{args.json_schema} is not UTF-8 text") from None
        except ValueError as err:
            raise SettingError("response_format", f"{args.json_schema} is not JSON ({err})") from None
        response_format = {"type": "json_schema", "json_schema": {"name": args.json_schema.stem, "schema": schema,
                                                                  "strict": True}}
    return Request(args.prompt, args.max_new_tokens, args.temperature, args.top_p, args.top_k, args.seed,
                   tuple(args.stop), mode, False if args.raw else None, min_p=args.min_p, logit_bias=bias,
                   presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                   repetition_penalty=args.repetition_penalty, logprobs=args.logprobs,
                   response_format=response_format)


def _check_no_effect(args) -> None:
    """Raise ValueError for flags that would change nothing: draft flags with --vanilla, the
    head's tree flags with --drafter lookup (context lookup drafts chains, no head tree), and
    --top-p / --top-k / --min-p at --temperature 0 (greedy decoding takes the argmax; --seed is left
    alone: scripts pass it with every temperature)."""
    sampling = [flag for flag, changed in (("--top-p", args.top_p != 1.0), ("--top-k", args.top_k != 0),
                                           ("--min-p", args.min_p != 0.0)) if changed]
    if args.temperature == 0 and sampling:
        raise ValueError(f"{', '.join(sampling)} {'has' if len(sampling) == 1 else 'have'} no effect: "
                         "--temperature 0 decodes greedily (the target's most likely token)")
    tree = [flag for flag, value in (("--tree", args.tree), ("--total-tokens", args.total_tokens),
                                     ("--depth", args.depth), ("--tree-top-k", args.tree_top_k)) if value is not None]
    if args.vanilla:
        unused = [*tree, *(["--drafter"] if args.drafter is not None else []),
                  *(["--always-draft"] if args.always_draft else [])]
        why = "--vanilla decodes without a draft"
    else:
        unused, why = (tree if args.drafter == "lookup" else []), "--drafter lookup drafts no head tree"
    if unused:
        raise ValueError(f"{', '.join(unused)} {'has' if len(unused) == 1 else 'have'} no effect: {why}")


@interruptible("eagle-run")
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from eagle_deploy.contract.manifest import Manifest, ManifestError
    from eagle_deploy.contract.tree_config import TreeConfigError

    from .api import EagleRuntime
    from .hybrid import uses_draft_graph
    from .memory import export_sizes, rss_mb, snapshot
    from .options import FLAGS as OPTION_FLAGS
    from .options import RuntimeOptions
    from .request import FLAGS as REQUEST_FLAGS

    flags = {**OPTION_FLAGS, **REQUEST_FLAGS}
    try:
        # settings that need no model fail before anything is loaded or run
        mode = "vanilla" if args.vanilla else "eagle"
        request = _request(args, mode)
        _check_no_effect(args)
        if args.json and args.stream:
            raise ValueError("--stream and --json cannot be combined (--json prints one object at the end)")
        if args.logprobs is not None and not args.json:
            raise ValueError("--logprobs needs --json (the log-probabilities are printed in its 'logprobs')")
        threshold_of(args)  # --threshold without --acceptance threshold, worded with both flags
        options = RuntimeOptions.from_args(args)
        manifest = Manifest.load(args.engines)
        options = options.replace(tree=tree_from_args(args, manifest.tree))
        memory = {"rss_before_load_mb": rss_mb()}  # --json: resident memory by stage (runtime/memory.py)
        # the target graph first: vanilla decoding runs before the draft graph is opened, so the
        # process peak after it is vanilla's own (and --vanilla never opens the draft graph)
        rt = EagleRuntime.load(args.engines, options, with_draft=False)
        memory["rss_target_loaded_mb"] = rss_mb()
        rt.prompt_ids(request)  # a too long prompt fails before any note or forward
        rt.grammar_for(request)  # and a schema the grammar engine refuses
        draft_graph = mode == "eagle" and uses_draft_graph(options.drafter_kind)  # --vanilla never opens it either
        for note in manifest.output_notes:
            print(f"note: {note}", file=sys.stderr)
        if args.acceptance != "lossless":
            print(f"note: --acceptance {args.acceptance} is {LOSSY}: output does not follow the target distribution",
                  file=sys.stderr)
        device = args.backend != "ort"
        vanilla = None
        if args.compare_vanilla:
            rt.generate(request.replace(max_new_tokens=4, mode="vanilla"))  # warm-up
            vanilla = rt.generate(request.replace(mode="vanilla"))
            memory["vanilla"] = snapshot(device)
        if draft_graph:
            rt.load_draft()
            memory["rss_draft_loaded_mb"] = rss_mb()
        result = _run(rt, args, request)
        memory[mode] = snapshot(device)
        comparison = {}  # --compare-vanilla: vanilla_tokens_per_s, speedup, identical_to_vanilla
        if vanilla is not None:
            speed = result.stats.tokens_per_s / max(vanilla.stats.tokens_per_s, 1e-9)
            comparison = {"vanilla_tokens_per_s": vanilla.stats.to_json()["tokens_per_s"], "speedup": round(speed, 3),
                          "identical_to_vanilla": vanilla.token_ids == result.token_ids}
            memory["eagle_vs_vanilla_peak_rss"] = round(memory["eagle"]["peak_rss_mb"]
                                                        / max(memory["vanilla"]["peak_rss_mb"], 1e-9), 3)
        memory["export"] = export_sizes(args.engines)
    except (ManifestError, TreeConfigError, ValueError, TypeError, FileNotFoundError) as err:
        return cli_error("eagle-run", err, flags)  # one line, no traceback
    except (ImportError, RuntimeError) as err:  # a backend that cannot run here (no GPU, no TensorRT)
        print(f"eagle-run: error: backend {args.backend!r} unavailable: {err}", file=sys.stderr)
        return 3
    if args.json:
        out = {"text": result.text, "token_ids": result.token_ids, "finish_reason": result.finish_reason,
               "stats": {**result.stats.to_json(), **comparison}, "memory": memory,
               "notes": list(manifest.notes)}
        if result.logprobs is not None:
            out["logprobs"] = [{"token": e.token, "logprob": e.logprob, "top": [list(t) for t in e.top]}
                               for e in result.logprobs]
        print(json.dumps(out))
    else:
        if not args.stream:
            print(result.text)
        print(_summary(result, comparison, manifest, draft_graph), file=sys.stderr)
    return 0


def _run(rt, args, request):
    if args.compare_vanilla or not args.stream:
        rt.generate(request.replace(max_new_tokens=4))  # warm-up: first-call allocations
    request = rt.stream(request)
    for delta in request:
        if args.stream and not args.json:
            print(delta, end="", flush=True)
    if args.stream and not args.json:
        print()
    return request.result


def _cached(stats) -> str:
    """", N of M prompt tokens from the prefix cache" after a hit, else ""."""
    return f" ({stats.cached_tokens} of {stats.prompt_tokens} prompt tokens cached)" if stats.cached_tokens else ""


def _summary(result, comparison: dict, manifest, draft_graph: bool) -> str:
    s = result.stats
    tag = s.mode  # which drafter ran (None for vanilla), and how many rounds it drafted (a cost-aware one skips some)
    if s.drafter is not None:
        tag += f": {s.drafter} drafter, {s.draft_rounds} of {s.rounds} rounds drafted"
    line = (f"[{tag}] {s.new_tokens} new tokens, {s.tokens_per_s:.1f} tokens/s, "
            f"tau {s.mean_accept_len:.2f} tokens/forward, {s.target_forwards} target forwards, "
            f"TTFT {s.t_prefill * 1e3:.0f} ms{_cached(s)}, finish: {result.finish_reason}")
    if s.limited_by == "capacity":
        hint = max_length_hint(manifest.max_length, manifest.length_limit)
        line += (f" (the export's KV capacity, max_length {manifest.max_length}, ran out before --max-new-tokens; "
                 f"{hint + ' for longer outputs' if hint else 'already the largest max_length allowed'})")
    if not s.lossless:
        line += f" [{LOSSY}: threshold acceptance]"
    if comparison:
        line += (f"\n[vanilla] {comparison['vanilla_tokens_per_s']:.1f} tokens/s; "
                 f"speed-up {comparison['speedup']:.2f}x; "
                 f"identical to vanilla: {comparison['identical_to_vanilla']}")
    if draft_graph and not manifest.draft.trained:
        line += "\nnote: this export uses a RANDOMLY INITIALISED draft head, so acceptance is near 1 token per round"
    return line


if __name__ == "__main__":
    sys.exit(main())
