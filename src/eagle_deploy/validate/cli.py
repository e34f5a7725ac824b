"""`eagle-validate`: compare every exported graph with the PyTorch reference through
Polygraphy's Comparator.

The reference is the exporter's own torch modules (`ExportableTarget`, `ExportableDraft`) on
the checkpoint and head named in the manifest, wrapped in a Polygraphy runner; it runs
against `OnnxrtRunner(SessionFromOnnx(graph))` (and a TensorRT runner when TensorRT is
importable and the manifest lists engines) on realistic feeds (validate/feeds.py):
prefill, decode, tree verification with a past; draft extension and tree-masked expansions.

Tolerances (per output; "rel" = max |err| / max |reference|):
  float32: elementwise |err| <= atol or |err| <= rtol * |ref| (Polygraphy's rule), atol 1e-4,
           rtol 1e-5; the same argmax of logits / top-1 draft ids, except where the
           reference's own top-2 gap is <= 1e-3 (a tie rounding may break either way).
           Residual-stream outputs (tapped_features, next_features) take rtol relative to
           their row's largest |ref| (massive activations set their fp32 rounding).
  float16: rel <= 2e-2 and the same argmax (ties <= 5e-2 excepted); bfloat16: rel <= 5e-2.
  int4/int8 graphs (manifest quant): the reference gets the graph's own quantised weights
           (read back from its MatMulNBits nodes), so quantisation itself is not counted as
           an error. Two runners: the graph as shipped (int8-rounded activations inside the
           kernel) must give the same top-1 (logits; draft: first top-k id) on >= 99% of the
           positions where the reference's top-2 gap exceeds 0.5, and mean KL <= 0.02 on
           logits; other outputs reported only. The same graph with fp32 activations
           (accuracy_level 0) is held to the float32 rule with atol 5e-4 (its blockwise
           dequantised sums round differently). A quantised weight that matches no
           reference weight fails.
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
from typing import Sequence

import numpy as np

from eagle_deploy.contract import onnx_io as c
from eagle_deploy.contract.cli_args import add_verify_arg, check_output_path, cli_error, interruptible
from eagle_deploy.contract.profiles import ProfileSpec

REFERENCE = "torch-reference"
FP32_ACTIVATIONS = "onnxrt-fp32act"  # a quantised graph with accuracy_level 0: same weights, fp32 activations
# Quantised graphs as shipped vs the reference with their own weights: what is left is the
# kernel's int8 rounding of activations. Measured on SmolLM2-135M int4/int8 (3 target feeds):
# top-1 misses only where the reference's top-2 gap was <= 0.18, mean KL per feed <= 6.5e-3;
# against the fp32 weights instead, int4 flipped the top-1 at gaps up to 1.3 (KL 0.52).
QUANT_TIE, QUANT_MAX_KL = 0.5, 2e-2


@dataclass(frozen=True)
class Policy:
    """How one graph's outputs are judged (see the module docstring)."""

    kind: str  # "elementwise" | "relative" | "top1"
    atol: float = 1e-4
    rtol: float = 1e-5
    rel: float = 2e-2
    min_top1: float = 0.99
    tie: float = 1e-3  # an argmax (top-1 id) may differ where the reference's top-2 gap is <= this
    max_kl: float | None = None  # "top1": bound on the mean KL(reference || graph) of logits

    def describe(self) -> str:
        if self.kind == "elementwise":
            return (f"elementwise atol {self.atol:g} / rtol {self.rtol:g}, "
                    f"identical argmax (ties <= {self.tie:g} excepted)")
        if self.kind == "relative":
            return f"max|err|/max|ref| <= {self.rel:g}, identical argmax (ties <= {self.tie:g} excepted)"
        kl = f", mean KL <= {self.max_kl:g}" if self.max_kl is not None else ""
        return (f"top-1 agreement >= {self.min_top1:.0%} where the reference's top-2 gap > {self.tie:g}{kl} "
                f"(logits / first top-k id; other outputs reported only)")

    def cli_flags(self) -> str:
        """Polygraphy CLI tolerances for a hand check (elementwise; see the caveat printed with them)."""
        if self.kind == "relative":
            return f"--atol {self.rel:g} --rtol {self.rel:g}"
        return f"--atol {self.atol:g} --rtol {self.rtol:g}"


# A quantised graph with fp32 activations: MatMulNBits' fp32 path dequantises and sums each
# K-block apart, in another order than torch's GEMM; measured max |err| 1.2e-4 on SmolLM2-135M
# int4 logits (|logits| ~36) where the plain fp32 graph gave 7.6e-5. atol 5e-4 leaves a 4x
# margin and stays three orders of magnitude below a wrong weight or a misplaced op.
FP32_POLICY = Policy("elementwise", atol=5e-4)


def policy_for(graph) -> Policy:
    if graph.quant:  # against the reference with the graph's own quantised weights (see the module docstring)
        return Policy("top1", tie=QUANT_TIE, max_kl=QUANT_MAX_KL)
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


RESIDUAL_STREAMS = (c.TAPPED_FEATURES, c.NEXT_FEATURES)  # outputs judged relative to their row's largest element


def _ties(ref: np.ndarray, tol: float) -> np.ndarray:
    """[positions] bool: the reference's top-2 along the last axis are within tol."""
    top2 = np.sort(ref.reshape(-1, ref.shape[-1]), axis=-1)[:, -2:]
    return (top2[:, 1] - top2[:, 0]) <= tol


def mean_kl(ref: np.ndarray, out: np.ndarray) -> float:
    """Mean over positions of KL(softmax(ref) || softmax(out)) along the last axis (nats)."""
    r = ref.reshape(-1, ref.shape[-1]).astype(np.float64)
    o = out.reshape(-1, out.shape[-1]).astype(np.float64)
    lr = r - np.logaddexp.reduce(r, axis=-1, keepdims=True)
    lo = o - np.logaddexp.reduce(o, axis=-1, keepdims=True)
    return float((np.exp(lr) * (lr - lo)).sum(-1).mean()) if r.size else 0.0


def compare_output(name: str, ref: np.ndarray, out: np.ndarray, policy: Policy, ref_all: dict) -> tuple:
    """(max_abs, max_rel, argmax agreement or None, passed, note) for one output."""
    if ref.shape != out.shape:
        return float("nan"), float("nan"), None, False, f"shape {out.shape} != reference {ref.shape}"
    if name == c.TOPK_IDS:
        same = (ref == out).reshape(-1, ref.shape[-1])
        lp = ref_all[c.TOPK_LOGPROBS].reshape(-1, ref.shape[-1]).astype(np.float64)
        gap = np.minimum(np.abs(np.diff(lp, axis=1, prepend=np.inf)), np.abs(np.diff(lp, axis=1, append=-np.inf)))
        excused = gap <= policy.tie
        if policy.kind == "top1":  # quantised: the first id is judged as logits' argmax is; the others reported
            judged = ~excused[:, 0]
            top1 = float(same[judged, 0].mean()) if judged.any() else 1.0
            return (float((~same).sum()), 0.0, float(same[:, 0].mean()), top1 >= policy.min_top1,
                    f"quantised: top-1 {top1:.1%} off near-ties")
        ok = bool(np.all(same | excused))
        note = "" if same.all() else "ids differ only at near-ties" if ok else "ids differ"
        return float((~same).sum()), 0.0, float(same[:, 0].mean()), ok, note
    ref64, out64 = ref.astype(np.float64), out.astype(np.float64)
    err = np.abs(out64 - ref64)
    max_abs = float(err.max()) if err.size else 0.0
    scale = float(np.abs(ref64).max()) if ref64.size else 0.0
    max_rel = max_abs / scale if scale > 0 else max_abs
    agree, argmax_ok, hit = None, True, None
    if name in (c.LOGITS, c.TOPK_LOGPROBS) and ref.size:
        hit = (ref64.reshape(-1, ref.shape[-1]).argmax(-1) == out64.reshape(-1, out.shape[-1]).argmax(-1))
        agree = float(hit.mean())
        argmax_ok = bool(np.all(hit | _ties(ref64, policy.tie)))
    if policy.kind == "top1":
        if name == c.LOGITS and hit is not None:
            judged = ~_ties(ref64, policy.tie)
            top1 = float(hit[judged].mean()) if judged.any() else 1.0
            kl = mean_kl(ref64, out64)
            ok = top1 >= policy.min_top1 and (policy.max_kl is None or kl <= policy.max_kl)
            return max_abs, max_rel, agree, ok, f"quantised: top-1 {top1:.1%} off near-ties, mean KL {kl:.2g}"
        return max_abs, max_rel, agree, True, "quantised: reported only"
    if policy.kind == "elementwise":
        # residual streams (EAGLE-3 taps, the draft's pre-norm output) carry massive activations
        # (SmolLM2: |x| ~ 2e4 in a few channels), so their fp32 rounding is set by the row's
        # largest element, not by the element's own size: rtol is taken relative to it
        size = np.abs(ref64).max(axis=-1, keepdims=True) if name in RESIDUAL_STREAMS and ref.size else np.abs(ref64)
        bad = (err > policy.atol) & (err > policy.rtol * size)
        note = f"{int(bad.sum())} elements out of tolerance" if bad.any() else ""
        return max_abs, max_rel, agree, bool(not bad.any() and argmax_ok), note
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
                self.rows.append(Row(self.graph, run_iter.runner_name, label, name, float("nan"), float("nan"), None,
                                     False, "missing"))
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

    from .feeds import reference_forward

    class TorchRunner(BaseRunner):
        def __init__(self):
            super().__init__(name=name, prefix="torch-runner")

        def activate_impl(self):
            self.forward = reference_forward(backend)

        def get_input_metadata_impl(self):
            meta = TensorMetadata()
            for spec in graph.inputs:
                meta.add(spec.name, dtype=DataType.from_dtype(np.dtype(spec.dtype)),
                         shape=[d if isinstance(d, int) else None for d in spec.shape])
            return meta

        def infer_impl(self, feed_dict):
            t0 = time.perf_counter()
            feeds = {k: _np(v) for k, v in feed_dict.items()}
            shared = graph.kv_layout == c.KV_SHARED  # past [1, kvh, P, hd] in, present [1, kvh, P + S, hd] out
            past = {p: feeds[p] for p, _ in backend.kv_names}
            if shared:
                feeds.update({p: a.transpose(2, 0, 1, 3) for p, a in past.items()})
            outs, presents = self.forward(feeds)
            if shared:
                presents = [np.concatenate([past[p], new.transpose(1, 2, 0, 3)], axis=2)
                            for (p, _), new in zip(backend.kv_names, presents)]
            result = OrderedDict(outs)
            result.update(zip([q for _, q in backend.kv_names], presents))
            self.inference_time = time.perf_counter() - t0  # Comparator.run sums it (must be set)
            return result

        def deactivate_impl(self):
            del self.forward

    return TorchRunner()


def graph_runners(folder: Path, manifest, which: str, work: Path | None = None) -> tuple[list, list[str]]:
    """([OnnxrtRunner, (OnnxrtRunner with fp32 activations), (TrtRunner)], notes) for graph
    `which` of the export. A quantised graph's fp32-activation copy is written to `work`
    (`<which>_fp32act.onnx`) when given."""
    import importlib.util

    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx

    graph = getattr(manifest, which)
    runners = [OnnxrtRunner(SessionFromOnnx(str(folder / graph.path)), name="onnxrt")]
    if graph.quant:
        runners.append(OnnxrtRunner(SessionFromOnnx(fp32_activation_graph(folder / graph.path, work, which)),
                                    name=FP32_ACTIVATIONS))
    notes = []
    record = manifest.engines.trt
    if record is not None and which in record.files:
        if importlib.util.find_spec("tensorrt") is None:
            notes.append(f"{which}: TensorRT engine listed but tensorrt is not importable: not compared")
        else:
            runners.append(_trt_runner(folder / record.files[which], record.profiles.get(which, ())))
    return runners, notes


def fp32_activation_graph(path: Path, work: Path | None, which: str):
    """The quantised graph at `path` with fp32 activations (exporter.quantize.with_fp32_activations):
    saved as `work/<which>_fp32act.onnx` (path returned) or, without `work`, serialised bytes."""
    from eagle_deploy.exporter.external_data import load_model
    from eagle_deploy.exporter.quantize import save_graph_in_place, with_fp32_activations

    model = with_fp32_activations(load_model(path))
    if work is None:
        return model.SerializeToString()
    out = Path(work) / f"{which}_fp32act.onnx"
    save_graph_in_place(model, out)
    return str(out)


def _trt_runner(engine_path: Path, profiles: Sequence[ProfileSpec]):
    """Polygraphy's TrtRunner, switching to the first optimization profile that fits each feed."""
    from polygraphy.backend.common import BytesFromPath
    from polygraphy.backend.trt import EngineFromBytes, TrtRunner

    def fits(shapes: dict, feed: dict) -> bool:
        return all(all(lo <= d <= hi for lo, d, hi in zip(mom[0], feed[n].shape, mom[2]))
                   for n, mom in shapes.items() if n in feed)

    class ProfileTrtRunner(TrtRunner):
        def infer_impl(self, feed_dict, *args, **kwargs):
            index = next((i for i, p in enumerate(profiles) if fits(p.shapes, feed_dict)), 0)
            self.set_profile(index)
            return super().infer_impl(feed_dict, *args, **kwargs)

    return ProfileTrtRunner(EngineFromBytes(BytesFromPath(str(engine_path))), name="trt")


def validate_graph(folder: Path, manifest, which: str, reference, feeds,
                   work: Path) -> tuple[list[Row], list[str], str]:
    """Run the reference and the graph's runners on `feeds`; returns (rows, notes, the
    equivalent polygraphy command line). Saves inputs and reference outputs under `work`."""
    from polygraphy.comparator import Comparator, RunResults
    from polygraphy.json import save_json

    from .feeds import in_kv_layout

    graph = getattr(manifest, which)
    policy = policy_for(graph)
    feeds = in_kv_layout(feeds, graph.kv_layout)  # the past as this graph takes it
    runners, notes = graph_runners(folder, manifest, which, work)
    inputs_path, ref_path = work / f"{which}_inputs.json", work / f"{which}_reference_outputs.json"
    save_json([f.inputs for f in feeds], str(inputs_path))
    results = Comparator.run([torch_runner(reference, graph)] + runners, data_loader=[f.inputs for f in feeds])
    ref_only = RunResults()
    ref_only.append((REFERENCE, results[REFERENCE]))
    ref_only.save(str(ref_path))
    rows = []
    for i, runner in enumerate(runners, start=1):
        rule = FP32_POLICY if runner.name == FP32_ACTIVATIONS else policy
        func = EagleCompareFunc(which, [f.label for f in feeds], rule)
        Comparator.compare_accuracy(results, comparisons=[(0, i)], compare_func=func)
        rows += func.rows
    # a quantised graph: the command checks its fp32-activation copy, which the elementwise rule fits
    checked = (work / f"{which}_fp32act.onnx").resolve() if graph.quant else folder.resolve() / graph.path
    command = (f"polygraphy run {checked} --onnxrt --load-inputs {inputs_path.resolve()} "
               f"--load-outputs {ref_path.resolve()} {(FP32_POLICY if graph.quant else policy).cli_flags()} "
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
        result.append(Row(*item, f"present.* ({len(group)})", max(g.max_abs for g in group),
                          max(g.max_rel for g in group), None, all(g.passed for g in group),
                          "; ".join(sorted({g.note for g in group if g.note}))))
    return result


def format_table(rows: list[Row]) -> str:
    head = ("graph", "runner", "feed", "output", "max abs err", "max rel err", "argmax agree", "result")
    body = [(r.graph, r.runner, r.feed, r.output, f"{r.max_abs:.3g}", f"{r.max_rel:.3g}",
             "-" if r.argmax is None else f"{r.argmax:.1%}",
             ("pass" if r.passed else "FAIL") + (f" ({r.note})" if r.note else ""))
            for r in rows]
    widths = [max(len(str(x[i])) for x in [head] + body) for i in range(len(head))]
    line = lambda cells: "  ".join(str(v).ljust(w) for v, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(b) for b in body])


def quantised_reference(folder: Path, manifest, refs: dict) -> list[Row]:
    """Give the torch reference of each quantised graph that graph's own weights (read back
    from its MatMulNBits nodes): quantisation is a deliberate change of the model, so the
    graph is checked against the model it is meant to compute. Returns one failing Row per
    quantised weight that matches no weight of the checkpoint."""
    import onnx

    from eagle_deploy.exporter.quantize import dequantised_weights

    from .reference import with_quantised_weights

    rows = []
    for which in ("target", "draft"):
        graph = getattr(manifest, which)
        if not graph.quant:
            continue
        # its external data read by our own reader: onnx.load refuses symlinked / hard-linked data files
        weights = dequantised_weights(onnx.load(str(folder / graph.path), load_external_data=False), folder)
        for node in with_quantised_weights(refs[which].module, weights):
            rows.append(Row(which, "onnxrt", "weights", node, float("nan"), float("nan"), None, False,
                            "quantised weight matches no weight of the checkpoint"))
    return rows


def run_validation(folder: Path, work: Path | None = None, graphs=("target", "draft"), log=print,
                   verify: str = "fast") -> dict:
    """Validate an export folder; returns {"passed", "rows", "notes", "commands", ...}. verify:
    how its files are first checked against the manifest (contract.verify.verify_export).
    Raises ManifestError (a file that is not the one the manifest describes, ...)."""
    import torch
    from polygraphy.logger import G_LOGGER

    from eagle_deploy.contract.manifest import Manifest
    from eagle_deploy.contract.verify import verify_export
    from eagle_deploy.runtime.api import load_tokenizer

    from . import feeds as fd
    from .reference import check_memory, load_reference_head, load_reference_target, reference_backends

    G_LOGGER.module_severity = G_LOGGER.CRITICAL  # the table reports; Polygraphy's own failures still raise
    folder = Path(folder)
    manifest = Manifest.load(folder)
    verify_export(folder, manifest, verify)
    check_memory(manifest, folder, graphs)  # a 7B reference is 27 GB in fp32: refuse before loading it
    work = Path(work) if work else folder / "validate"
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with torch.no_grad():
        hf = load_reference_target(manifest)
        head, head_note = load_reference_head(manifest, hf)
    refs = reference_backends(manifest, hf, head, folder)
    weight_rows = quantised_reference(folder, manifest, refs)
    log(f"reference loaded in {time.perf_counter() - t0:.1f}s ({head_note})")
    tokenizer = load_tokenizer(folder, manifest)  # None for an export without one
    prompt = fd.prompt_ids(tokenizer, min(24, manifest.max_length - 16), manifest.dims.vocab, manifest.chat_template)
    dtype = np.dtype(manifest.target.dtype) if manifest.target.dtype != "bfloat16" else None
    if dtype is None:
        raise ValueError("bfloat16 exports cannot be fed from numpy; validate them with --backend trt tooling")
    target_feeds, state = fd.target_feeds(fd.reference_forward(refs["target"]), prompt, manifest.dims, dtype)
    feeds = {"target": target_feeds,
             "draft": fd.draft_feeds(fd.reference_forward(refs["draft"]), prompt, state,
                                     np.dtype(manifest.draft.dtype), draft_dims=manifest.graph_dims("draft"),
                                     eagle3=manifest.draft.head_kind == "eagle3")}
    report = {"engines": str(folder), "passed": True, "rows": [], "notes": [head_note], "commands": {}, "policies": {}}
    for which in graphs:
        t1 = time.perf_counter()
        rows, notes, command = validate_graph(folder, manifest, which, refs[which], feeds[which], work)
        rows = [r for r in weight_rows if r.graph == which] + rows
        report["rows"] += [asdict(r) for r in rows]
        report["notes"] += notes
        report["commands"][which] = command
        report["policies"][which] = policy_for(getattr(manifest, which)).describe()
        if getattr(manifest, which).quant:
            report["policies"][which] += f"; {FP32_ACTIVATIONS}: {FP32_POLICY.describe()}"
        report["passed"] &= all(r.passed for r in rows)
        log(f"{which}: {len(feeds[which])} feeds compared in {time.perf_counter() - t1:.1f}s "
            f"({report['policies'][which]})")
    report["seconds"] = round(time.perf_counter() - t0, 1)
    return report


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="eagle-validate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", type=Path, required=True, help="export folder written by eagle-export")
    p.add_argument("--work", type=Path, default=None,
                   help="where feeds and reference outputs are saved (default ENGINES/validate)")
    p.add_argument("--graphs", default="target,draft", help="comma-separated: target, draft")
    p.add_argument("--all-outputs", action="store_true", help="one table row per KV output instead of one per feed")
    p.add_argument("--json", type=Path, default=None, help="also write the full report here")
    add_verify_arg(p)
    return p


@interruptible("eagle-validate")
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from eagle_deploy.contract.manifest import ManifestError

    from .reference import ReferenceError

    graphs = [g.strip() for g in args.graphs.split(",") if g.strip()]
    if not graphs or any(g not in ("target", "draft") for g in graphs):
        return cli_error("eagle-validate", f"--graphs takes target and/or draft, got {args.graphs!r}")
    graphs = list(dict.fromkeys(graphs))  # "draft,draft" validates the draft once
    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    try:  # the outputs first: a run of minutes must not fail at its end
        check_output_path("--work", args.work, folder=True)
        check_output_path("--json", args.json, folder=False)
    except ValueError as err:
        return cli_error("eagle-validate", err)
    try:
        report = run_validation(args.engines, args.work, graphs, log=say, verify=args.verify)
    except (ManifestError, ReferenceError, FileNotFoundError, ValueError, ImportError) as err:
        return cli_error("eagle-validate", err)
    except Exception as err:  # PolygraphyException (e.g. a runner that cannot load the graph), onnxruntime errors
        if type(err).__module__.split(".")[0] not in ("polygraphy", "onnxruntime"):
            raise
        return cli_error("eagle-validate", f"{type(err).__name__}: {err}")
    rows = [Row(**r) for r in report["rows"]]
    print(format_table(rows if args.all_outputs else collapse(rows)))
    for note in report["notes"]:
        print(f"note: {note}")
    for which, policy in report["policies"].items():
        print(f"{which} tolerance: {policy}")
    print("repeat a check by hand (onnxruntime vs the saved reference outputs; Polygraphy's rule is elementwise, "
          "so fp16 graphs may fail it where the rules above pass; a quantised graph is checked through its "
          "fp32-activation copy):")
    for which, command in report["commands"].items():
        print(f"  {command}")
    failed = [r for r in rows if not r.passed]
    print(f"{'PASSED' if report['passed'] else 'FAILED'}: {len(rows) - len(failed)}/{len(rows)} outputs "
          f"within tolerance ({report['seconds']}s)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)  # as eagle-bench's --out
        args.json.write_text(json.dumps(report, indent=2, default=float) + "\n")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
