"""TensorRT engines from an export folder: `build_engines(folder)`.

Each graph goes through Polygraphy's loaders, strongly typed on TensorRT 10 and 11 alike:

    NetworkFromOnnxPath(abs path, strongly_typed=True)  -> (builder, network, parser)
    CreateConfig(profiles, load_timing_cache)            -> IBuilderConfig (no fp16/bf16/int8 flags:
                                                            precision is the ONNX graph's own types)
    EngineBytesFromNetwork(save_timing_cache)            -> serialized engine
    SaveBytes                                            -> <folder>/target.engine, draft.engine

Optimization profiles come from the manifest (`target_profiles`, `draft_profiles`; pure
Python, no TensorRT needed) and land in `manifest.engines.trt` (a TrtRecord) with the engine files, the
TensorRT version and the timing cache (`trt_timing.cache`, beside the engines).

TensorRT checks every profile's min, opt and max shapes against the network's shape
constraints, so each of the three is self-consistent: `total_seq = past_seq + seq` and
past rows reach `max_length - 1` so that a one-token step at the end of the cache fits.

    python -m eagle_deploy.exporter.trt_build engines/smollm2-135m   # (re)build engines
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from eagle_deploy.common.cli_args import cli_error
from eagle_deploy.contract.errors import import_tensorrt
from eagle_deploy.contract.manifest import Dims, GraphEntry, Manifest, TrtRecord
from eagle_deploy.contract.onnx_io import KV_SEQ_MAJOR
from eagle_deploy.contract.profiles import ProfileSpec  # noqa: F401  (re-exported: profiles live in the contract)

from .external_data import graph_tensors

ENGINE_FILES = {"target": "target.engine", "draft": "draft.engine"}
TIMING_CACHE_FILE = "trt_timing.cache"
DEFAULT_MAX_TREE_TOKENS = 64  # EAGLE-2's default tree has 60 tokens; bigger trees need a rebuild
PREFILL_OPT_SEQ = 128

Range = tuple[int, int, int]  # (min, opt, max) of one symbolic dimension
Shape = tuple[int, ...]


class ExternalDataError(FileNotFoundError):
    """An .onnx graph's external weight file is missing or shorter than the graph says."""


class EngineBuildError(RuntimeError):
    """TensorRT (through Polygraphy) failed to parse or build a graph."""


@dataclass
class TrtBuildOptions:
    """max_tree_tokens: verification profile max seq (default max(manifest tree, 64)).
    max_prompt: prefill profile max seq (default max_length - 1).
    max_draft_scratch: draft KV rows past max_length for tree expansion (default
    max(manifest tree's need, max_tree_tokens)). decode_profile: a seq-1 profile for
    vanilla decoding. workspace_bytes / optimization_level: builder knobs (None = TRT default)."""

    max_tree_tokens: int | None = None
    max_prompt: int | None = None
    max_draft_scratch: int | None = None
    decode_profile: bool = True
    workspace_bytes: int | None = None
    optimization_level: int | None = None
    graphs: tuple[str, ...] = ("target", "draft")


# ---------------------------------------------------------------------------------------------
# Profiles (pure Python)


def _dim_range(dim, ranges: dict[str, Range], fixed: dict[str, int]) -> Range:
    if isinstance(dim, int):
        return (dim, dim, dim)
    if dim == "total_seq":
        past, seq = ranges["past_seq"], ranges["seq"]
        return tuple(p + s for p, s in zip(past, seq))  # type: ignore[return-value]
    if dim in ranges:
        return ranges[dim]
    if dim in fixed:
        return (fixed[dim],) * 3  # type: ignore[return-value]
    raise ValueError(f"input dimension {dim!r} has no profile range")


def profile_shapes(graph: GraphEntry, ranges: dict[str, Range], dims: Dims) -> dict[str, tuple[Shape, Shape, Shape]]:
    """{input name: (min, opt, max)} for every input of `graph` from ranges of the symbolic
    dims `seq`, `past_seq`, `num_logits` (`total_seq` derived; batch 1; model dims fixed: the
    graph's own, Manifest.graph_dims) and, for an EAGLE-3 draft, `tapped_rows` / `own_rows`
    (each 0..seq: an extension sends only tapped rows, an expansion only own rows)."""
    for sym, (lo, opt, hi) in ranges.items():
        if not 0 <= lo <= opt <= hi:
            raise ValueError(f"profile range of {sym} must satisfy 0 <= min <= opt <= max, got {(lo, opt, hi)}")
    fixed = {"batch": 1, "hidden": dims.hidden, "kv_heads": dims.num_kv_heads, "head_dim": dims.head_dim}
    out = {}
    for spec in graph.inputs:
        per_dim = [_dim_range(d, ranges, fixed) for d in spec.shape]
        out[spec.name] = tuple(tuple(r[i] for r in per_dim) for i in range(3))
    return out


def _max_tree(manifest: Manifest, options: TrtBuildOptions) -> tuple[int, int]:
    """(opt, max) verification tokens; raises if the manifest's own tree does not fit."""
    tree_tokens = manifest.tree.total_tokens
    T = options.max_tree_tokens or max(tree_tokens, DEFAULT_MAX_TREE_TOKENS)
    T = min(T, manifest.max_length - 1)
    if tree_tokens > T:
        raise ValueError(f"the export's tree has total_tokens={tree_tokens} but the engine is capped at "
                         f"max_tree_tokens={T}; raise --max-tree-tokens (or shrink the tree)")
    return min(tree_tokens, T), T


def _max_prompt(manifest: Manifest, options: TrtBuildOptions) -> int:
    L = manifest.max_length
    Lp = options.max_prompt or L - 1
    if not 1 <= Lp <= L - 1:
        raise ValueError(f"max_prompt {Lp} must be in [1, {L - 1}] (max_length - 1)")
    return Lp


def target_profiles(manifest: Manifest, options: TrtBuildOptions | None = None) -> list[ProfileSpec]:
    """Profiles of the target engine: "prefill" (seq 1..max_prompt at past 0), "decode" (seq 1,
    past up to max_length - 1), "verify" (seq 1..max_tree_tokens, past up to max_length - 1)."""
    options = options or TrtBuildOptions()
    L = manifest.max_length
    Lp = _max_prompt(manifest, options)
    T_opt, T = _max_tree(manifest, options)
    p_opt = min(PREFILL_OPT_SEQ, Lp)
    g, d = manifest.target, manifest.dims
    specs = [("prefill", {"seq": (1, p_opt, Lp), "past_seq": (0, 0, L - Lp), "num_logits": (1, 1, Lp)})]
    if options.decode_profile:
        specs.append(("decode", {"seq": (1, 1, 1), "past_seq": (0, L // 2, L - 1), "num_logits": (1, 1, 1)}))
    specs.append(("verify", {"seq": (1, T_opt, T), "past_seq": (0, L // 2, L - 1), "num_logits": (1, T_opt, T)}))
    return [ProfileSpec(name, profile_shapes(g, ranges, d)) for name, ranges in specs]


def draft_capacity(manifest: Manifest, options: TrtBuildOptions | None = None) -> int:
    """KV rows the draft engine supports: max_length + scratch rows for tree expansion."""
    options = options or TrtBuildOptions()
    need = manifest.tree.max_draft_inputs()
    scratch = options.max_draft_scratch or max(need, _max_tree(manifest, options)[1])
    if scratch < need:
        raise ValueError(f"max_draft_scratch {scratch} is below the export tree's {need} draft rows per round")
    return manifest.max_length + scratch


def draft_profiles(manifest: Manifest, options: TrtBuildOptions | None = None) -> list[ProfileSpec]:
    """Profiles of the draft engine: "prefill" (the first extension feeds every prompt
    feature: seq 1..max_prompt at past 0) and "step" (extensions and tree expansions: seq
    1..max(max_tree_tokens, graph_top_k), past up to the draft KV capacity - 1). An EAGLE-3
    draft: "prefill" and "extend" (extensions: seq 1..S, any past) feed only target taps, "step"
    (expansions) only the head's own features."""
    options = options or TrtBuildOptions()
    L = manifest.max_length
    Lp = _max_prompt(manifest, options)
    _, T = _max_tree(manifest, options)
    tree = manifest.tree
    top_k = manifest.draft.graph_top_k
    S = max(T, top_k)
    s_opt = min(max(tree.top_k, 1), S)
    C = draft_capacity(manifest, options)
    p_opt = min(PREFILL_OPT_SEQ, Lp)
    g, d = manifest.draft, manifest.graph_dims("draft")
    specs = [("prefill", {"seq": (1, p_opt, Lp), "past_seq": (0, 0, C - Lp), "num_logits": (1, 1, Lp)}),
             ("step", {"seq": (1, s_opt, S), "past_seq": (0, L // 2, C - 1), "num_logits": (1, s_opt, S)})]
    if g.head_kind == "eagle3":
        # each call's rows are all target taps (prefill, extension) or all the head's own
        # features (expansion), and min / opt / max must each be a valid network shape
        # (tapped_rows + own_rows = seq), so each profile ties one of them to seq, the other 0
        none = (0, 0, 0)
        specs[0][1].update(tapped_rows=specs[0][1]["seq"], own_rows=none)
        specs[1][1].update(tapped_rows=none, own_rows=specs[1][1]["seq"])
        extend = {"seq": (1, min(tree.depth + 1, S), S), "past_seq": (0, L // 2, C - 1),
                  "num_logits": (1, 1, S)}
        specs.insert(1, ("extend", {**extend, "tapped_rows": extend["seq"], "own_rows": none}))
    return [ProfileSpec(name, profile_shapes(g, ranges, d)) for name, ranges in specs]


def compute_profiles(manifest: Manifest, which: str, options: TrtBuildOptions | None = None) -> list[ProfileSpec]:
    """Profiles of graph `which` ("target" or "draft")."""
    if which == "target":
        return target_profiles(manifest, options)
    if which == "draft":
        return draft_profiles(manifest, options)
    raise ValueError(f"unknown graph {which!r}; expected 'target' or 'draft'")


# ---------------------------------------------------------------------------------------------
# External data (paths of the external data files)


def check_external_data(onnx_path: Path) -> list[Path]:
    """Return the external data files `onnx_path` needs; raise ExternalDataError naming every
    missing one (a graph moved without its `.data` file or the export's shared.data) or a
    truncated one."""
    import onnx
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    onnx_path = Path(onnx_path).resolve()
    if not onnx_path.is_file():
        raise FileNotFoundError(f"graph {onnx_path} does not exist")
    model = onnx.load(str(onnx_path), load_external_data=False)
    need: dict[str, int] = {}
    for tensor in graph_tensors(model):
        if uses_external_data(tensor):
            info = ExternalDataInfo(tensor)
            end = int(info.offset or 0) + int(info.length or 0)
            need[info.location] = max(need.get(info.location, 0), end)
    missing = [location for location in need if not (onnx_path.parent / location).is_file()]
    if missing:
        names = ", ".join(repr(m) for m in missing)
        paths = ", ".join(str(onnx_path.parent / m) for m in missing)
        raise ExternalDataError(f"{onnx_path.name} keeps its weights in external data file(s) {names}, missing: "
                                f"expected {paths}. Move or copy the .onnx together with its data files.")
    files = []
    for location, end in need.items():
        path = onnx_path.parent / location
        if path.stat().st_size < end:
            raise ExternalDataError(f"external data file {path} is truncated: {path.stat().st_size} bytes, "
                                    f"{onnx_path.name} needs at least {end}")
        files.append(path)
    return files


# ---------------------------------------------------------------------------------------------
# Build


def _polygraphy_loaders() -> SimpleNamespace:
    """The Polygraphy loaders and the TensorRT module (one seam that tests replace)."""
    trt = import_tensorrt("to build TensorRT engines")
    from polygraphy.backend.common import SaveBytes
    from polygraphy.backend.trt import CreateConfig, EngineBytesFromNetwork, NetworkFromOnnxPath, Profile

    return SimpleNamespace(trt=trt, NetworkFromOnnxPath=NetworkFromOnnxPath, CreateConfig=CreateConfig,
                           Profile=Profile, EngineBytesFromNetwork=EngineBytesFromNetwork, SaveBytes=SaveBytes)


def build_config(pg: SimpleNamespace, profiles: list[ProfileSpec], timing_cache: Path, options: TrtBuildOptions):
    """A CreateConfig for a strongly typed network: profiles and timing cache only. No
    precision flags (TRT 10 rejects them on strongly typed networks; TRT 11 removed them)."""
    trt_profiles = []
    for spec in profiles:
        prof = pg.Profile()
        for name, (lo, opt, hi) in spec.shapes.items():
            prof.add(name, min=list(lo), opt=list(opt), max=list(hi))
        trt_profiles.append(prof)
    kwargs = {"profiles": trt_profiles, "load_timing_cache": str(timing_cache)}
    if options.workspace_bytes:
        kwargs["memory_pool_limits"] = {pg.trt.MemoryPoolType.WORKSPACE: int(options.workspace_bytes)}
    if options.optimization_level is not None:
        kwargs["builder_optimization_level"] = int(options.optimization_level)
    return pg.CreateConfig(**kwargs)


def build_engine(pg: SimpleNamespace, onnx_path: Path, engine_path: Path, profiles: list[ProfileSpec],
                 timing_cache: Path, options: TrtBuildOptions) -> Path:
    """One graph -> one serialized engine file (written to a temporary name, then renamed)."""
    onnx_path, engine_path, timing_cache = (Path(p).resolve() for p in (onnx_path, engine_path, timing_cache))
    network = pg.NetworkFromOnnxPath(str(onnx_path), strongly_typed=True)
    config = build_config(pg, profiles, timing_cache, options)
    engine_bytes = pg.EngineBytesFromNetwork(network, config=config, save_timing_cache=str(timing_cache))
    tmp = engine_path.with_name(engine_path.name + ".partial")
    try:
        with contextlib.redirect_stdout(sys.stderr):  # Polygraphy logs to stdout; eagle-export prints the folder there
            pg.SaveBytes(engine_bytes, path=str(tmp))()
    except Exception as err:  # PolygraphyException, TensorRT errors: the log above says why
        tmp.unlink(missing_ok=True)
        raise EngineBuildError(f"TensorRT could not build {onnx_path.name}: {err} "
                               "(see the TensorRT log above)") from err
    tmp.replace(engine_path)
    return engine_path


def _say(progress, msg: str) -> None:
    if progress:
        progress(msg)


def build_engines(export_folder, progress=None, options: TrtBuildOptions | None = None) -> TrtRecord:
    """Build TensorRT engines for the graphs of `export_folder` and record them in its
    manifest (`engines.trt`); returns that record. Works from any working directory
    (all paths are made absolute). Raises ExternalDataError / FileNotFoundError before any
    TensorRT import when a graph or its external data is missing, ImportError without
    TensorRT, ValueError on profile settings the export's tree does not fit or on a fused or
    MatMulNBits-quantised (onnxruntime contrib operator) graph, EngineBuildError
    when TensorRT fails to parse or build a graph."""
    options = options or TrtBuildOptions()
    folder = Path(export_folder).expanduser().resolve()
    manifest = Manifest.load(folder)
    graphs = {which: getattr(manifest, which) for which in options.graphs}
    fused = [g.path for g in graphs.values() if g.kv_layout != KV_SEQ_MAJOR]
    if fused:
        raise ValueError(f"{', '.join(fused)} in {folder} use onnxruntime's fused contrib operators, which TensorRT "
                         "cannot run: re-export with --backend trt (or --graph standard)")
    nbits = [g.path for g in graphs.values() if g.quant_info is not None and g.quant_info.method == "nbits"]
    if nbits:
        raise ValueError(f"{', '.join(nbits)} in {folder} hold onnxruntime's quantised MatMulNBits operator, which "
                         "TensorRT cannot run: re-export without --quant / --draft-quant (or with --draft-quant none)")
    for which, graph in graphs.items():
        check_external_data(folder / graph.path)
    profiles = {which: compute_profiles(manifest, which, options) for which in graphs}
    _check_profiles_fit_tree(manifest, profiles)
    pg = _polygraphy_loaders()
    timing_cache = folder / TIMING_CACHE_FILE
    files = {}
    for which, graph in graphs.items():
        _say(progress, f"building TensorRT engine for {graph.path} ({len(profiles[which])} profiles: "
                       f"{', '.join(p.name for p in profiles[which])}); this takes minutes")
        t0 = time.perf_counter()
        build_engine(pg, folder / graph.path, folder / ENGINE_FILES[which], profiles[which], timing_cache, options)
        files[which] = ENGINE_FILES[which]
        _say(progress, f"built {ENGINE_FILES[which]} in {time.perf_counter() - t0:.0f}s")
    record = TrtRecord(files=files, profiles={w: tuple(ps) for w, ps in profiles.items()},
                       trt_version=str(getattr(pg.trt, "__version__", "unknown")), timing_cache=TIMING_CACHE_FILE,
                       strongly_typed=True, max_length=manifest.max_length,
                       draft_capacity=draft_capacity(manifest, options) if "draft" in graphs else None,
                       onnx_sha256={w: g.sha256 for w, g in graphs.items()}, device=_device_name())
    manifest.replace(engines=manifest.engines.replace(trt=record)).save(folder)
    return record


def _check_profiles_fit_tree(manifest: Manifest, profiles: dict[str, list[ProfileSpec]]) -> None:
    """Self-check: the export's default tree runs on the profiles about to be built."""
    from eagle_deploy.contract.profiles import check_tree_fits, draft_kv_capacity

    tree = manifest.tree
    for which, specs in profiles.items():
        bounds = [(p.name, p.shapes) for p in specs]
        check_tree_fits(bounds, which, tree, manifest.max_length,
                        draft_capacity=draft_kv_capacity(manifest.max_length, tree), label=f"{which} (to be built)")


def _device_name() -> str | None:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001 - informational only
        return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m eagle_deploy.exporter.trt_build", description=__doc__.split("\n")[0])
    p.add_argument("engines", type=Path, help="an export folder written by eagle-export")
    p.add_argument("--max-tree-tokens", type=int, default=None,
                   help=f"verification profile max (default max(tree, {DEFAULT_MAX_TREE_TOKENS}))")
    p.add_argument("--max-prompt", type=int, default=None, help="prefill profile max (default max_length - 1)")
    p.add_argument("--no-decode-profile", action="store_true", help="skip the seq-1 decode profile")
    p.add_argument("--workspace-gib", type=float, default=None)
    args = p.parse_args(argv)
    options = TrtBuildOptions(max_tree_tokens=args.max_tree_tokens, max_prompt=args.max_prompt,
                              decode_profile=not args.no_decode_profile,
                              workspace_bytes=int(args.workspace_gib * 2**30) if args.workspace_gib else None)
    t0 = time.perf_counter()
    try:
        build_engines(args.engines,
                      progress=lambda m: print(f"[{time.perf_counter() - t0:6.1f}s] {m}", file=sys.stderr),
                      options=options)
    except (FileNotFoundError, ValueError, EngineBuildError) as err:
        return cli_error("trt_build", err)
    except ImportError as err:
        print(f"trt_build: error: {err}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
