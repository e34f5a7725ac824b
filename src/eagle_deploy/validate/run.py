"""`run_validation`: an export's graphs against the PyTorch reference, as eagle-validate runs
it: check its files, load the reference (with a quantised graph's own weights), make the feeds
(feeds.py), run each graph's runners (runners.py) through Polygraphy's Comparator and judge
every output (compare.py); returns the report the command prints. torch, onnx and Polygraphy
are imported by the functions that run them (`eagle-validate --help` loads none)."""
from __future__ import annotations

import copy
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from eagle_deploy.contract.manifest import Manifest
from eagle_deploy.contract.verify import verify_export
from eagle_deploy.exporter.prefill import prefill_weights
from eagle_deploy.exporter.quantize import dequantised_weights
from eagle_deploy.exporter.sources import load_reference_head, load_reference_target
from eagle_deploy.runtime.api import load_tokenizer

from . import feeds as fd
from .compare import FP32_POLICY, EagleCompareFunc, Row, policy_for
from .reference import check_memory, reference_backends, with_quantised_weights
from .runners import FP32_ACTIVATIONS, REFERENCE, graph_runners, has_fp32_copy, torch_runner


def validate_graph(folder: Path, manifest, which: str, reference, feeds,
                   work: Path) -> tuple[list[Row], list[str], str]:
    """Run the reference and the graph's runners on `feeds`; returns (rows, notes, the
    equivalent polygraphy command line). Saves inputs and reference outputs under `work`."""
    from polygraphy.comparator import Comparator, RunResults
    from polygraphy.json import save_json

    graph = getattr(manifest, which)
    policy = policy_for(graph)
    feeds = fd.in_kv_layout(feeds, graph.kv_layout)  # the past as this graph takes it
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
    copy = has_fp32_copy(graph)
    checked = (work / f"{which}_fp32act.onnx").resolve() if copy else folder.resolve() / graph.path
    command = (f"polygraphy run {checked} --onnxrt --load-inputs {inputs_path.resolve()} "
               f"--load-outputs {ref_path.resolve()} {(FP32_POLICY if copy else policy).cli_flags()} "
               f"--save-outputs {(work / f'{which}_onnxrt_outputs.json').resolve()}")
    return rows, notes, command


def quantised_reference(folder: Path, manifest, refs: dict) -> list[Row]:
    """Give the torch reference of each quantised graph in `refs` that graph's own weights (read
    back from its MatMulNBits nodes, or the prefill graph's MatMulInteger ones): quantisation is
    a deliberate change of the model, so the graph is checked against the model it is meant to
    compute. Returns one failing Row per quantised weight that matches no weight of the
    checkpoint."""
    import onnx

    rows = []
    for which in refs:
        graph = getattr(manifest, which)
        if not graph.quant:
            continue
        # its external data read by our own reader: onnx.load refuses symlinked / hard-linked data files
        model = onnx.load(str(folder / graph.path), load_external_data=False)
        weights = (prefill_weights if which == "prefill" else dequantised_weights)(model, folder)
        for node in with_quantised_weights(refs[which].module, weights):
            rows.append(Row(which, "onnxrt", "weights", node, float("nan"), float("nan"), None, False,
                            "quantised weight matches no weight of the checkpoint"))
    return rows


def run_validation(folder: Path, work: Path | None = None, graphs=None, log=print,
                   verify: str = "fast") -> dict:
    """Validate graphs `graphs` ("target", "draft", "prefill"; None: every graph the export
    has, Manifest.graph_names) of an export folder; returns {"passed", "rows", "notes",
    "commands", ...}. verify: how its files are first checked against the manifest
    (contract.verify.verify_export). Raises ManifestError (a file that is not the one the
    manifest describes, ...), ValueError for a graph the export does not have."""
    import torch
    from polygraphy.logger import G_LOGGER

    G_LOGGER.module_severity = G_LOGGER.CRITICAL  # the table reports; Polygraphy's own failures still raise
    folder = Path(folder)
    manifest = Manifest.load(folder)
    verify_export(folder, manifest, verify)
    graphs = manifest.graph_names if graphs is None else tuple(graphs)
    missing = [g for g in graphs if g not in manifest.graph_names]
    if missing:
        raise ValueError(f"--graphs {','.join(missing)}: {folder} has no such graph (it has "
                         f"{', '.join(manifest.graph_names)}; a prefill graph comes from eagle-export --quant int4 "
                         "--prefill-weights int8)")
    check_memory(manifest, folder, graphs)  # a 7B reference is 27 GB in fp32: refuse before loading it
    work = Path(work) if work else folder / "validate"
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with torch.no_grad():
        hf = load_reference_target(manifest)
        head, head_note = load_reference_head(manifest, hf)
    refs = reference_backends(manifest, hf, head, folder)
    if "prefill" in graphs:  # a reference of its own, for its own (int8) weights
        from .torch_backend import TorchBackend

        refs["prefill"] = TorchBackend.target(copy.deepcopy(hf), manifest.target.feature_layers)
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
    feeds["prefill"] = target_feeds  # the target's contract: the same feeds
    report = {"engines": str(folder), "passed": True, "rows": [], "notes": [head_note], "commands": {}, "policies": {}}
    for which in graphs:
        t1 = time.perf_counter()
        rows, notes, command = validate_graph(folder, manifest, which, refs[which], feeds[which], work)
        rows = [r for r in weight_rows if r.graph == which] + rows
        report["rows"] += [asdict(r) for r in rows]
        report["notes"] += notes
        if getattr(manifest, which).quant and not has_fp32_copy(getattr(manifest, which)):
            report["notes"].append(f"{which}: no fp32-activation copy exists (int8 x int8 matmuls); its command below "
                                   "compares elementwise, which its int8 activation rounding exceeds: read it as a "
                                   "report")
        report["commands"][which] = command
        report["policies"][which] = policy_for(getattr(manifest, which)).describe()
        if has_fp32_copy(getattr(manifest, which)):
            report["policies"][which] += f"; {FP32_ACTIVATIONS}: {FP32_POLICY.describe()}"
        report["passed"] &= all(r.passed for r in rows)
        log(f"{which}: {len(feeds[which])} feeds compared in {time.perf_counter() - t1:.1f}s "
            f"({report['policies'][which]})")
    report["seconds"] = round(time.perf_counter() - t0, 1)
    return report
