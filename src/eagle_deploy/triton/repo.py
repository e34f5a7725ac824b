"""Write a Triton model repository that serves an export with EAGLE decoding.

    eagle-triton-repo --engines engines/smollm2-135m --out triton-repo [--instances 2]
    python -m eagle_deploy.triton.repo --engines ENGINE_DIR --out DIR          (the same)
    eagle-export --model smollm2-135m --out engines/ --triton-repo triton-repo (after the export)

writes `DIR/<name>/config.pbtxt` and `DIR/<name>/1/model.py` (a copy of triton/model.py): a
decoupled Python-backend model (default name "eagle"), max_batch_size 0, `instances` instances
of `kind` (KIND_CPU by default), its inputs and outputs named like the TensorRT-LLM / vLLM
backends' generate endpoints (see model.py), and parameters:

  engines             the export folder: an absolute path (default), or with copy_engines a
                      copy inside the version folder (`1/engines/<export name>`, relative)
  backend             auto | ort | ort-cuda | trt (select.py)
  threads             onnxruntime intra-op threads per session; "auto" = cores / instances
  tree                a TreeConfig JSON ("" = the export's manifest tree)
  acceptance, threshold   as eagle-run (threshold acceptance is NOT lossless)
  default_max_tokens  max_tokens when a request gives none
  worker_python       the Python of the project's environment (default: this interpreter)
  EXECUTION_ENV_PATH  the stub's numpy<2 venv (default: env.ensure_stub_env(), created if missing)
  drafter_kind, always_draft   where draft tokens come from and whether each round is planned
                               (as eagle-run's --drafter / --always-draft)
  prefill_graph       auto | target: which graph runs prompt forwards (as eagle-run's --prefill-graph)
  prefix_cache_mb     MiB of KV each instance keeps from earlier requests for later ones that
                      start with the same tokens (as eagle-serve's --prefix-cache-mb; ort only; 0: off)
  drafter, worker_pythonpath   an optional drafter plugin ("module:callable", see worker.py)

Other models already in DIR are left alone. Exits 2 on a bad setting or an unreadable export.
Imports no runtime and no exporter module (the exporter's CLI calls `write_repo`).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

from eagle_deploy.common.cli_args import (
    PREFILL_GRAPHS,
    HelpFormatter,
    add_drafter_args,
    add_tree_args,
    check_output_path,
    cli_error,
    interruptible,
    tree_from_args,
)
from eagle_deploy.contract.manifest import Manifest
from eagle_deploy.contract.tree_config import DEFAULT_DRAFTER, DRAFTER_KINDS, TreeConfig

from .select import BACKEND_CHOICES

MODEL_FILE = Path(__file__).with_name("model.py")
KINDS = ("KIND_CPU", "KIND_GPU", "KIND_AUTO")
ACCEPTANCE = ("lossless", "threshold")

INPUTS = [  # name, Triton type, dims, optional
    ("text_input", "TYPE_STRING", [1], False),
    ("max_tokens", "TYPE_INT32", [1], True),
    ("stream", "TYPE_BOOL", [1], True),
    ("temperature", "TYPE_FP32", [1], True),
    ("top_p", "TYPE_FP32", [1], True),
    ("top_k", "TYPE_INT32", [1], True),
    ("seed", "TYPE_UINT64", [1], True),
    ("min_p", "TYPE_FP32", [1], True),
    ("presence_penalty", "TYPE_FP32", [1], True),
    ("frequency_penalty", "TYPE_FP32", [1], True),
    ("repetition_penalty", "TYPE_FP32", [1], True),
    ("stop", "TYPE_STRING", [-1], True),
    ("response_format", "TYPE_STRING", [1], True),
    ("exclude_input_in_output", "TYPE_BOOL", [1], True),
]
OUTPUTS = [
    ("text_output", "TYPE_STRING", [-1]),
    ("finish_reason", "TYPE_STRING", [1]),
    ("prompt_tokens", "TYPE_INT32", [1]),
    ("new_tokens", "TYPE_INT32", [1]),
    ("target_forwards", "TYPE_INT32", [1]),
    ("mean_accept_len", "TYPE_FP32", [1]),
    ("stats", "TYPE_STRING", [1]),
]


def _quote(value: str) -> str:
    """A protobuf text-format string literal (UTF-8 kept as is)."""
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def config_pbtxt(name: str, parameters: dict[str, str], instances: int = 1, kind: str = "KIND_CPU") -> str:
    """The config.pbtxt text of the model."""
    def tensor(n, t, dims, optional=False):
        return (f"  {{ name: {_quote(n)} data_type: {t} dims: [ {', '.join(map(str, dims))} ]"
                + (" optional: true" if optional else "") + " }")

    lines = [f"name: {_quote(name)}", 'backend: "python"', "max_batch_size: 0",
             "model_transaction_policy { decoupled: true }",
             "input [", ",\n".join(tensor(*i) for i in INPUTS), "]",
             "output [", ",\n".join(tensor(*o) for o in OUTPUTS), "]",
             f"instance_group [ {{ count: {instances} kind: {kind} }} ]"]
    lines += [f"parameters {{ key: {_quote(k)} value: {{ string_value: {_quote(v)} }} }}"
              for k, v in parameters.items()]
    return "\n".join(lines) + "\n"


def write_repo(engines, out, *, name: str = "eagle", instances: int = 1, kind: str = "KIND_CPU",
               backend: str = "auto", threads: int | str = "auto", tree: TreeConfig | None = None,
               acceptance: str = "lossless", threshold: float = 0.3, default_max_tokens: int = 128,
               execution_env=None, worker_python=None, copy_engines: bool = False, drafter: str = "",
               worker_pythonpath: str = "", force: bool = False, drafter_kind: str = DEFAULT_DRAFTER,
               always_draft: bool = False, prefill_graph: str = "auto", prefix_cache_mb: float = 0) -> Path:
    """Write model `name` for export folder `engines` into repository `out`; return the model
    folder. execution_env None -> the stub venv (created if missing, see env.py); "" -> no
    EXECUTION_ENV_PATH (the stub then uses the Python it finds, e.g. a stock Triton image's).
    Raises ValueError (bad setting), FileExistsError (model folder exists and not force),
    ManifestError / FileNotFoundError (not an export folder, or one whose files are not the
    ones its manifest describes: contract.verify.verify_export "fast", as eagle-run checks it),
    env.StubEnvError."""
    from eagle_deploy.contract.verify import verify_export

    engines = Path(engines).absolute()
    manifest = Manifest.load(engines)
    verify_export(engines, manifest, "fast", progress=False)  # refused now, not when tritonserver loads it
    if backend == "trt" and manifest.engines.trt is None:
        raise ValueError(f"--backend trt needs TensorRT engines in {engines} (eagle-export --backend trt builds "
                         "them); this export has none")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or name in (".", ".."):
        raise ValueError(f"model name (--name) must be letters, digits, '_', '-' or '.', got {name!r}")
    if not isinstance(instances, int) or instances < 1:
        raise ValueError(f"instances (--instances) must be an integer >= 1, got {instances!r}")
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if backend not in BACKEND_CHOICES:
        raise ValueError(f"backend must be one of {', '.join(BACKEND_CHOICES)}, got {backend!r}")
    if threads != "auto" and (not str(threads).isdigit() or int(threads) < 1):
        raise ValueError(f"threads (--threads) must be 'auto' or an integer >= 1, got {threads!r}")
    if acceptance not in ACCEPTANCE or not 0.0 < float(threshold) <= 1.0:
        raise ValueError(f"acceptance must be lossless|threshold and threshold in (0, 1], "
                         f"got {acceptance!r}, {threshold}")
    if drafter_kind not in DRAFTER_KINDS:
        raise ValueError(f"drafter_kind must be one of {', '.join(DRAFTER_KINDS)}, got {drafter_kind!r}")
    if prefill_graph not in PREFILL_GRAPHS:
        raise ValueError(f"prefill_graph (--prefill-graph) must be one of {', '.join(PREFILL_GRAPHS)}, "
                         f"got {prefill_graph!r}")
    if isinstance(prefix_cache_mb, bool) or not isinstance(prefix_cache_mb, (int, float)) or not (
            0 <= prefix_cache_mb < float("inf")):
        raise ValueError(f"prefix_cache_mb (--prefix-cache-mb) must be a number >= 0, got {prefix_cache_mb!r}")
    if not isinstance(default_max_tokens, int) or default_max_tokens < 1:
        raise ValueError("default_max_tokens (--default-max-tokens) must be an integer >= 1, got "
                         f"{default_max_tokens!r}")
    if tree is not None:
        tree.validate(manifest.draft.graph_top_k)
    out = Path(out).absolute()
    model_dir = out / name
    if model_dir.exists() and not force:
        raise FileExistsError(f"{model_dir} exists: pass --force (force=True) to replace it")
    if execution_env is None:
        from .env import ensure_stub_env

        execution_env = str(ensure_stub_env())
    params = {"engines": str(engines), "backend": backend, "threads": str(threads),
              "tree": json.dumps(tree.to_json()) if tree is not None else "", "acceptance": acceptance,
              "threshold": str(float(threshold)), "default_max_tokens": str(default_max_tokens),
              "worker_python": str(Path(worker_python or sys.executable).absolute()),
              "drafter_kind": drafter_kind, "always_draft": "true" if always_draft else "false",
              "prefill_graph": prefill_graph, "prefix_cache_mb": str(float(prefix_cache_mb))}
    if execution_env:
        params["EXECUTION_ENV_PATH"] = str(Path(execution_env).absolute())
    if drafter:
        params["drafter"] = drafter
    if worker_pythonpath:
        params["worker_pythonpath"] = worker_pythonpath
    out.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.partial-", dir=out))
    try:
        (staging / "1").mkdir()
        shutil.copyfile(MODEL_FILE, staging / "1" / "model.py")
        if copy_engines:
            rel = Path("engines") / engines.name
            shutil.copytree(engines, staging / "1" / rel)
            params["engines"] = str(rel)
        (staging / "config.pbtxt").write_text(config_pbtxt(name, params, instances, kind))
        if model_dir.exists():
            shutil.rmtree(model_dir)
        staging.rename(model_dir)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return model_dir


def add_repo_args(p: argparse.ArgumentParser) -> None:
    """The repository flags (everything but --engines / --out)."""
    p.add_argument("--name", default="eagle", help="model name (the URL's /v2/models/NAME)")
    p.add_argument("--instances", type=int, default=1,
                   help="model instances (each its own runtime, KV and worker process)")
    p.add_argument("--kind", default="KIND_CPU", choices=KINDS, help="instance_group kind")
    p.add_argument("--backend", default="auto", choices=BACKEND_CHOICES,
                   help="engine backend; auto: trt if the export has TensorRT engines and a GPU is visible, "
                        "ort-cuda with a GPU, else ort")
    p.add_argument("--threads", default="auto", help="onnxruntime threads per session ('auto' = cores / instances)")
    p.add_argument("--acceptance", default="lossless", choices=ACCEPTANCE, help="'threshold' is NOT lossless")
    p.add_argument("--threshold", type=float, default=0.3, help="probability threshold for --acceptance threshold")
    p.add_argument("--default-max-tokens", type=int, default=128, help="max_tokens when a request gives none")
    add_drafter_args(p)
    p.add_argument("--prefill-graph", default="auto", choices=PREFILL_GRAPHS,
                   help="which graph runs prompt forwards: 'auto' = the export's int8 prefill graph where it has one "
                        "and the backend is ort, else the target graph; 'target' = the target graph always")
    p.add_argument("--prefix-cache-mb", type=float, default=0.0, metavar="MB",
                   help="MiB of KV each instance keeps from earlier requests and reuses, bit for bit, for later "
                        "ones that start with the same tokens (a chat's next turn, a shared system prompt); "
                        "ort only; 0: off")
    p.add_argument("--execution-env", default=None,
                   help="EXECUTION_ENV_PATH for the Python-backend stub (a numpy<2 venv); default: "
                        "<sys.prefix>/triton-stub-env, created if missing; '' for none")
    p.add_argument("--worker-python", default=None, help="Python that runs the decode workers (default: this one)")
    p.add_argument("--copy-engines", action="store_true",
                   help="copy the export into the model's version folder (self-contained repository) "
                        "instead of referencing it by absolute path")
    p.add_argument("--force", action="store_true", help="replace an existing model folder of this name")


@interruptible("eagle-triton-repo")
def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="eagle-triton-repo", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--engines", type=Path, required=True, help="an export folder written by eagle-export")
    p.add_argument("--out", type=Path, required=True, help="the model repository folder")
    add_repo_args(p)
    add_tree_args(p, "the export's manifest")
    args = p.parse_args(argv)
    from eagle_deploy.contract.manifest import ManifestError

    from .env import StubEnvError

    try:
        check_output_path("--out", args.out, folder=True)
        model_dir = write_repo(args.engines, args.out, tree=tree_from_args(args, None), **repo_kwargs(args))
    except (ValueError, ManifestError, FileExistsError, FileNotFoundError, StubEnvError) as err:
        return cli_error("eagle-triton-repo", err)
    for note in missing_paths(args.worker_python, args.execution_env):
        print(f"eagle-triton-repo: note: {note}", file=sys.stderr)
    print(model_dir)
    return 0


def missing_paths(worker_python: str | None, execution_env: str | None) -> list[str]:
    """Notes for the paths the repository names that this machine lacks: not errors, since a
    repository (e.g. with --copy-engines) may be served from another machine or a container
    where they exist, but tritonserver fails to load the model where they do not."""
    notes = []
    if worker_python and not (Path(worker_python).is_file() and os.access(worker_python, os.X_OK)):
        notes.append(f"--worker-python {worker_python} is not an executable file on this machine: the model's "
                     "workers will not start unless it is one where tritonserver runs")
    if execution_env and not Path(execution_env).exists():
        notes.append(f"--execution-env {execution_env} does not exist on this machine: tritonserver will not load "
                     "the model unless it exists where tritonserver runs")
    return notes


def repo_kwargs(args) -> dict:
    """write_repo keyword arguments from parsed add_repo_args flags."""
    threads = int(args.threads) if str(args.threads).isdigit() else args.threads
    return dict(name=args.name, instances=args.instances, kind=args.kind, backend=args.backend, threads=threads,
                acceptance=args.acceptance, threshold=args.threshold, default_max_tokens=args.default_max_tokens,
                execution_env=args.execution_env, worker_python=args.worker_python,
                copy_engines=args.copy_engines, force=args.force, drafter_kind=args.drafter,
                always_draft=args.always_draft, prefill_graph=args.prefill_graph,
                prefix_cache_mb=args.prefix_cache_mb)


if __name__ == "__main__":
    sys.exit(main())
