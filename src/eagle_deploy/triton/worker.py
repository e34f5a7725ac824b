"""The decode worker behind one Triton model instance: a process of the project's own Python
environment that loads an `EagleRuntime` (graphs, KV buffers, tokenizer) once and serves the
instance's requests one at a time over a pipe.

Why a separate process: the Python-backend stub shipped in nvidia-pytriton 0.7.0 (Triton
2.51) is built with pybind11 2.10, which misreads numpy 2's dtype layout: under numpy 2 every
TYPE_STRING input arrives as its first byte repeated and every output has byte size 0. The
stub therefore runs in a small numpy<2 environment (`eagle_deploy.triton.env`) while this
worker runs in the project's environment (numpy 2, onnxruntime, transformers). Each instance
has its own worker, so runtime and KV state are per instance.

Protocol (one JSON object per line; the worker's stdout carries nothing else, any stray print
goes to stderr, which Triton logs):

    worker -> model   {"ready": true, "backend": "ort", "reason": "...", "pid": 123}
                      or {"fatal": "message"} and exit status 1
    model -> worker   {"op": "generate", "id": 7, "text": "...", "max_tokens": 64, "temperature": 0.0,
                       "top_p": 1.0, "top_k": 0, "seed": null, "stop": ["..."], "stream": true,
                       "min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                       "repetition_penalty": 1.0, "response_format": {...}}   (the last five optional)
                      {"op": "cancel", "id": 7}
    worker -> model   {"id": 7, "delta": "text"}                 (stream only; never half a character)
                      {"id": 7, "done": {"text": ..., "finish_reason": ..., "stats": {...}}}
                      {"id": 7, "error": "message", "invalid": true|false}
                      {"id": 7, "cancelled": true, "started": true, "characters": 12, "seconds": 0.3}

Settings are checked (a `runtime.request.Request` is made) as soon as a request arrives, so a bad
request is answered at once even while another decodes. A cancel stops decoding within one
verification round (the runtime's `Generation.cancel`) and is logged to stderr. EOF on stdin ends the worker.

    python -m eagle_deploy.triton.worker --config '{"engines": "/abs/export", "backend": "auto"}'
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import queue
import sys
import threading
import time
from pathlib import Path
from typing import IO, Callable

from eagle_deploy.contract.tree_config import DEFAULT_DRAFTER

# verify "full": an instance loads once and then serves for its lifetime, so it checks the sha256 of
# every file of the export (contract/verify.py), as eagle-serve does
DEFAULTS = {"backend": "auto", "threads": 0, "tree": None, "acceptance": "lossless", "threshold": 0.3,
            "drafter": "", "name": "eagle", "drafter_kind": DEFAULT_DRAFTER, "planned": True, "verify": "full"}
# worker config keys passed to RuntimeOptions as they are, when given (its defaults otherwise)
RUNTIME_KEYS = ("prefill_graph", "prefix_cache_mb")


# a Request field -> the model's input that carries it (errors name the input)
INPUTS = {"prompt": "text_input", "max_new_tokens": "max_tokens"}


def load_runtime(config: dict, host=None, round_observers=()):
    """-> (EagleRuntime, backend, reason) for a worker config (keys as DEFAULTS plus
    "engines", an export folder). threads 0 = onnxruntime's default. verify: "full" by
    default (every file's sha256 against the manifest before the graphs open). drafter_kind / planned: as
    EagleRuntime.load's (default: the commands' hybrid, planned). drafter "module:callable"
    replaces the EAGLE head: callable(folder, manifest, tree, threads) -> a runtime Drafter.
    round_observers: passed to the runtime (tests).
    Raises ValueError (bad setting, backend unavailable), ManifestError, FileNotFoundError."""
    from eagle_deploy.contract.manifest import Manifest
    from eagle_deploy.contract.tree_config import TreeConfig
    from eagle_deploy.runtime.api import EagleRuntime
    from eagle_deploy.runtime.options import RuntimeOptions

    from .select import probe_host, select_backend

    config = {**DEFAULTS, **config}
    folder = Path(config["engines"])
    manifest = Manifest.load(folder)
    backend, reason = select_backend(config["backend"], manifest, host or probe_host())
    tree = TreeConfig.from_json(config["tree"]) if config["tree"] else None
    threads = int(config["threads"]) or None
    drafter = None
    if config["drafter"]:
        module, _, attr = str(config["drafter"]).partition(":")
        factory = getattr(importlib.import_module(module), attr or "make_drafter")
        drafter = factory(folder, manifest, (tree or manifest.tree), threads)
    threshold = float(config["threshold"]) if config["acceptance"] == "threshold" else None
    options = RuntimeOptions(backend=backend, tree=tree, threads=threads, acceptance=config["acceptance"],
                            threshold=threshold, drafter_kind=str(config["drafter_kind"]),
                            planned=bool(config["planned"]), verify=str(config["verify"]),  # files vs manifest
                            **{k: config[k] for k in RUNTIME_KEYS if k in config})
    rt = EagleRuntime.load(folder, options, drafter=drafter, round_observers=round_observers)
    return rt, backend, reason


class Worker:
    """Serves requests for one runtime. `emit(obj)` writes one protocol message (thread-safe);
    `log(line)` writes a diagnostic line. `feed(line)` takes one input line (reader thread);
    `serve()` decodes queued requests until `feed` saw EOF (line None)."""

    def __init__(self, runtime, emit: Callable[[dict], None], log: Callable[[str], None], name: str = "eagle"):
        self.rt, self.emit, self.log, self.name = runtime, emit, log, name
        self.queue: queue.Queue = queue.Queue()
        self.cancelled: set = set()
        self.current = None  # the id being decoded
        self.generation = None  # its runtime Generation (cancel() stops it)
        self._lock = threading.Lock()

    def feed(self, line: str | None) -> None:
        """One line from the model (None = EOF). Malformed lines are logged and dropped."""
        from eagle_deploy.contract.errors import SettingError
        from eagle_deploy.runtime.request import Request

        if line is None:
            self.queue.put(None)
            return
        try:
            msg = json.loads(line)
            op, rid = msg["op"], msg["id"]
        except (ValueError, KeyError, TypeError):
            self.log(f"ignoring a malformed message: {line[:200]!r}")
            return
        if op == "cancel":
            with self._lock:
                self.cancelled.add(rid)
                if self.current == rid and self.generation is not None:
                    self.generation.cancel()  # the runtime stops before its next round
            return
        if op != "generate":
            self.emit({"id": rid, "error": f"unknown op {op!r}", "invalid": True})
            return
        try:
            msg["request"] = Request(msg.get("text") if isinstance(msg.get("text"), str) else "",
                                     msg.get("max_tokens"), msg.get("temperature", 0.0), msg.get("top_p", 1.0),
                                     msg.get("top_k", 0), msg.get("seed"), msg.get("stop") or (),
                                     min_p=msg.get("min_p", 0.0), presence_penalty=msg.get("presence_penalty", 0.0),
                                     frequency_penalty=msg.get("frequency_penalty", 0.0),
                                     repetition_penalty=msg.get("repetition_penalty", 1.0),
                                     response_format=msg.get("response_format"))
            self.rt.grammar_for(msg["request"])  # a schema the grammar engine refuses: answered at once
        except SettingError as err:  # named as the model's inputs name it (max_tokens, not max_new_tokens)
            field = INPUTS.get(err.field.partition("[")[0])
            message = err.named(field + err.field[len(err.field.partition("[")[0]):]) if field else str(err)
            self.emit({"id": rid, "error": " ".join(message.split()), "invalid": True})
            return
        self.queue.put(msg)

    def is_cancelled(self, rid) -> bool:
        with self._lock:
            return rid in self.cancelled

    def serve(self) -> None:
        while True:
            msg = self.queue.get()
            if msg is None:
                return
            self.run(msg)

    def run(self, msg: dict) -> None:
        """Decode one validated request, emitting its deltas and exactly one closing message
        (done, error or cancelled)."""
        rid = msg["id"]
        try:
            if self.is_cancelled(rid):
                self.log(f"request {rid} cancelled before it started")
                self.emit({"id": rid, "cancelled": True, "started": False, "characters": 0, "seconds": 0.0})
                return
            t0 = time.perf_counter()
            gen = self.rt.stream(msg["request"])
            with self._lock:
                self.current, self.generation = rid, gen
                if rid in self.cancelled:
                    gen.cancel()
            sent = 0
            for delta in gen:
                sent += len(delta)
                if msg.get("stream") and not gen.cancelled:
                    self.emit({"id": rid, "delta": delta})
            result = gen.result
            if result.finish_reason == "cancelled":
                seconds = round(time.perf_counter() - t0, 4)
                self.log(f"request {rid} cancelled after {sent} characters ({seconds:.3f} s); decoding stopped")
                self.emit({"id": rid, "cancelled": True, "started": True, "characters": sent, "seconds": seconds})
                return
            self.emit({"id": rid, "done": {"text": result.text, "finish_reason": result.finish_reason,
                                           "stats": result.stats.to_json()}})
        except ValueError as err:  # a prompt the export cannot take (too long, ...)
            self.emit({"id": rid, "error": " ".join(str(err).split()), "invalid": True})
        except Exception as err:  # noqa: BLE001 - reported to the client, the worker keeps serving
            self.log(f"request {rid} failed: {type(err).__name__}: {err}")
            self.emit({"id": rid, "error": f"internal error: {type(err).__name__}: {err}", "invalid": False})
        finally:
            with self._lock:
                self.current = self.generation = None
                self.cancelled.discard(rid)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="eagle-triton-worker", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="JSON object: engines, backend, threads, tree, acceptance, ...")
    args = p.parse_args(argv)
    # the protocol owns the original stdout; anything else printed (library warnings) goes to stderr
    proto: IO[str] = os.fdopen(os.dup(1), "w", encoding="utf-8", buffering=1)
    os.dup2(2, 1)
    lock = threading.Lock()

    def emit(obj: dict) -> None:
        line = json.dumps(obj, ensure_ascii=False)
        with lock:
            proto.write(line + "\n")
            proto.flush()

    config = json.loads(args.config)
    name = f"{config.get('name', 'eagle')}[{os.getpid()}]"

    def log(line: str) -> None:
        print(f"eagle-triton-worker {name}: {line}", file=sys.stderr, flush=True)

    try:
        rt, backend, reason = load_runtime(config)
    except Exception as err:  # noqa: BLE001 - reported to the model, which fails its load with it
        emit({"fatal": f"{type(err).__name__}: {' '.join(str(err).split())}"})
        return 1
    log(f"loaded {config['engines']} on backend {backend} ({reason})")
    worker = Worker(rt, emit, log, name)
    emit({"ready": True, "backend": backend, "reason": reason, "pid": os.getpid()})

    def read() -> None:
        for line in sys.stdin:
            if line.strip():
                worker.feed(line)
        worker.feed(None)

    threading.Thread(target=read, name="stdin-reader", daemon=True).start()
    worker.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
