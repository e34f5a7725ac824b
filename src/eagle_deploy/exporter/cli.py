"""`eagle-export`: export a target model and its EAGLE head to ONNX (and TensorRT engines)."""
from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from pathlib import Path

from eagle_deploy.common.cli_args import (
    HelpFormatter,
    add_tree_args,
    check_at_least,
    check_output_path,
    cli_error,
    disk_error,
    interruptible,
    tree_from_args,
)
from eagle_deploy.contract.dtypes import CLI_NAMES as CLI_DTYPES
from eagle_deploy.contract.manifest import DRAFT_QUANTS

from .models import ALIASES  # no torch: the parser is built without the heavy imports
from .prefill import PREFILL_WEIGHTS


def _draft_vocab(text: str) -> int:
    """--draft-vocab: 'full' (or 0) -> 0, else a positive token count."""
    if text.strip().lower() == "full":
        return 0
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a token count or 'full', got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a token count >= 0 or 'full', got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="eagle-export", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--model", required=True,
                   help=f"alias ({', '.join(ALIASES)}), a Hugging Face model folder, or a .gguf file")
    p.add_argument("--draft", default=None,
                   help="EAGLE head folder or cached hub id; 'random' for an untrained head; default: the alias's head")
    p.add_argument("--out", type=Path, default=Path("engines"), help="output root; the export goes to OUT/NAME")
    p.add_argument("--name", default=None, help="export folder name (default: the alias or checkpoint name)")
    p.add_argument("--dtype", default="fp32", choices=list(CLI_DTYPES),
                   help="graph precision (fp16/bf16 keep RMSNorm and softmax in fp32)")
    p.add_argument("--quant", default=None, choices=["int4", "int8"],
                   help="quantise the target graph for CPU (lossless w.r.t. the quantised target)")
    draft_quant = p.add_mutually_exclusive_group()
    draft_quant.add_argument("--draft-quant", default="auto", choices=list(DRAFT_QUANTS),
                             help="quantise the draft graph's weights (never changes the committed tokens, only the "
                                  "proposals): 'auto' = as --quant, else int8 for the fp32 fused onnxruntime graph "
                                  "(measured on SmolLM2: draft steps 1.8x faster, same tau); 'none' keeps it as "
                                  "exported")
    draft_quant.add_argument("--no-quant-draft", dest="draft_quant", action="store_const", const="none",
                             help="the same as --draft-quant none")
    p.add_argument("--backend", default="ort", choices=["ort", "trt"],
                   help="'trt' also builds TensorRT engines (needs a GPU and TensorRT; implies --graph standard)")
    p.add_argument("--graph", default="auto", choices=["auto", "fused", "standard"],
                   help="'fused': attention, RoPE and residual norms as onnxruntime contrib operators "
                        "(GroupQueryAttention, SkipSimplifiedLayerNormalization; fp32 only); 'standard': plain ONNX "
                        "operators, which TensorRT and other runtimes can run; 'auto': fused for fp32 with --backend "
                        "ort, else standard")
    p.add_argument("--repeat-one-row", default="auto", choices=["auto", "on", "off"],
                   help="the fused target graph runs a one-token forward's attention as two rows itself, so that "
                        "row-exact decoding (the default for --quant exports: greedy EAGLE output equal to vanilla's "
                        "bit for bit) runs one-token forwards as one row instead of two where the CPU's quantised "
                        "matmuls allow it (int8; int4 with AVX-512); 'auto': on with --quant")
    p.add_argument("--prefill-weights", default="none", choices=list(PREFILL_WEIGHTS),
                   help="'int8' (with --quant int4): also write prefill.onnx, the target graph with int8 weights and "
                        "per-token int8 activations, which the runtime runs for prompt forwards (about twice as fast "
                        "as int4 on a CPU; decoding stays int4; +1 byte per parameter on disk and in memory); "
                        "greedy output then follows the KV it computed, the same in EAGLE and vanilla decoding")
    p.add_argument("--max-length", type=int, default=None,
                   help="KV capacity in tokens (prompt + output may reach max_length + 1: the last new token needs no "
                        "KV row) (default: alias value or min(max_position_embeddings, 4096), capped to the draft "
                        "head's max_position_embeddings; an explicit value above the head's limit is refused)")
    p.add_argument("--graph-top-k", type=int, default=10,
                   help="top-k computed inside the draft graph (upper bound for --tree-top-k)")
    p.add_argument("--draft-vocab", type=_draft_vocab, default=None,
                   help="tokens the draft head may propose: N most frequent (the head's token_counts.npy, else the "
                        "tokenizer's merge rank), or 'full' (also 0). Default: the alias's measured choice, else "
                        "8192 or a quarter of the vocabulary if larger (full when the vocabulary is at most 8192). "
                        "Verification stays over the full vocabulary, so output stays lossless")
    p.add_argument("--external-data", default="auto", choices=["auto", "always", "never"],
                   help="ONNX external data (auto: above 2 GiB)")
    p.add_argument("--force", action="store_true", help="replace an existing export folder")
    p.add_argument("--triton-repo", type=Path, default=None,
                   help="after the export, write a Triton model repository serving it into this folder (model "
                        "'eagle', replaced if present; eagle-triton-repo has the other settings)")
    p.add_argument("--triton-instances", type=int, default=1, help="model instances for --triton-repo")
    add_tree_args(p, "by target precision and draft-graph quantisation, measured on a 2-core CPU "
                     "(contract/tree_config.py default_tree)")
    return p


def graph_for(graph: str, backend: str, quant: str | None = None, draft_quant: str = "auto") -> str:
    """--graph for this --backend: TensorRT cannot run onnxruntime's contrib operators, so
    --backend trt takes the standard graph (and refuses --graph fused, --quant and an explicit
    --draft-quant int4|int8: MatMulNBits is one of them)."""
    if backend == "trt" and graph == "fused":
        raise ValueError("--backend trt needs --graph standard (TensorRT cannot run onnxruntime's contrib operators)")
    if backend == "trt" and (quant or draft_quant not in ("auto", "none")):
        flag = f"--quant {quant}" if quant else f"--draft-quant {draft_quant}"
        raise ValueError(f"--backend trt cannot take {flag}: the quantised graphs use onnxruntime's MatMulNBits, "
                         "which TensorRT cannot run")
    return "standard" if backend == "trt" else graph


DISK_FAILURE = 4  # exit status: the export could not be written (read-only, full, not permitted)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def triton_repo(export: Path, repo: Path, instances: int) -> Path:
    """`eagle-triton-repo --engines export --out repo --instances N --force`: the Triton model
    folder for the export just written (triton.repo.write_repo; this module is a console entry
    point, above every layer). ValueError naming --triton-repo when it cannot be written."""
    from eagle_deploy.contract.manifest import ManifestError
    from eagle_deploy.triton.env import StubEnvError
    from eagle_deploy.triton.repo import write_repo

    try:
        return write_repo(export, repo, instances=instances, force=True)
    except (ValueError, ManifestError, FileExistsError, FileNotFoundError, StubEnvError) as err:
        raise ValueError(f"--triton-repo: {err}") from err


@interruptible("eagle-export")
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from eagle_deploy.heads.files import HeadCheckpointError

    from .export import ExportOptions, export
    from .models import ModelNotAvailableError
    from .target import UnsupportedModelError

    t0 = time.perf_counter()
    step = lambda msg: print(f"[{time.perf_counter() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    # a polite kill (SIGTERM) unwinds like Ctrl-C, so the partial folder is removed
    previous = (signal.signal(signal.SIGTERM, _interrupt)
                if threading.current_thread() is threading.main_thread() else None)
    try:
        if not args.model.strip():
            raise ValueError("--model is empty: give a model alias (eagle-export --help lists them), a Hugging Face "
                             "folder or a .gguf file")
        if args.out.exists() and not args.out.is_dir():  # not check_output_path: an unwritable --out is DISK_FAILURE
            raise ValueError(f"--out {args.out} is a file, not a folder")
        if args.triton_repo is not None:  # said before minutes of export, not after
            check_at_least([("--triton-instances", args.triton_instances, 1)])
            check_output_path("--triton-repo", args.triton_repo, folder=True)
        options = ExportOptions(dtype=args.dtype, max_length=args.max_length, graph_top_k=args.graph_top_k,
                                draft_vocab=args.draft_vocab, tree=tree_from_args(args, None),
                                external_data=args.external_data,
                                quant=args.quant, draft_quant=args.draft_quant, name=args.name, force=args.force,
                                graph=graph_for(args.graph, args.backend, args.quant, args.draft_quant),
                                repeat_one_row=args.repeat_one_row, prefill_weights=args.prefill_weights)
        if args.backend == "trt":  # TensorRT missing: said before minutes of ONNX export, not after
            from . import trt_build

            trt_build._polygraphy_loaders()
        out = export(args.model, args.draft, args.out, options, progress=step)
        if args.backend == "trt":
            trt_build.build_engines(out, progress=step)
        if args.triton_repo is not None:
            step(f"triton model: {triton_repo(out, args.triton_repo, args.triton_instances)}")
    except (ModelNotAvailableError, UnsupportedModelError, HeadCheckpointError, FileExistsError, FileNotFoundError,
            ValueError) as err:
        return cli_error("eagle-export", err)
    except (OSError, RuntimeError) as err:  # a destination that cannot be written, even when a library wrapped it
        line = disk_error(err, args.out)
        if line is None and not isinstance(err, OSError):
            print(f"eagle-export: error: {err}", file=sys.stderr)  # TensorRT's engine build failed
            return 3
        line = line or f"cannot write the export ({type(err).__name__}: {err})"
        print(f"eagle-export: error: {line}; nothing was left behind", file=sys.stderr)
        return DISK_FAILURE
    except ImportError as err:  # TensorRT missing
        print(f"eagle-export: error: {err}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print("eagle-export: interrupted; the partial export was removed", file=sys.stderr)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    step(f"done: {out}")
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
