"""Command-line pieces shared by every CLI (eagle-export, eagle-run, eagle-bench, eagle-eval,
eagle-train, eagle-validate): the draft-tree flags, --verify, the help formatter, the Ctrl-C
handling and the one-line report of a disk failure. Imports nothing heavy."""
from __future__ import annotations

import argparse
import functools
import math
import os
import sys
from pathlib import Path

from eagle_deploy.contract.errors import DISK_ERRORS, SettingError, disk_errno
from eagle_deploy.contract.tree_config import (
    DEFAULT_DRAFTER,
    DEFAULT_TREE,
    DRAFTER_KINDS,
    STATIC_TREES,
    TreeConfig,
    TreeConfigError,
)

INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C
BAD_INPUT = 2  # argparse's exit status for a usage error; every CLI's for input it refuses


def cli_error(prog: str, message, flags: dict[str, str] | None = None) -> int:
    """Print `prog: error: message` on stderr (argparse's form) as one line (whitespace runs,
    newlines included, collapsed) and return BAD_INPUT, the tail of every CLI's refusal:
    `return cli_error("eagle-run", err)`. flags: {field: flag}: a SettingError about one of
    those fields is worded with the flag typed ("--top-p must be ...", not "top_p must be")."""
    if isinstance(message, SettingError) and flags:
        base = message.field.partition("[")[0].partition(".")[0]
        if base in flags:  # "stop[1]" -> "--stop[1]"
            message = message.named(flags[base] + message.field[len(base):])
    print(f"{prog}: error: " + " ".join(str(message).split()), file=sys.stderr)
    return BAD_INPUT


def interruptible(prog: str):
    """Decorator for every CLI's `main(argv=None) -> int`: Ctrl-C (KeyboardInterrupt),
    wherever it lands (a slow import, a forward, a streamed print), ends the command with one
    line on stderr and exit status 130 instead of a traceback."""

    def wrap(main):
        @functools.wraps(main)
        def run(argv=None):
            try:
                return main(argv)
            except KeyboardInterrupt:
                print(f"\n{prog}: interrupted", file=sys.stderr, flush=True)
                return INTERRUPTED

        return run

    return wrap


def add_tree_args(parser: argparse.ArgumentParser, defaults_from: str) -> None:
    """The draft-tree flags shared by eagle-export, eagle-run and eagle-bench."""
    g = parser.add_argument_group("draft tree", f"defaults: {defaults_from}")
    g.add_argument("--tree", choices=["dynamic", *STATIC_TREES], default=None,
                   help="'dynamic' = EAGLE-2 tree; a static EAGLE-1 tree by name")
    g.add_argument("--total-tokens", type=int, default=None, help="verification tokens per round, root included")
    g.add_argument("--depth", type=int, default=None, help="draft steps per round")
    g.add_argument("--tree-top-k", dest="tree_top_k", type=int, default=None, help="children per expanded node")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: ...)" except for on/off flags and help texts that state their own default."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.nargs == 0 or "default:" in text or action.default is None:
            return text
        return super()._get_help_string(action)


def tree_from_args(args, base: TreeConfig | None) -> TreeConfig | None:
    """The tree the flags ask for; `base` (the manifest's, or None for the export default)
    when no tree flag is given, with any given flag overriding it."""
    given = {"total_tokens": args.total_tokens, "depth": args.depth, "tree_top_k": args.tree_top_k}
    if args.tree and args.tree != "dynamic":
        sized = [f"--{k.replace('_', '-')}" for k, v in given.items() if v is not None]
        if sized:
            raise TreeConfigError(f"--tree {args.tree} is a fixed EAGLE-1 tree; "
                                  f"{', '.join(sized)} only apply to --tree dynamic")
        return TreeConfig.static(args.tree)
    if not args.tree and all(v is None for v in given.values()):
        return base
    for name, value in given.items():
        if value is not None and value < 1:
            raise TreeConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.total_tokens == 1:
        raise TreeConfigError("--total-tokens 1 verifies only the root, which is vanilla decoding: "
                              "use --vanilla, or >= 2")
    start = base if base is not None and base.kind == "dynamic" else DEFAULT_TREE
    pick = lambda value, default: default if value is None else value  # noqa: E731
    return TreeConfig("dynamic", pick(args.total_tokens, start.total_tokens), pick(args.depth, start.depth),
                      pick(args.tree_top_k, start.top_k))


def number_list(kind: type, minimum: float, what: str):
    """An argparse `type=` for comma-separated numbers of `kind` (int or float), each >= `minimum`
    (floats finite too: nan and inf are refused); a bad value is reported as "expected
    comma-separated ...", "<what> must be >= <minimum>" or "<what> must be finite numbers >= ..."."""
    def parse(text: str) -> list:
        try:
            vals = [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            noun = "integers" if kind is int else "numbers"
            raise argparse.ArgumentTypeError(f"expected comma-separated {noun}, got {text!r}") from None
        if kind is not int and not all(math.isfinite(v) for v in vals):
            raise argparse.ArgumentTypeError(f"{what} must be finite numbers >= {minimum}, got {text!r}")
        if not vals or any(v < minimum for v in vals):
            raise argparse.ArgumentTypeError(f"{what} must be >= {minimum}, got {text!r}")
        return vals
    return parse


def check_at_least(checks, finite: bool = False) -> None:
    """Raise ValueError "<flag> must be >= <least>, got <value>" for the first (flag, value,
    least) whose value is below least, and "<flag> must be a finite number >= <least>, got nan"
    for a NaN (which compares False with everything) or, with `finite`, an infinite value
    (otherwise inf passes: e.g. a request rate of inf, all at once); a None value (a flag left
    unset) passes."""
    for flag, value, least in checks:
        if value is None:
            continue
        if isinstance(value, float) and (math.isnan(value) or (finite and math.isinf(value))):
            raise ValueError(f"{flag} must be a finite number >= {least}, got {value}")
        if value < least:
            raise ValueError(f"{flag} must be >= {least}, got {value}")


def check_output_path(flag: str, path: Path | None, folder: bool) -> None:
    """Raise ValueError (one line naming `flag`) when a command could not write `path` at its
    end: a file where a folder is written (`folder`) or a folder where a file is, a file among
    its parents, or no write permission in the nearest existing one (a read-only mount). Called
    before any work, so a long run fails at once; missing parent folders pass (the writer
    creates them). None (a flag left unset) passes."""
    if path is None:
        return
    path = Path(path)
    if path.exists() and path.is_dir() != folder:
        raise ValueError(f"{flag} {path} is a {'file, not a folder' if folder else 'folder, not a file'}")
    for where in (path, *path.parents):  # the nearest existing one is written into
        if where.exists():
            if not where.is_dir() and where != path:
                raise ValueError(f"{flag} {path}: {where} is a file, not a folder")
            if not os.access(where, os.W_OK):
                raise ValueError(f"{flag} {path}: {where} is not writable: choose a writable folder")
            return


LOSSY = "NOT LOSSLESS"
BACKEND_NAMES = ("ort", "ort-cuda", "trt")  # engine backends, as `runtime.backends.load_backend` knows them


# RuntimeOptions.prefill_graph: "auto" = the export's prefill graph (manifest `prefill`) for prompt
# forwards where there is one and the backend is "ort"; "target" = target.onnx for every forward
PREFILL_GRAPHS = ("auto", "target")
VERIFY_CHOICES = ("fast", "full", "off")  # contract.verify.VERIFY_LEVELS (not imported: it needs the manifest)


def add_verify_arg(parser: argparse.ArgumentParser, default: str = "fast") -> None:
    """--verify, for every command that reads an export folder (eagle-run, eagle-serve,
    eagle-validate): how its files are checked against the manifest before use
    (contract/verify.py). default: "fast" for the commands that load and exit; eagle-serve,
    which loads once and then answers for every response, passes "full"."""
    parser.add_argument("--verify", default=default, choices=VERIFY_CHOICES,
                        help="check the export's files against its manifest before loading: 'fast' = graph "
                             "inputs/outputs, file sizes, sha256 of files up to 16 MiB and sampled blocks of larger "
                             "ones (milliseconds; a few changed bytes in a large file go unseen); 'full' = the sha256 "
                             "of every file (about 1 s per GB); 'off'")


def add_drafter_args(parser: argparse.ArgumentParser) -> None:
    """--drafter and --always-draft, for every command that decodes (eagle-run, eagle-serve,
    eagle-triton-repo): where draft tokens come from, and whether each round's draft is sized by
    its expected tokens per second (runtime/planner.py) or is the configured tree every round."""
    parser.add_argument("--drafter", default=DEFAULT_DRAFTER, choices=DRAFTER_KINDS,
                        help="hybrid = the EAGLE head's tree plus context-lookup branches (tokens copied from the "
                             "prompt and output) in one tree; eagle = the head alone; lookup = context lookup alone "
                             f"(no draft graph). Every choice is lossless (default: {DEFAULT_DRAFTER})")
    parser.add_argument("--always-draft", action="store_true",
                        help="draft the configured tree every round (by default each round drafts what pays on this "
                             "machine, down to a plain vanilla step; then seeded sampling repeats within a process, "
                             "and across processes after eagle-bench --tune)")


def add_runtime_args(parser: argparse.ArgumentParser, threshold_effect: str, verify_default: str = "fast") -> None:
    """The flags of every command that decodes over an export (eagle-run, eagle-serve): --engines,
    --drafter, --always-draft, --verify (default `verify_default`), --backend, --threads, --prefill-graph,
    --acceptance, --threshold.
    `threshold_effect` ends the --acceptance help (what the command says about lossy output)."""
    parser.add_argument("--engines", type=Path, required=True, help="an export folder written by eagle-export")
    add_drafter_args(parser)
    add_verify_arg(parser, verify_default)
    parser.add_argument("--backend", default="ort", choices=BACKEND_NAMES,
                        help="ort = onnxruntime CPU; ort-cuda and trt need a CUDA GPU "
                             "(trt: engines from eagle-export --backend trt)")
    parser.add_argument("--threads", type=int, default=None, help="onnxruntime intra-op threads per session")
    parser.add_argument("--prefill-graph", default="auto", choices=PREFILL_GRAPHS,
                        help="which graph runs prompt forwards: 'auto' = the export's int8 prefill graph where it has "
                             "one (eagle-export --prefill-weights int8) and the backend is ort, else the target graph; "
                             "'target' = the target graph always (decoding runs the target graph either way)")
    parser.add_argument("--acceptance", default="lossless", choices=["lossless", "threshold"],
                        help="'threshold' accepts a draft token when the target's probability of it is >= "
                             f"--threshold: {LOSSY}, {threshold_effect}")
    parser.add_argument("--threshold", type=float, default=None,
                        help=f"probability threshold for --acceptance threshold ({LOSSY}) (default: "
                             f"{DEFAULT_THRESHOLD})")


DEFAULT_THRESHOLD = 0.3  # the threshold of threshold acceptance when none is given (runtime.options)


def threshold_of(args) -> float | None:
    """--threshold as given (None: runtime.options.RuntimeOptions' default). ValueError for
    --threshold without --acceptance threshold, worded with the flags (it would change
    nothing)."""
    if args.threshold is not None and args.acceptance != "threshold":
        raise ValueError("--threshold has no effect without --acceptance threshold (lossless acceptance takes no "
                         "threshold)")
    return args.threshold



def disk_error(err: BaseException, where=None) -> str | None:
    """One line for a write failure (errors.disk_errno: read-only, full, not permitted),
    naming the path (the error's, else `where`) and what to do; None for any other error."""
    code, path = disk_errno(err)
    if code is None:
        return None
    path = path or where
    return f"cannot write {'into ' + str(path) if path else 'a file'}: {os.strerror(code)} ({DISK_ERRORS[code]})"
