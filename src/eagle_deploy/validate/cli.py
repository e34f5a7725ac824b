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
           Hidden-state outputs (features, tapped_features, next_features) take rtol
           relative to their row's largest |ref| (massive activations in the residual
           stream set their fp32 rounding, and the final norm's after it).
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
  prefill graph (an int4 export's prefill.onnx, --prefill-weights int8): the target's feeds,
           against a reference with its own int8 weights (read back from its MatMulInteger
           nodes); its activations are rounded to int8 per row, far coarser than MatMulNBits'
           blocks, so the same top-1 / KL rule holds it to >= 75% and mean KL <= 0.5
           (SmolLM2-135M measured 84-86% and 0.20-0.24); no fp32-activation runner.
Exit status: 0 all pass, 1 a mismatch (the table says where), 2 the check could not run.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from eagle_deploy.common.cli_args import add_verify_arg, check_output_path, cli_error, interruptible
from eagle_deploy.contract.manifest import ManifestError
from eagle_deploy.exporter.sources import ReferenceLoadError

from .compare import Row, collapse, format_table
from .run import run_validation


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="eagle-validate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", type=Path, required=True, help="export folder written by eagle-export")
    p.add_argument("--work", type=Path, default=None,
                   help="where feeds and reference outputs are saved (default ENGINES/validate)")
    p.add_argument("--graphs", default=None,
                   help="comma-separated: target, draft, prefill (default: every graph the export has)")
    p.add_argument("--all-outputs", action="store_true", help="one table row per KV output instead of one per feed")
    p.add_argument("--json", type=Path, default=None, help="also write the full report here")
    add_verify_arg(p)
    return p


@interruptible("eagle-validate")
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    graphs = None  # every graph the export has
    if args.graphs is not None:
        graphs = [g.strip() for g in args.graphs.split(",") if g.strip()]
        if not graphs or any(g not in ("target", "draft", "prefill") for g in graphs):
            return cli_error("eagle-validate", f"--graphs takes target, draft and/or prefill, got {args.graphs!r}")
        graphs = list(dict.fromkeys(graphs))  # "draft,draft" validates the draft once
    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    try:  # the outputs first: a run of minutes must not fail at its end
        check_output_path("--work", args.work, folder=True)
        check_output_path("--json", args.json, folder=False)
    except ValueError as err:
        return cli_error("eagle-validate", err)
    try:
        report = run_validation(args.engines, args.work, graphs, log=say, verify=args.verify)
    except (ManifestError, ReferenceLoadError, FileNotFoundError, ValueError, ImportError) as err:
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
          "so fp16 graphs, and the hidden states of a model with massive activations, may fail it where the "
          "rules above pass; a quantised graph is checked through its "
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
