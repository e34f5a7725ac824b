"""The systems eagle-bench times, one small class each behind `run(ids, max_new_tokens,
temperature, seed) -> Run`: EAGLE and vanilla decoding on one EagleRuntime, transformers'
`generate()` (plain greedy and prompt-lookup), llama.cpp through llama-cpp-python (plain and
its `LlamaPromptLookupDecoding`), and the peer runtimes of bench/peers.py (onnxruntime-genai,
OpenVINO GenAI). Every system gets the same prompt token ids (the export's
chat template applied once) and the same thread count.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import signal
import subprocess
import sys
import time
from pathlib import Path

from eagle_deploy.runtime import memory as _memory

from .peers import PEERS
from .timed import Run

BASELINES = ("hf", "hf-lookup", "llamacpp", "llamacpp-lookup",
             *(f"{family}-{p}" for family, precisions in PEERS.items() for p in precisions))
LOOKUP_TOKENS = 10  # draft tokens per prompt-lookup step (HF prompt_lookup_num_tokens, llama.cpp num_pred_tokens)


def rss_mb() -> float:
    """Current resident set (MiB): runtime/memory.py's `rss_mb`, but eagle-bench needs it, so
    without psutil this raises ImportError naming the `[bench]` extra instead of returning None.
    (The peak: runtime/memory.py's `peak_rss_mb`, VmHWM on Linux.)"""
    mb = _memory.rss_mb()
    if mb is None:
        raise ImportError("eagle-bench needs psutil to measure memory: pip install 'eagle-deploy[bench]'")
    return mb


class EagleSystem:
    """EAGLE (mode "eagle") or plain one-token-per-forward decoding (mode "vanilla") on the
    same engine and KV buffers."""

    def __init__(self, runtime, mode: str, name: str | None = None):
        self.rt, self.mode, self.name = runtime, mode, name or mode

    def run(self, ids: list[int], max_new_tokens: int, temperature: float = 0.0, seed: int | None = 0) -> Run:
        r = self.rt.generate(list(ids), max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                             mode=self.mode)
        s = r.stats.to_json()
        keep = {k: s[k] for k in ("mean_accept_len", "target_forwards", "draft_forwards", "time_ms",
                                  "accepted_per_round", "tree_depth_per_round", "tree_size_per_round",
                                  "draft_rounds")}
        return Run(self.name, list(r.token_ids), r.stats.t_total, r.stats.t_prefill * 1e3, r.finish_reason, keep)


class _FirstToken:
    """A transformers streamer that notes when the first generated token arrives (the first
    `put` is the prompt itself)."""

    def __init__(self):
        self.puts, self.first = 0, None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2 and self.first is None:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


class HfSystem:
    """transformers `generate()` on the export's own checkpoint: greedy, or prompt-lookup
    decoding (`prompt_lookup_num_tokens`). Greedy only (baselines are not run sampled)."""

    def __init__(self, hf_model, eos_ids: list[int], threads: int, lookup: int = 0, name: str = "hf"):
        self.hf, self.eos, self.threads, self.lookup, self.name = hf_model, list(eos_ids), threads, lookup, name

    def run(self, ids: list[int], max_new_tokens: int, temperature: float = 0.0, seed: int | None = 0) -> Run:
        import torch

        torch.set_num_threads(self.threads)
        x = torch.tensor([list(ids)], dtype=torch.long)
        kw = dict(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=self.eos or None,
                  pad_token_id=self.eos[0] if self.eos else None, temperature=None, top_p=None, top_k=None)
        if self.lookup:
            kw["prompt_lookup_num_tokens"] = self.lookup
        streamer = _FirstToken()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = self.hf.generate(x, attention_mask=torch.ones_like(x), streamer=streamer, **kw)
        seconds = time.perf_counter() - t0
        new = out[0, len(ids):].tolist()
        reason = "stop" if new and new[-1] in self.eos else "length"
        ttft = None if streamer.first is None else (streamer.first - t0) * 1e3
        return Run(self.name, new, seconds, ttft, reason)


class LlamaCppSystem:
    """llama.cpp on the export's GGUF file through llama-cpp-python: plain decoding, or its
    prompt-lookup speculation (`LlamaPromptLookupDecoding`). `record` (the JSON's baseline
    entry): package version, GGUF path, decoding, threads, and llama.cpp's own build line
    (`llama_print_system_info`: the CPU features and backends it was compiled with, which set
    its speed: a pip build compiles for the machine it runs on)."""

    def __init__(self, gguf: Path, eos_ids: list[int], threads: int, n_ctx: int, lookup: int = 0,
                 name: str = "llamacpp", extra_buffers: bool = True):
        llama_cpp = importlib.import_module("llama_cpp")
        draft = None
        if lookup:
            spec = importlib.import_module("llama_cpp.llama_speculative")
            draft = spec.LlamaPromptLookupDecoding(num_pred_tokens=lookup)
        with contextlib.nullcontext() if extra_buffers else _without_extra_buffers():
            self.llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                                       draft_model=draft, verbose=False, seed=0)
        self.eos, self.name = set(eos_ids), name
        info = getattr(llama_cpp, "llama_print_system_info", None)
        build = info() if info is not None else None
        version = getattr(llama_cpp, "__version__", None)
        self.record = {"package": "llama-cpp-python", "version": version, "precision": f"GGUF {Path(gguf).name}",
                       "command": f"pip install llama-cpp-python{'==' + version if version else ''} (compiled on the "
                                  "machine that runs it)",
                       "gguf": str(gguf), "decoding": f"greedy, prompt lookup ({lookup} tokens)" if lookup
                       else "greedy, vanilla",
                       "runtime": {"n_threads": threads, "n_ctx": n_ctx, "use_extra_bufts": extra_buffers},
                       "build": build.decode(errors="replace").strip() if isinstance(build, bytes) else build}

    def run(self, ids: list[int], max_new_tokens: int, temperature: float = 0.0, seed: int | None = 0) -> Run:
        self.llm.reset()  # no prompt-prefix reuse across requests (each request prefills, as the others do)
        tokens, first, reason = [], None, "length"
        t0 = time.perf_counter()
        for tok in self.llm.generate(list(ids), temp=temperature, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0,
                                     reset=True):
            if first is None:
                first = time.perf_counter()
            tokens.append(int(tok))
            if int(tok) in self.eos:
                reason = "stop"
                break
            if len(tokens) >= max_new_tokens:
                break
        seconds = time.perf_counter() - t0
        return Run(self.name, tokens, seconds, None if first is None else (first - t0) * 1e3, reason)


@contextlib.contextmanager
def _without_extra_buffers():
    """Load llama.cpp models with `use_extra_bufts` off (llama.cpp's --no-repack: no AMX or
    repacked weight buffers). llama-cpp-python's `Llama` has no argument for it; its constructor
    takes `llama_model_default_params()` from its own module, so that one function is wrapped
    while a model loads, and restored after."""
    module = importlib.import_module("llama_cpp.llama").llama_cpp
    default = module.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    module.llama_model_default_params = params
    try:
        yield
    finally:
        module.llama_model_default_params = default


_LLAMACPP_PROBE = """
import sys
from pathlib import Path
from eagle_deploy.bench.systems import LlamaCppSystem
system = LlamaCppSystem(Path(sys.argv[1]), [], int(sys.argv[2]), 64, extra_buffers=sys.argv[3] == "1")
system.run([1, 2, 3, 4, 5, 6, 7, 8], 4)
"""


@functools.lru_cache(maxsize=None)
def llamacpp_crash(gguf: Path, threads: int, extra_buffers: bool, timeout_s: float = 300.0) -> str | None:
    """How llama.cpp died decoding 4 tokens from `gguf` in a child process ("SIGSEGV"), or None
    when it did not die by a signal. Some llama.cpp builds segfault in their AMX matmul on some
    AMX CPUs (ggml-org/llama.cpp#20824; seen here with llama-cpp-python 0.3.36 on a 2-core
    Xeon with amx_int8), which would kill the whole eagle-bench process, EAGLE numbers and all.
    Any other failure (an import error, a bad file) is left to the real load, which reports it.
    Remembered per process, so llamacpp and llamacpp-lookup in one run probe once."""
    cmd = [sys.executable, "-c", _LLAMACPP_PROBE, str(gguf), str(threads), "1" if extra_buffers else "0"]
    try:
        done = subprocess.run(cmd, capture_output=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"no 4 tokens in {timeout_s:.0f} s"
    if done.returncode >= 0:
        return None
    try:
        return signal.Signals(-done.returncode).name
    except ValueError:
        return f"signal {-done.returncode}"


def baseline_unavailable(name: str, manifest, eagle3_head: Path | None = None) -> str | None:
    """Why baseline `name` cannot run here (None when it can). eagle3_head: the EAGLE-3 head
    the openvino-eagle3-* peers draft with (bench --eagle3-head)."""
    from eagle_deploy.exporter.sources import target_source

    if name.startswith("llamacpp"):
        if importlib.util.find_spec("llama_cpp") is None:
            return ("llama-cpp-python is not installed (pip install '.[llamacpp]' in the repository; "
                    "it compiles llama.cpp, ~6 min): skipped")
        src = target_source(manifest)
        if src is None or src.suffix != ".gguf" or not src.is_file():
            return f"the export's target ({src}) is not a GGUF file llama.cpp can load: skipped"
    if name.startswith(tuple(PEERS)):
        from eagle_deploy.exporter.sources import ReferenceLoadError, target_checkpoint_dir

        from . import peers

        reason = peers.unavailable(name, eagle3_head=eagle3_head)
        if reason:
            return reason
        try:
            return peers.unavailable(name, target_checkpoint_dir(manifest), eagle3_head)
        except ReferenceLoadError as err:
            return f"{err}: skipped"
    return None


def make_baseline(name: str, manifest, threads: int, hf_model=None, log=lambda m: None,
                  eagle3_head: Path | None = None):
    """A baseline system by name (see BASELINES). `hf_model` is loaded once and shared. A peer
    (bench/peers.py) is converted on first use and carries its JSON record as `.record`;
    the openvino-eagle3-* peers draft with `eagle3_head`."""
    from eagle_deploy.exporter.sources import target_checkpoint_dir, target_source

    eos = list(manifest.eos_token_ids)
    if name == "hf":
        return HfSystem(hf_model, eos, threads, 0, "hf")
    if name == "hf-lookup":
        return HfSystem(hf_model, eos, threads, LOOKUP_TOKENS, "hf-lookup")
    if name in ("llamacpp", "llamacpp-lookup"):
        gguf = target_source(manifest)
        crash = llamacpp_crash(gguf, threads, extra_buffers=True)
        note = ""
        if crash:
            note = (f"llama.cpp crashed in a probe process with its extra weight buffers (AMX / repacked "
                    f"weights; {crash}; ggml-org/llama.cpp#20824 is this crash on AMX CPUs): timed with "
                    f"them off (use_extra_bufts=False, llama.cpp's --no-repack)")
            log(f"note: baseline {name}: {note}")
            again = llamacpp_crash(gguf, threads, extra_buffers=False)
            if again:
                raise RuntimeError(f"llama.cpp crashes on this machine with and without its extra weight "
                                   f"buffers ({again}) in a probe process")
        system = LlamaCppSystem(gguf, eos, threads, manifest.max_length,
                                LOOKUP_TOKENS if name.endswith("lookup") else 0, name, extra_buffers=not crash)
        system.record["note"] = note
        return system
    if name in BASELINES and name.startswith(tuple(PEERS)):
        from .peers import make_peer

        return make_peer(name, target_checkpoint_dir(manifest), eos, threads, log, eagle3_head)
    raise ValueError(f"unknown baseline {name!r}; choose from {', '.join(BASELINES)}")
