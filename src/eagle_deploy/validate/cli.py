"""`eagle-validate`: compare every exported graph with the PyTorch reference through
Polygraphy's Comparator.

The reference is the exporter's own torch modules (`ExportableTarget`, `ExportableDraft`) on
the checkpoint and head named in the manifest, wrapped in a Polygraphy runner; it runs
against `OnnxrtRunner(SessionFromOnnx(graph))` (and a TensorRT runner when TensorRT is
importable and the manifest lists engines) on realistic feeds (bench/feeds.py):
prefill, decode, tree verification with a past; draft extension and tree-masked expansions.

Tolerances (per output; "rel" = max |err| / max |reference|):
  float32: elementwise |err| <= atol or |err| <= rtol * |ref| (Polygraphy's rule), atol 1e-4,
           rtol 1e-5; the same argmax of logits / top-1 draft ids, except where the
           reference's own top-2 gap is <= 1e-3 (a tie rounding may break either way).
  float16: rel <= 2e-2 and the same argmax (ties <= 5e-2 excepted); bfloat16: rel <= 5e-2.
  int4/int8 target (manifest target.quant): the same top-1 on >= 99% of positions; the
           logit error is reported, features and KV are reported only.
Exit status: 0 all pass, 1 a mismatch (the table says where), 2 the check could not run.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from eagle_deploy.contract import onnx_io as c

REFERENCE = "torch-reference"


@dataclass(frozen=True)
class Policy:
    """How one graph's outputs are judged (see the module docstring)."""

    kind: str  # "elementwise" | "relative" | "top1"
    atol: float = 1e-4
    rtol: float = 1e-5
    rel: float = 2e-2
    min_top1: float = 0.99
    tie: float = 1e-3  # an argmax (top-1 id) may differ where the reference's top-2 gap is <= this

    def describe(self) -> str:
        if self.kind == "elementwise":
            return f"elementwise atol {self.atol:g} / rtol {self.rtol:g}, identical argmax (ties <= {self.tie:g} excepted)"
        if self.kind == "relative":
            return f"max|err|/max|ref| <= {self.rel:g}, identical argmax (ties <= {self.tie:g} excepted)"
        return f"top-1 agreement >= {self.min_top1:.0%} on logits (other outputs reported only)"

    def cli_flags(self) -> str:
        """Polygraphy CLI tolerances for a hand check (elementwise; see the caveat printed with them)."""
        if self.kind == "relative":
            return f"--atol {self.rel:g} --rtol {self.rel:g}"
        return f"--atol {self.atol:g} --rtol {self.rtol:g}"


def policy_for(graph) -> Policy:
    if graph.quant:
        return Policy("top1")
    return {"float32": Policy("elementwise"), "float16": Policy("relative", rel=2e-2, tie=5e-2),
            "bfloat16": Policy("relative", rel=5e-2, tie=2e-1)}.get(graph.dtype, Policy("relative", tie=5e-2))


@dataclass
class Row:
    """One compared output of one feed."""

    graph: str
    runner: str
    feed: str
    output: str
    max_abs: float
    max_rel: float
    argmax: float | None  # fraction of positions whose argmax (top-1 id) agrees
    passed: bool
    note: str = ""


def _ties(ref: np.ndarray, tol: float) -> np.ndarray:
    """[positions] bool: the reference's top-2 along the last axis are within tol."""
    top2 = np.sort(ref.reshape(-1, ref.shape[-1]), axis=-1)[:, -2:]
    return (top2[:, 1] - top2[:, 0]) <= tol


def compare_output(name: str, ref: np.ndarray, out: np.ndarray, policy: Policy, ref_all: dict) -> tuple:
    """(max_abs, max_rel, argmax agreement or None, passed, note) for one output."""
    if ref.shape != out.shape:
        return float("nan"), float("nan"), None, False, f"shape {out.shape} != reference {ref.shape}"
    if name == c.TOPK_IDS:
        same = (ref == out).reshape(-1, ref.shape[-1])
        lp = ref_all[c.TOPK_LOGPROBS].reshape(-1, ref.shape[-1]).astype(np.float64)
        gap = np.minimum(np.abs(np.diff(lp, axis=1, prepend=np.inf)), np.abs(np.diff(lp, axis=1, append=-np.inf)))
        excused = gap <= policy.tie
        ok = bool(np.all(same | excused))
        return float((~same).sum()), 0.0, float(same[:, 0].mean()), ok, "" if same.all() else "ids differ only at near-ties" if ok else "ids differ"
    ref64, out64 = ref.astype(np.float64), out.astype(np.float64)
    err = np.abs(out64 - ref64)
    max_abs = float(err.max()) if err.size else 0.0
    scale = float(np.abs(ref64).max()) if ref64.size else 0.0
    max_rel = max_abs / scale if scale > 0 else max_abs
    agree, argmax_ok = None, True
    if name in (c.LOGITS, c.TOPK_LOGPROBS) and ref.size:
        hit = (ref64.reshape(-1, ref.shape[-1]).argmax(-1) == out64.reshape(-1, out.shape[-1]).argmax(-1))
        agree = float(hit.mean())
        argmax_ok = bool(np.all(hit | _ties(ref64, policy.tie)))
    if policy.kind == "top1":
        if name == c.LOGITS:
            return max_abs, max_rel, agree, agree is not None and agree >= policy.min_top1, "quantised: top-1 checked"
        return max_abs, max_rel, agree, True, "quantised: reported only"
    if policy.kind == "elementwise":
        bad = (err > policy.atol) & (err > policy.rtol * np.abs(ref64))
        return max_abs, max_rel, agree, bool(not bad.any() and argmax_ok), f"{int(bad.sum())} elements out of tolerance" if bad.any() else ""
    return max_abs, max_rel, agree, bool(max_rel <= policy.rel and argmax_ok), ""


class EagleCompareFunc:
    """A Polygraphy compare func: (reference IterationResult, runner IterationResult) ->
    OrderedDict[output, bool]; keeps one `Row` per output for the table."""

    def __init__(self, graph: str, labels: list[str], policy: Policy):
        self.graph, self.labels, self.policy = graph, labels, policy
        self.rows: list[Row] = []
        self.calls = 0

    def __call__(self, ref_iter, run_iter) -> OrderedDict:
        label = self.labels[self.calls % len(self.labels)]
        self.calls += 1
        ref = {k: _np(v) for k, v in ref_iter.items()}
        verdicts = OrderedDict()
        for name, r in ref.items():
            if name not in run_iter:
                self.rows.append(Row(self.graph, run_iter.runner_name, label, name, float("nan"), float("nan"), None, False, "missing"))
                verdicts[name] = False
                continue
            max_abs, max_rel, agree, ok, note = compare_output(name, r, _np(run_iter[name]), self.policy, ref)
            self.rows.append(Row(self.graph, run_iter.runner_name, label, name, max_abs, max_rel, agree, ok, note))
            verdicts[name] = ok
        return verdicts


def _np(value) -> np.ndarray:
    return value.detach().cpu().numpy() if hasattr(value, "detach") else np.asarray(value)


def torch_runner(backend, graph, name: str = REFERENCE):
    """A Polygraphy runner over a TorchBackend (the exporter's torch module, fp32)."""
    from polygraphy.backend.base import BaseRunner
    from polygraphy.common import TensorMetadata
    from polygraphy.datatype import DataType

    from eagle_deploy.bench.feeds import reference_forward

    class TorchRunner(BaseRunner):
        def __init__(self):
            super().__init__(name=name, prefix="torch-runner")

        def activate_impl(self):
            self.forward = reference_forward(backend)

        def get_input_metadata_impl(self):
            meta = TensorMetadata()
            for spec in graph.inputs:
                meta.add(spec["name"], dtype=DataType.from_dtype(np.dtype(spec["dtype"])),
                         shape=[d if isinstance(d, int) else None for d in spec["shape"]])
            return meta

        def infer_impl(self, feed_dict):
            t0 = time.perf_counter()
            outs, presents = self.forward({k: _np(v) for k, v in feed_dict.items()})
            result = OrderedDict(outs)
            result.update(zip([q for _, q in backend.kv_names], presents))
            self.inference_time = time.perf_counter() - t0  # Comparator.run sums it (must be set)
            return result

        def deactivate_impl(self):
            del self.forward

    return TorchRunner()


def graph_runners(folder: Path, manifest, which: str) -> tuple[list, list[str]]:
    """([OnnxrtRunner, (TrtRunner)], notes) for graph `which` of the export."""
    import importlib.util

    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx

    graph = getattr(manifest, which)
    runners = [OnnxrtRunner(SessionFromOnnx(str(folder / graph.path)), name="onnxrt")]
    notes = []
    record = (manifest.engines or {}).get("trt") or {}
    if which in record.get("files", {}):
        if importlib.util.find_spec("tensorrt") is None:
            notes.append(f"{which}: TensorRT engine listed but tensorrt is not importable: not compared")
        else:
            runners.append(_trt_runner(folder / record["files"][which], record.get("profiles", {}).get(which, [])))
    return runners, notes


def _trt_runner(engine_path: Path, profiles: list[dict]):
    """Polygraphy's TrtRunner, switching to the first optimization profile that fits each feed."""
    from polygraphy.backend.common import BytesFromPath
    from polygraphy.backend.trt import EngineFromBytes, TrtRunner

    def fits(shapes: dict, feed: dict) -> bool:
        return all(all(lo <= d <= hi for lo, d, hi in zip(mom[0], feed[n].shape, mom[2])) for n, mom in shapes.items() if n in feed)

    class ProfileTrtRunner(TrtRunner):
        def infer_impl(self, feed_dict, *args, **kwargs):
            index = next((i for i, p in enumerate(profiles) if fits(p["shapes"], feed_dict)), 0)
            self.set_profile(index)
            return super().infer_impl(feed_dict, *args, **kwargs)

    return ProfileTrtRunner(EngineFromBytes(BytesFromPath(str(engine_path))), name="trt")


def validate_graph(folder: Path, manifest, which: str, reference, feeds, work: Path) -> tuple[list[Row], list[str], str]:
    """Run the reference and the graph's runners on `feeds`; returns (rows, notes, the
    equivalent polygraphy command line). Saves inputs and reference outputs under `work`."""
    from polygraphy.comparator import Comparator, RunResults
    from polygraphy.json import save_json

    graph = getattr(manifest, which)
    policy = policy_for(graph)
    runners, notes = graph_runners(folder, manifest, which)
    inputs_path, ref_path = work / f"{which}_inputs.json", work / f"{which}_reference_outputs.json"
    save_json([f.inputs for f in feeds], str(inputs_path))
    results = Comparator.run([torch_runner(reference, graph)] + runners, data_loader=[f.inputs for f in feeds])
    ref_only = RunResults()
    ref_only.append((REFERENCE, results[REFERENCE]))
    ref_only.save(str(ref_path))
    rows = []
    for i in range(1, len(runners) + 1):
        func = EagleCompareFunc(which, [f.label for f in feeds], policy)
        Comparator.compare_accuracy(results, comparisons=[(0, i)], compare_func=func)
        rows += func.rows
    command = (f"polygraphy run {folder.resolve() / graph.path} --onnxrt --load-inputs {inputs_path.resolve()} "
               f"--load-outputs {ref_path.resolve()} {policy.cli_flags()} "
               f"--save-outputs {(work / f'{which}_onnxrt_outputs.json').resolve()}")
    return rows, notes, command


def collapse(rows: list[Row]) -> list[Row]:
    """One row for all `present.*` KV outputs of a feed (the worst of them)."""
    out, kv = [], OrderedDict()
    for r in rows:
        if r.output.startswith("present."):
            key = (r.graph, r.runner, r.feed)
            kv.setdefault(key, []).append(r)
            if len(kv[key]) == 1:
                out.append(key)
        else:
            out.append(r)
    result = []
    for item in out:
        if isinstance(item, Row):
            result.append(item)
            continue
        group = kv[item]
        result.append(Row(*item, f"present.* ({len(group)})", max(g.max_abs for g in group), max(g.max_rel for g in group),
                          None, all(g.passed for g in group), "; ".join(sorted({g.note for g in group if g.note}))))
    return result


def format_table(rows: list[Row]) -> str:
    head = ("graph", "runner", "feed", "output", "max abs err", "max rel err", "argmax agree", "result")
    body = [(r.graph, r.runner, r.feed, r.output, f"{r.max_abs:.3g}", f"{r.max_rel:.3g}",
             "-" if r.argmax is None else f"{r.argmax:.1%}", ("pass" if r.passed else "FAIL") + (f" ({r.note})" if r.note else ""))
            for r in rows]
    widths = [max(len(str(x[i])) for x in [head] + body) for i in range(len(head))]
    line = lambda cells: "  ".join(str(v).ljust(w) for v, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(b) for b in body])


def run_validation(folder: Path, work: Path | None = None, graphs=("target", "draft"), log=print) -> dict:
    """Validate an export folder; returns {"passed", "rows", "notes", "commands", ...}."""
    import torch
    from polygraphy.logger import G_LOGGER

    from eagle_deploy.bench import feeds as fd
    from eagle_deploy.contract.manifest import Manifest

    from .reference import load_reference_head, load_reference_target, reference_backends

    G_LOGGER.module_severity = G_LOGGER.CRITICAL  # the table reports; Polygraphy's own failures still raise
    folder = Path(folder)
    manifest = Manifest.load(folder)
    work = Path(work) if work else folder / "validate"
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with torch.no_grad():
        hf = load_reference_target(manifest)
        head, head_note = load_reference_head(manifest, hf)
    refs = reference_backends(manifest, hf, head, folder)
    log(f"reference loaded in {time.perf_counter() - t0:.1f}s ({head_note})")
    tokenizer = None
    if manifest.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(folder / manifest.tokenizer))
    prompt = fd.prompt_ids(tokenizer, min(24, manifest.max_length - 16), manifest.dims["vocab"], manifest.chat_template)
    dtype = np.dtype(manifest.target.dtype) if manifest.target.dtype != "bfloat16" else None
    if dtype is None:
        raise ValueError("bfloat16 exports cannot be fed from numpy; validate them with --backend trt tooling")
    target_feeds, state = fd.target_feeds(fd.reference_forward(refs["target"]), prompt, manifest.dims, dtype)
    feeds = {"target": target_feeds,
             "draft": fd.draft_feeds(fd.reference_forward(refs["draft"]), prompt, state, np.dtype(manifest.draft.dtype))}
    report = {"engines": str(folder), "passed": True, "rows": [], "notes": [head_note], "commands": {}, "policies": {}}
    for which in graphs:
        t1 = time.perf_counter()
        rows, notes, command = validate_graph(folder, manifest, which, refs[which], feeds[which], work)
        report["rows"] += [asdict(r) for r in rows]
        report["notes"] += notes
        report["commands"][which] = command
        report["policies"][which] = policy_for(getattr(manifest, which)).describe()
        report["passed"] &= all(r.passed for r in rows)
        log(f"{which}: {len(feeds[which])} feeds compared in {time.perf_counter() - t1:.1f}s ({report['policies'][which]})")
    report["seconds"] = round(time.perf_counter() - t0, 1)
    return report


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="eagle-validate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", type=Path, required=True, help="export folder written by eagle-export")
    p.add_argument("--work", type=Path, default=None, help="where feeds and reference outputs are saved (default ENGINES/validate)")
    p.add_argument("--graphs", default="target,draft", help="comma-separated: target, draft")
    p.add_argument("--all-outputs", action="store_true", help="one table row per KV output instead of one per feed")
    p.add_argument("--json", type=Path, default=None, help="also write the full report here")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from eagle_deploy.contract.manifest import ManifestError

    from .reference import ReferenceError

    graphs = [g.strip() for g in args.graphs.split(",") if g.strip()]
    if not graphs or any(g not in ("target", "draft") for g in graphs):
        print(f"eagle-validate: error: --graphs takes target and/or draft, got {args.graphs!r}", file=sys.stderr)
        return 2
    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    try:
        report = run_validation(args.engines, args.work, graphs, log=say)
    except (ManifestError, ReferenceError, FileNotFoundError, ValueError, ImportError) as err:
        print(f"eagle-validate: error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # PolygraphyException (e.g. a runner that cannot load the graph), onnxruntime errors
        if type(err).__module__.split(".")[0] not in ("polygraphy", "onnxruntime"):
            raise
        print(f"eagle-validate: error: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
    rows = [Row(**r) for r in report["rows"]]
    print(format_table(rows if args.all_outputs else collapse(rows)))
    for note in report["notes"]:
        print(f"note: {note}")
    for which, policy in report["policies"].items():
        print(f"{which} tolerance: {policy}")
    print("repeat a check by hand (onnxruntime vs the saved reference outputs; Polygraphy's rule is elementwise, "
          "so fp16 and quantised graphs may fail it where the rules above pass):")
    for which, command in report["commands"].items():
        print(f"  {command}")
    failed = [r for r in rows if not r.passed]
    print(f"{'PASSED' if report['passed'] else 'FAILED'}: {len(rows) - len(failed)}/{len(rows)} outputs within tolerance "
          f"({report['seconds']}s)")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=float) + "\n")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
