"""Peer CPU runtimes for eagle-bench (`--baselines ort-genai,openvino`): what a CPU user could
pick instead of this project, each converted by its own tool from the export's HF checkpoint
folder and decoded greedily (vanilla, one token per forward) from the same prompt token ids.

- ort-genai-{fp32,int4}: onnxruntime-genai's model builder (`python -m
  onnxruntime_genai.models.builder -i <hf> -o <out> -p <precision> -e cpu`), decoded with
  `og.Generator`; the thread count goes into the session options (`og.Config.overlay`).
- openvino-{fp32,int8,int4}: `optimum-cli export openvino --weight-format <precision>` (int4
  with `--group-size 32`: SmolLM2-135M's 576 is no multiple of the default 128), decoded with
  `openvino_genai.LLMPipeline` on "CPU" with INFERENCE_NUM_THREADS; fp32 also sets f32
  inference and KV-cache precision (the CPU plugin otherwise picks bf16 / u8 on CPUs that
  have them), int8/int4 keep OpenVINO's defaults (recorded).
- openvino-eagle3-{fp32,int8,int4}: OpenVINO GenAI's own EAGLE-3 speculative decoding (greedy,
  lossless) over the openvino-<precision> model, drafting with an EAGLE-3 head in the reference
  layout (`eagle-bench --eagle3-head DIR`) converted by `optimum-cli export openvino
  --trust-remote-code` (fp32; OpenVINO GenAI feeds it the main model's embeddings and taps);
  `OV_EAGLE3` holds its draft settings. Without a head the peers are skipped with a note.

Converted models are cached under `<cache_root>/peers/<hf folder name>/<peer>-<version>-<precision>/`
($EAGLE_DEPLOY_CACHE, else ~/.cache/eagle-deploy) with a `peer.json` holding the exact command.
optimum-intel pins transformers < 5.6, so it cannot share this project's environment: it is
found as $EAGLE_DEPLOY_OPTIMUM_CLI, `optimum-cli` on PATH or beside this Python, or in
`<cache_root>/venvs/optimum-intel` (README, eagle-bench section). A missing package makes the
peer skip with a note that names the install command.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .timed import Run

# the peer runtimes: family -> precisions; "--baselines openvino" means every precision
PEERS = {"ort-genai": ("fp32", "int4"), "openvino": ("fp32", "int8", "int4"),
         "openvino-eagle3": ("fp32", "int8", "int4")}  # OpenVINO GenAI's own EAGLE-3 decoding (--eagle3-head)
PEER_NAMES = tuple(f"{family}-{p}" for family, precisions in PEERS.items() for p in precisions)
PACKAGES = {"ort-genai": ("onnxruntime_genai", "onnxruntime-genai"), "openvino": ("openvino_genai", "openvino-genai"),
            "openvino-eagle3": ("openvino_genai", "openvino-genai")}
INSTALL = "pip install -c constraints.txt -e '.[peers]'"
OPTIMUM_VENV = "venvs/optimum-intel"  # under cache_root()
OPTIMUM_INSTALL = ("python -m venv ~/.cache/eagle-deploy/venvs/optimum-intel && "
                   "~/.cache/eagle-deploy/venvs/optimum-intel/bin/pip install 'optimum-intel[openvino]==2.2.0' "
                   "openvino==2026.4.1 openvino-tokenizers==2026.4.1.0 torch==2.13.0 "
                   "einops==0.8.2 diffusers==0.39.0 'huggingface-hub<1.22' && "
                   "~/.cache/eagle-deploy/venvs/optimum-intel/bin/pip uninstall -y torchvision")
OV_GROUP_SIZE = 32  # int4 group size for OpenVINO (must divide the hidden size 576)
# OpenVINO GenAI's EAGLE-3 draft settings for the openvino-eagle3-* peers (GenerationConfig fields):
# its best on SmolLM2-135M with the repository's CPU-trained EAGLE-3 head (docs/decisions.md,
# 'OpenVINO GenAI's EAGLE-3 draft settings, measured')
OV_EAGLE3 = {"num_assistant_tokens": 1}
NO_SPECULATION = ("none: OpenVINO GenAI's own EAGLE-3 speculative decoding is the openvino-eagle3-* peer "
                  "(eagle-bench --eagle3-head DIR)")


def split_name(name: str) -> tuple[str, str]:
    """"openvino-int4" -> ("openvino", "int4"). Raises ValueError for a name not in PEER_NAMES."""
    for family, precisions in PEERS.items():
        for p in precisions:
            if name == f"{family}-{p}":
                return family, p
    raise ValueError(f"unknown peer {name!r}; choose from {', '.join(PEER_NAMES)}")


def expand(names: list[str]) -> list[str]:
    """Family names ("ort-genai", "openvino") -> one name per precision; order kept, duplicates dropped."""
    out: list[str] = []
    for n in names:
        for m in ([f"{n}-{p}" for p in PEERS[n]] if n in PEERS else [n]):
            if m not in out:
                out.append(m)
    return out


def _import(module: str):
    """The module, or None when it cannot be imported (absent, or set to None in sys.modules)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


def version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def optimum_cli() -> Path | None:
    """optimum-cli: $EAGLE_DEPLOY_OPTIMUM_CLI, on PATH, beside this Python, or in the cache's venv."""
    from eagle_deploy.common.cache import cache_root

    env = os.environ.get("EAGLE_DEPLOY_OPTIMUM_CLI")
    found = [Path(env)] if env else []
    which = shutil.which("optimum-cli")
    found += [Path(which)] if which else []
    found += [Path(sys.executable).parent / "optimum-cli", cache_root() / OPTIMUM_VENV / "bin" / "optimum-cli"]
    return next((p for p in found if p.is_file()), None)


def converted_peer(name: str) -> str:
    """The peer whose converted model `name` runs: itself, or for openvino-eagle3-<p> the main
    model of openvino-<p>."""
    family, precision = split_name(name)
    return f"openvino-{precision}" if family == "openvino-eagle3" else name


def model_dir(hf_dir: Path, name: str) -> Path:
    """Where peer `name`'s converted model for checkpoint folder `hf_dir` is cached."""
    from eagle_deploy.common.cache import cache_root

    family, precision = split_name(converted_peer(name))
    return cache_root() / "peers" / Path(hf_dir).name / f"{family}-{version(PACKAGES[family][1])}-{precision}"


def eagle3_head_problem(head: Path | None) -> str | None:
    """Why `head` is no EAGLE-3 head optimum-cli can convert (None when it is one): a folder with
    model.safetensors and a config.json whose architectures name an EAGLE-3 Llama draft."""
    if head is None:
        return ("needs an EAGLE-3 draft head: eagle-bench --eagle3-head DIR (this repository's: "
                "data/heads/smollm2-135m-eagle3)")
    try:
        archs = json.loads((Path(head) / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError) as err:
        return f"--eagle3-head {head}: no readable config.json ({err})"
    if not (Path(head) / "model.safetensors").is_file():
        return f"--eagle3-head {head}: no model.safetensors"
    if not any("eagle3" in str(a).lower() for a in archs):
        return f"--eagle3-head {head}: config.json architectures {archs} name no EAGLE-3 draft model"
    return None


def draft_dir(head: Path) -> Path:
    """Where the OpenVINO IR of EAGLE-3 head `head` is cached (keyed by its weights' digest)."""
    from eagle_deploy.common.cache import cache_root
    from eagle_deploy.contract.verify import sha256_file

    digest = sha256_file(Path(head) / "model.safetensors")
    return (cache_root() / "peers" / "eagle3-drafts"
            / f"{Path(head).resolve().name}-{digest[:12]}-openvino-{version('openvino-genai')}")


def draft_command(head: Path, out: Path, cli: Path | None = None) -> list[str]:
    """optimum-cli's conversion of an EAGLE-3 head to OpenVINO IR (argv list; fp32 weights)."""
    return [str(cli or "optimum-cli"), "export", "openvino", "--model", str(head), "--task",
            "text-generation-with-past", "--weight-format", "fp32", "--trust-remote-code", str(out)]


def convert_command(name: str, hf_dir: Path, out: Path, cli: Path | None = None) -> list[str]:
    """The conversion command line for peer `name` (argv list)."""
    family, precision = split_name(name)
    if family == "ort-genai":
        return [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o", str(out),
                "-p", precision, "-e", "cpu", "-c", str(Path(out) / "_builder_cache")]
    cmd = [str(cli or "optimum-cli"), "export", "openvino", "--model", str(hf_dir), "--task",
           "text-generation-with-past", "--weight-format", precision]
    return cmd + (["--group-size", str(OV_GROUP_SIZE)] if precision == "int4" else []) + [str(out)]


def _converter_versions(cli: Path) -> dict:
    py = cli.parent / "python"
    if not py.is_file():
        return {}
    code = ("import importlib.metadata as m, json; print(json.dumps({d: m.version(d) for d in "
            "('optimum-intel', 'optimum', 'nncf', 'openvino', 'openvino-tokenizers', 'transformers', 'torch')}))")
    try:
        return json.loads(subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=120,
                                         check=True).stdout)
    except Exception:  # versions are informative only
        return {}


def _run_converter(cmd: list[str], logfile: Path) -> int:
    """Run a conversion command offline, its output into `logfile`; returns the exit status."""
    with logfile.open("w") as fh:
        return subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                              check=False).returncode


def unavailable(name: str, hf_dir: Path | None = None, eagle3_head: Path | None = None) -> str | None:
    """Why peer `name` cannot run here (None when it can): a missing runtime package, for the
    EAGLE-3 peers no usable head, or (for OpenVINO, when a model is not cached yet) no
    optimum-cli to convert with."""
    family, _ = split_name(name)
    module, dist = PACKAGES[family]
    missing = [f"{dist} is not installed ({INSTALL})"] if _import(module) is None else []
    if family == "openvino-eagle3":  # say both at once when both are missing
        missing += [p for p in [eagle3_head_problem(eagle3_head)] if p]
    if missing:
        return "; ".join(missing) + ": skipped"
    cached = hf_dir is not None and (model_dir(hf_dir, name) / "peer.json").is_file() and (
        family != "openvino-eagle3" or (draft_dir(eagle3_head) / "peer.json").is_file())
    if family.startswith("openvino") and optimum_cli() is None and not cached:
        return ("no optimum-cli to convert the model to OpenVINO IR (optimum-intel pins transformers < 5.6, so it "
                f"lives in its own venv: {OPTIMUM_INSTALL}; or set EAGLE_DEPLOY_OPTIMUM_CLI): skipped")
    return None


def ensure_model(name: str, hf_dir: Path, log=lambda m: None) -> tuple[Path, dict]:
    """The converted model folder of peer `name` (converted on first use; ~15 s for ort-genai,
    ~1 min for OpenVINO int4 on 2 cores; an openvino-eagle3 peer's is its openvino one's) and
    its build record {command, converter, seconds}. Raises RuntimeError with the log's tail
    when the conversion fails."""
    name = converted_peer(name)
    family, _ = split_name(name)
    cli = optimum_cli() if family == "openvino" else None
    return _converted(model_dir(hf_dir, name), lambda out: convert_command(name, hf_dir, out, cli), cli, name, log)


def ensure_draft(head: Path, log=lambda m: None) -> tuple[Path, dict]:
    """The OpenVINO IR of EAGLE-3 head `head` (converted on first use, ~15 s) and its build
    record, as `ensure_model`."""
    cli = optimum_cli()
    return _converted(draft_dir(head), lambda out: draft_command(head, out, cli), cli, f"EAGLE-3 head {head}", log)


def _converted(out: Path, command, cli: Path | None, what: str, log) -> tuple[Path, dict]:
    """`out` with its record, converted first (into a temporary folder, published whole) by
    `command(folder)` when it is not there yet."""
    record_file = out / "peer.json"
    if record_file.is_file():
        return out, json.loads(record_file.read_text())
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    shown = " ".join(command(out)).replace(sys.executable, "python")
    log(f"converting {what}: {shown}")
    t0 = time.perf_counter()
    logfile = tmp.parent / f"{tmp.name}.log"  # beside the folder the converter writes
    try:
        status = _run_converter(command(tmp), logfile)
        if status != 0:
            tail = logfile.read_text(errors="replace").strip().splitlines()[-5:]
            raise RuntimeError(f"{shown} failed (exit {status}): " + " | ".join(tail))
        shutil.rmtree(tmp / "_builder_cache", ignore_errors=True)
        record = {"command": shown, "seconds": round(time.perf_counter() - t0, 1),
                  "converter": ({"onnxruntime-genai": version("onnxruntime-genai")} if cli is None
                                else {"optimum-cli": str(cli), **_converter_versions(cli)})}
        (tmp / "peer.json").write_text(json.dumps(record, indent=1) + "\n")
        from eagle_deploy.exporter.models import publish_folder

        publish_folder(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        logfile.unlink(missing_ok=True)
    return out, record


class OrtGenaiSystem:
    """onnxruntime-genai greedy decoding of a model-builder folder. Its generator stops at its
    own EOS; `get_next_tokens` includes that EOS, so token counts match the other systems'."""

    def __init__(self, folder: Path, eos_ids: list[int], threads: int, name: str):
        og = importlib.import_module("onnxruntime_genai")
        self.session_options = {"intra_op_num_threads": threads, "inter_op_num_threads": 1}
        config = og.Config(str(folder))
        config.overlay(json.dumps({"model": {"decoder": {"session_options": self.session_options}}}))
        self.og, self.model, self.eos, self.name = og, og.Model(config), set(eos_ids), name

    def run(self, ids: list[int], max_new_tokens: int, temperature: float = 0.0, seed: int | None = 0) -> Run:
        tokens, first = [], None
        t0 = time.perf_counter()
        params = self.og.GeneratorParams(self.model)
        params.set_search_options(do_sample=False, max_length=len(ids) + max_new_tokens)
        gen = self.og.Generator(self.model, params)
        gen.append_tokens(list(ids))
        while not gen.is_done() and len(tokens) < max_new_tokens:
            gen.generate_next_token()
            tokens.append(int(gen.get_next_tokens()[0]))
            first = first or time.perf_counter()
            if tokens[-1] in self.eos:
                break
        seconds = time.perf_counter() - t0
        reason = "stop" if tokens and tokens[-1] in self.eos else "length"
        return Run(self.name, tokens, seconds, None if first is None else (first - t0) * 1e3, reason)


class OpenVinoSystem:
    """OpenVINO GenAI `LLMPipeline` greedy decoding of an optimum-cli export, fed token ids
    (an `ov.Tensor`, so no chat template is applied a second time)."""

    def __init__(self, folder: Path, eos_ids: list[int], threads: int, precision: str, name: str,
                 draft: Path | None = None):
        """draft: an EAGLE-3 draft model's OpenVINO IR: the pipeline then decodes with OpenVINO
        GenAI's EAGLE-3 speculative decoding (settings `OV_EAGLE3`), still greedy and lossless."""
        self.ovg, self.ov = importlib.import_module("openvino_genai"), importlib.import_module("openvino")
        self.properties = {"INFERENCE_NUM_THREADS": threads}
        if precision == "fp32":
            self.properties.update(INFERENCE_PRECISION_HINT="f32", KV_CACHE_PRECISION="f32")
        core = self.ov.Core()
        self.defaults = {k: core.get_property("CPU", k).to_string() for k in ("INFERENCE_PRECISION_HINT",
                                                                              "KV_CACHE_PRECISION")}
        speculative = {} if draft is None else {"draft_model": self.ovg.draft_model(str(draft), "CPU",
                                                                                    **self.properties)}
        self.pipe = self.ovg.LLMPipeline(str(folder), "CPU", **speculative, **self.properties)
        self.speculative = {} if draft is None else dict(OV_EAGLE3)
        self.eos, self.name = [int(e) for e in eos_ids], name
        running = self.ovg.StreamingStatus.RUNNING

        class FirstToken(self.ovg.StreamerBase):  # notes when the first token arrives
            def __init__(s):
                super().__init__()
                s.at = None

            def write(s, token):
                s.at = s.at or time.perf_counter()
                return running

            def end(s):
                pass

        self._streamer = FirstToken

    def run(self, ids: list[int], max_new_tokens: int, temperature: float = 0.0, seed: int | None = 0) -> Run:
        import numpy as np

        config = self.ovg.GenerationConfig()
        config.max_new_tokens, config.do_sample = max_new_tokens, False
        for key, value in self.speculative.items():
            setattr(config, key, value)
        if self.eos:
            config.eos_token_id, config.stop_token_ids = self.eos[0], set(self.eos)
        streamer = self._streamer()
        t0 = time.perf_counter()
        out = self.pipe.generate(self.ov.Tensor(np.asarray([ids], np.int64)), config, streamer)
        seconds = time.perf_counter() - t0
        tokens = [int(t) for t in out.tokens[0]]
        reason = "stop" if tokens and tokens[-1] in self.eos else "length"
        return Run(self.name, tokens, seconds, None if streamer.at is None else (streamer.at - t0) * 1e3, reason)


def make_peer(name: str, hf_dir: Path, eos_ids: list[int], threads: int, log=lambda m: None,
              eagle3_head: Path | None = None):
    """The loaded peer system; `.record` is its JSON record {package, version, precision,
    model_dir, command, converter, decoding, runtime[, speculative]}. The openvino-eagle3-*
    peers draft with `eagle3_head` (ValueError when it is not an EAGLE-3 head)."""
    family, precision = split_name(name)
    folder, built = ensure_model(name, hf_dir, log)
    dist = PACKAGES[family][1]
    record = {"package": dist, "version": version(dist), "precision": precision, "model_dir": str(folder),
              "command": built["command"], "converter": built.get("converter", {}), "decoding": "greedy, vanilla"}
    if family == "ort-genai":
        system = OrtGenaiSystem(folder, eos_ids, threads, name)
        record["runtime"] = {"session_options": system.session_options, "onnxruntime": version("onnxruntime")}
    else:
        draft, drafted = None, None
        if family == "openvino-eagle3":
            problem = eagle3_head_problem(eagle3_head)
            if problem:
                raise ValueError(problem)
            draft, drafted = ensure_draft(eagle3_head, log)
        system = OpenVinoSystem(folder, eos_ids, threads, precision, name, draft)
        record["runtime"] = {"properties": system.properties, "cpu_defaults": system.defaults,
                             "openvino": version("openvino")}
        if draft is None:
            record["speculative"] = NO_SPECULATION
        else:
            record["decoding"] = "greedy, EAGLE-3 speculative decoding (OpenVINO GenAI; lossless)"
            record["speculative"] = {"method": "EAGLE-3", "head": str(eagle3_head), "draft_model_dir": str(draft),
                                     "draft_command": drafted["command"], "generation_config": system.speculative}
    system.record = record
    return system
