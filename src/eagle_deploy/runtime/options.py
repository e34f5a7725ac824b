"""How an export is decoded: `RuntimeOptions`, the one set of runtime defaults.

`EagleRuntime.load`, `BatchRuntime.load`, eagle-run, eagle-serve, the Triton model and
eagle-bench all take one `RuntimeOptions` (the CLIs build it from their flags with
`RuntimeOptions.from_args`), so a default lives here and nowhere else. The default decodes with
the fastest lossless drafter measured (`hybrid`, planned: the head's tree plus context lookup,
each round sized by its expected tokens per second; docs/drafting.md), the same for the Python
API as for the commands.

    rt = EagleRuntime.load("engines/smollm2-135m")                             # the defaults
    rt = EagleRuntime.load(folder, RuntimeOptions(drafter_kind="eagle", planned=False))
    rt = EagleRuntime.load(folder, threads=2)                      # one option changed
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from eagle_deploy.common.cli_args import BACKEND_NAMES, DEFAULT_THRESHOLD, PREFILL_GRAPHS, VERIFY_CHOICES
from eagle_deploy.contract.errors import SettingError
from eagle_deploy.contract.tree_config import DEFAULT_DRAFTER, DRAFTER_KINDS, TreeConfig

from .decode import PREFILL_CHUNK
from .sampling import finite_number, whole_number

# option -> the flag that sets it (eagle-run, eagle-serve): errors name the flag on the command line
FLAGS = {"backend": "--backend", "tree": "--tree", "threads": "--threads", "drafter_kind": "--drafter",
         "planned": "--always-draft", "acceptance": "--acceptance", "threshold": "--threshold",
         "verify": "--verify", "prefill_chunk": "--prefill-chunk", "prefix_cache_mb": "--prefix-cache-mb",
         "prefill_graph": "--prefill-graph"}


@dataclass(frozen=True)
class RuntimeOptions:
    """Engine settings, checked when made (SettingError, a ValueError, naming the option).

    backend: "ort" (onnxruntime CPU), "ort-cuda", "trt" (TensorRT engines of the export).
    tree: the draft tree (None: the manifest's). threads: intra-op threads per onnxruntime
    session (None: onnxruntime's choice), >= 1.
    drafter_kind: where draft tokens come from: "hybrid" (the head's tree plus context-lookup
    branches in one tree), "eagle" (the head alone), "lookup" (context lookup alone, no draft
    graph); every kind is lossless. planned: size each round's draft by its expected tokens
    per second on this machine (runtime/planner.py), down to a plain vanilla step; False: the
    configured tree every round (then a seed gives the same tokens in every process without a
    tuned export).
    acceptance: "lossless" (the target's distribution exactly; greedy: token for token) or
    "threshold" (NOT lossless: accept a draft token the target gives probability >= threshold).
    threshold: None = DEFAULT_THRESHOLD under threshold acceptance; a value with lossless
    acceptance is refused (it would change nothing).
    verify: "fast" | "full" | "off", how the export's files are checked against the manifest
    before a graph is opened (contract/verify.py). row_exact: give every one-token forward its
    two-row bits (two rows, or one where the target graph repeats one-row queries itself and
    its matmuls allow: runtime/row_exact.py) so that greedy EAGLE equals vanilla bit for bit
    (None: on for quantised targets).
    prefill_chunk: rows per prefill forward of a long prompt (0: the whole prompt in one
    forward; same bits either way). draft_forced: under a request's grammar
    (response_format), draft the tokens it forces as a chain (False: only the drafter's
    proposals, pruned to the grammar; for measuring what forced drafts add).
    prefix_cache_mb: MiB of target KV and features of earlier requests kept for later requests
    that start with the same tokens (runtime/prefix_cache.py: exact, least recently used
    evicted first; backend "ort" only); 0: off, the default here and in eagle-run (a process
    of one request gains nothing), while eagle-serve keeps serve.cli.SERVE_PREFIX_CACHE_MB.
    prefill_graph: which graph runs a prompt's forwards (its prefill chunks, and the rows a
    prefix cache stores): "auto" (the default) the export's int8 prefill graph when it has one
    (`eagle-export --prefill-weights int8`, manifest `prefill`) and the backend is "ort", else
    the target graph; "target": the target graph always. Decoding and verification forwards
    run the target graph either way (`uses_prefill_graph`)."""

    backend: str = "ort"
    tree: TreeConfig | None = None
    threads: int | None = None
    drafter_kind: str = DEFAULT_DRAFTER
    planned: bool = True
    acceptance: str = "lossless"
    threshold: float | None = None
    verify: str = "fast"
    row_exact: bool | None = None
    prefill_chunk: int = PREFILL_CHUNK
    draft_forced: bool = True
    prefix_cache_mb: float = 0
    prefill_graph: str = "auto"

    def __post_init__(self):
        _one_of("backend", self.backend, BACKEND_NAMES)
        _one_of("drafter_kind", self.drafter_kind, DRAFTER_KINDS)
        _one_of("acceptance", self.acceptance, ("lossless", "threshold"))
        _one_of("verify", self.verify, VERIFY_CHOICES)
        _one_of("prefill_graph", self.prefill_graph, PREFILL_GRAPHS)
        if self.tree is not None and not isinstance(self.tree, TreeConfig):
            raise SettingError("tree", f"must be a TreeConfig or None, got {self.tree!r}")
        if self.threads is not None:
            object.__setattr__(self, "threads", whole_number(self.threads, "threads", 1))
        for name in ("planned", "draft_forced") + (() if self.row_exact is None else ("row_exact",)):
            if not isinstance(getattr(self, name), bool):
                raise SettingError(name, f"must be True or False, got {getattr(self, name)!r}")
        object.__setattr__(self, "prefill_chunk", whole_number(self.prefill_chunk, "prefill_chunk", 0))
        cache = finite_number(self.prefix_cache_mb, "prefix_cache_mb")
        if cache < 0:
            raise SettingError("prefix_cache_mb", f"must be >= 0 (0: off), got {cache:g}")
        if cache and self.backend != "ort":
            raise SettingError("prefix_cache_mb", f"needs the onnxruntime CPU backend (ort), not {self.backend!r}: "
                                                  "its copies are host arrays; set it to 0")
        object.__setattr__(self, "prefix_cache_mb", cache)
        if self.acceptance == "lossless":
            if self.threshold is not None:
                raise SettingError("threshold", "has no effect with lossless acceptance (it takes no threshold)")
        else:
            threshold = DEFAULT_THRESHOLD if self.threshold is None else finite_number(self.threshold, "threshold")
            if not 0.0 < threshold <= 1.0:
                raise SettingError("threshold", f"must be in (0, 1], got {threshold}")
            object.__setattr__(self, "threshold", threshold)

    def uses_prefill_graph(self, manifest) -> bool:
        """Whether a runtime decoding `manifest`'s export with these options runs its prompt
        forwards on the export's prefill graph (prefill_graph "auto", the manifest has one, the
        backend is "ort": the only one measured; TensorRT engines are built from target.onnx)."""
        return self.prefill_graph == "auto" and manifest.prefill is not None and self.backend == "ort"

    @property
    def threshold_or_zero(self) -> float:
        """The acceptance threshold the Decoder takes (0.0 under lossless acceptance)."""
        return self.threshold if self.threshold is not None else 0.0

    def replace(self, **changes) -> "RuntimeOptions":
        """A copy with `changes` (option names); TypeError for a name that is no option."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise TypeError(f"unknown runtime option{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)} "
                            f"(RuntimeOptions has {', '.join(f.name for f in dataclasses.fields(self))})")
        return dataclasses.replace(self, **changes)

    @classmethod
    def of(cls, options: "RuntimeOptions | None" = None, **changes) -> "RuntimeOptions":
        """`options` (default: RuntimeOptions()) with `changes`: what every loader does with its
        `options` argument and its keyword overrides."""
        if options is not None and not isinstance(options, RuntimeOptions):
            raise TypeError(f"options must be a RuntimeOptions, got {type(options).__name__}")
        return (options or cls()).replace(**changes) if changes else (options or cls())

    @classmethod
    def from_args(cls, args, tree: TreeConfig | None = None, **changes) -> "RuntimeOptions":
        """The options of `common.cli_args.add_runtime_args`' flags (eagle-run, eagle-serve):
        --backend, --threads, --drafter, --always-draft, --acceptance, --threshold, --verify,
        --prefill-graph, and the command's --prefix-cache-mb where it has one;
        `tree` (the tree flags resolved against the manifest) and `changes` on top. Raises
        SettingError; `cli_message` words it with the flag."""
        drafter = getattr(args, "drafter", None) or DEFAULT_DRAFTER
        for name in ("prefix_cache_mb", "prefill_graph"):  # flags some commands lack: the default then
            if getattr(args, name, None) is not None:
                changes.setdefault(name, getattr(args, name))
        return cls(backend=args.backend, tree=tree, threads=args.threads, drafter_kind=drafter,
                   planned=not args.always_draft, acceptance=args.acceptance, threshold=args.threshold,
                   verify=args.verify, **changes)


def _one_of(name: str, value, choices) -> None:
    if value not in choices:
        raise SettingError(name, f"must be one of {', '.join(choices)}, got {value!r}")
