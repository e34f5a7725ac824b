"""Triton Python-backend model for EAGLE decoding (decoupled: it streams).

`eagle_deploy.triton.repo` copies this file verbatim into `<repository>/<model>/1/model.py`.
It runs inside Triton's Python-backend stub and imports only the standard library, numpy and
`triton_python_backend_utils`, so the stub's environment needs nothing but numpy<2 (see
`worker.py` for why the stub cannot use numpy 2). Each model instance starts its own decode
worker (`python -m eagle_deploy.triton.worker`, in the project's environment, named by the
`worker_python` parameter), which loads the runtime once: runtime and KV state are per
instance, and requests on one instance run one at a time (`execute` blocks until its request
ends, so Triton's scheduler hands the next request to an idle instance and queues the rest).

Inputs (names as in the TensorRT-LLM / vLLM backends' generate endpoints; all [1] but `stop`):
  text_input (STRING, required: the user message; the export's chat template is applied),
  max_tokens (INT32 >= 1, default: parameter default_max_tokens), stream (BOOL, default false),
  temperature (FP32 >= 0, 0 = greedy), top_p (FP32 in (0, 1]), top_k (INT32 >= 0, 0 = off),
  seed (UINT64), min_p, presence_penalty, frequency_penalty, repetition_penalty (FP32: the
  runtime Request's ranges; each keeps EAGLE's output equal to vanilla's under the same
  settings), stop (STRING [-1]: stop strings; the text ends before the first; empty strings
  are ignored), response_format (STRING: OpenAI's response_format as JSON text, e.g.
  '{"type": "json_schema", "json_schema": {...}}': the output follows that grammar, exactly as
  vanilla decoding under it would), exclude_input_in_output (BOOL, default false: a non-streamed text_output is
  text_input + the generated text; streamed deltas never include the input).
Outputs: text_output (STRING [-1]); on the final response only: finish_reason (STRING: "stop"
  | "length"), prompt_tokens, new_tokens, target_forwards (INT32), mean_accept_len (FP32, tau:
  tokens committed per target forward), stats (STRING: the runtime's Stats JSON; its
  "speculative" field holds the request's vLLM-style spec_decode counts, as eagle-serve's
  usage.speculative).

Responses: stream false -> one response carrying everything, flagged FINAL. stream true -> one
response per text delta (as tokens are committed; never half a UTF-8 character; the deltas
concatenate to the non-streamed text), then one final response with text_output "" and the
stats, flagged FINAL. Exactly one FINAL flag per request. A bad request (empty text_input,
max_tokens < 1, a NaN temperature, ...) gets one error response flagged FINAL; the instance
keeps serving. A cancelled request (client gone: `response_sender.is_cancelled()`, polled every
`cancel_poll_s`) stops decoding and gets a bare FINAL flag. The sender is dropped after FINAL.
A wedged decode worker (nothing from it for `stall_timeout_s` while a request runs, or no end
`cancel_grace_s` after a cancel) is killed: that request gets an error response flagged FINAL
and the next request starts a fresh worker, so the instance never hangs on it.
"""
import json
import os
import select
import subprocess
import sys
import time

import numpy as np
import triton_python_backend_utils as pb_utils

OUTPUT_DTYPES = {"text_output": np.object_, "finish_reason": np.object_, "stats": np.object_,
                 "prompt_tokens": np.int32, "new_tokens": np.int32, "target_forwards": np.int32,
                 "mean_accept_len": np.float32}
PARAMETER_DEFAULTS = {"engines": "", "worker_python": sys.executable, "worker_pythonpath": "", "backend": "auto",
                      "threads": "auto", "tree": "", "acceptance": "lossless", "threshold": "0.3", "drafter": "",
                      "default_max_tokens": "128", "load_timeout_s": "900", "cancel_poll_s": "0.05",
                      "stall_timeout_s": "600", "cancel_grace_s": "10",
                      # contract.tree_config.DEFAULT_DRAFTER (this file runs in the stub's venv, without the package)
                      "drafter_kind": "hybrid", "always_draft": "false",
                      # runtime.options.RuntimeOptions' defaults
                      "prefill_graph": "auto", "prefix_cache_mb": "0"}


class BadRequest(ValueError):
    """A request this model refuses (answered with an error response)."""


class WorkerGone(RuntimeError):
    """The decode worker exited or broke the protocol."""


class WorkerStalled(WorkerGone):
    """The decode worker is alive but wedged: silent too long, or deaf to a cancel."""


def parameters(model_config: dict) -> dict:
    """config.pbtxt `parameters` (string values) over PARAMETER_DEFAULTS."""
    given = {k: v.get("string_value", "") for k, v in (model_config.get("parameters") or {}).items()}
    return {**PARAMETER_DEFAULTS, **{k: v for k, v in given.items() if k in PARAMETER_DEFAULTS}}


def _values(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else np.asarray(tensor.as_numpy()).reshape(-1)


def _text(value, name: str) -> str:
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise BadRequest(f"{name} is not valid UTF-8") from None
    return str(value)


def _scalar(request, name: str, kind):
    values = _values(request, name)
    if values is None:
        return None
    if values.size != 1:
        raise BadRequest(f"{name} must hold exactly one value, got {values.size}")
    value = values[0]
    if kind is str:
        return _text(value, name)
    if kind is bool:
        return bool(value)
    if kind is int:
        return int(value)
    return float(value)


def parse_request(request, default_max_tokens: int) -> dict:
    """Triton request -> worker "generate" message fields (without id). Raises BadRequest."""
    text = _scalar(request, "text_input", str)
    if text is None or not text.strip():
        raise BadRequest("text_input is missing or empty")
    max_tokens = _scalar(request, "max_tokens", int)
    stops = _values(request, "stop")
    stop = [s for s in (_text(v, "stop") for v in (stops if stops is not None else ())) if s]
    msg = {"text": text, "max_tokens": default_max_tokens if max_tokens is None else max_tokens,
           "stream": bool(_scalar(request, "stream", bool)), "stop": stop,
           "exclude_input_in_output": bool(_scalar(request, "exclude_input_in_output", bool))}
    response_format = _scalar(request, "response_format", str)
    if response_format:
        try:
            msg["response_format"] = json.loads(response_format)
        except ValueError as err:
            raise BadRequest(f"response_format is not JSON ({err})") from None
    for name, kind in (("temperature", float), ("top_p", float), ("top_k", int), ("seed", int), ("min_p", float),
                       ("presence_penalty", float), ("frequency_penalty", float), ("repetition_penalty", float)):
        value = _scalar(request, name, kind)
        if value is not None:
            msg[name] = value
    return msg


def response(text: str, final: dict | None = None):
    """An InferenceResponse: text_output, plus the stats outputs when `final` (a worker
    "done" message body) is given."""
    values = {"text_output": [text.encode("utf-8")]}
    if final is not None:
        stats = final.get("stats") or {}
        values.update(finish_reason=[str(final.get("finish_reason") or "").encode()],
                      prompt_tokens=[stats.get("prompt_tokens", 0)], new_tokens=[stats.get("new_tokens", 0)],
                      target_forwards=[stats.get("target_forwards", 0)],
                      mean_accept_len=[stats.get("mean_accept_len", 0.0)],
                      stats=[json.dumps(stats).encode()])
    return pb_utils.InferenceResponse(output_tensors=[
        pb_utils.Tensor(name, np.array(v, dtype=OUTPUT_DTYPES[name])) for name, v in values.items()])


def error_response(message: str):
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message))


class WorkerProcess:
    """One decode worker: a child process speaking the JSON-lines protocol of worker.py."""

    def __init__(self, argv: list, env: dict, load_timeout_s: float):
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self._buffer = b""
        ready = self.read(load_timeout_s)
        if ready is None:
            self.close()
            raise WorkerGone(f"the decode worker did not start within {load_timeout_s:.0f} s")
        if not ready.get("ready"):
            self.close()
            raise WorkerGone(f"the decode worker failed to load: {ready.get('fatal', ready)}")
        self.backend, self.reason = ready.get("backend"), ready.get("reason")

    def send(self, obj: dict) -> None:
        try:
            self.proc.stdin.write((json.dumps(obj) + "\n").encode("utf-8"))
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            raise WorkerGone("the decode worker exited") from None

    def read(self, timeout: float):
        """The next message, or None when none arrived within `timeout` seconds. Raises
        WorkerGone at EOF or on a line that is not a JSON object."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            if not ready:
                return None
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
            if not chunk:
                raise WorkerGone(f"the decode worker exited (status {self.proc.poll()})")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        try:
            msg = json.loads(line)
        except ValueError:
            raise WorkerGone(f"the decode worker wrote a non-protocol line: {line[:200]!r}") from None
        if not isinstance(msg, dict):
            raise WorkerGone(f"the decode worker wrote a non-protocol line: {line[:200]!r}")
        return msg

    def close(self, timeout: float = 10.0) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class TritonPythonModel:
    """The model (one object per instance). See the module docstring for the interface."""

    def initialize(self, args):
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException("this model streams: its config needs "
                                                "model_transaction_policy { decoupled: true }")
        self.params = p = parameters(config)
        self.name = f"{args.get('model_name', 'eagle')}/{args.get('model_instance_name', '?')}"
        version_dir = os.path.join(args.get("model_repository", "."), str(args.get("model_version", "1")))
        engines = p["engines"] if os.path.isabs(p["engines"]) else os.path.join(version_dir, p["engines"])
        count = sum(int(g.get("count", 1)) for g in config.get("instance_group") or [{}]) or 1
        threads = p["threads"]
        if threads == "auto":  # share the cores this process may use between the instances
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
            threads = str(max(1, cores // count))
        self.default_max_tokens = int(p["default_max_tokens"])
        self.cancel_poll_s = float(p["cancel_poll_s"])
        self.stall_timeout_s, self.cancel_grace_s = float(p["stall_timeout_s"]), float(p["cancel_grace_s"])
        worker_config = {"engines": engines, "backend": p["backend"], "threads": int(threads),
                         "tree": json.loads(p["tree"]) if p["tree"] else None, "acceptance": p["acceptance"],
                         "threshold": float(p["threshold"]), "drafter": p["drafter"], "name": self.name,
                         "drafter_kind": p["drafter_kind"], "planned": p["always_draft"].lower() != "true",
                         "prefill_graph": p["prefill_graph"], "prefix_cache_mb": float(p["prefix_cache_mb"])}
        self.argv = [p["worker_python"], "-m", "eagle_deploy.triton.worker", "--config", json.dumps(worker_config)]
        self.env = dict(os.environ)
        # the stub's environment is not the worker's: do not leak its venv into the worker
        for key in ("VIRTUAL_ENV", "PYTHONHOME", "PYTHONPATH"):
            self.env.pop(key, None)
        if p["worker_pythonpath"]:
            self.env["PYTHONPATH"] = p["worker_pythonpath"]
        if args.get("model_instance_kind") == "GPU":
            self.env["CUDA_VISIBLE_DEVICES"] = str(args.get("model_instance_device_id", 0))
        self.load_timeout_s = float(p["load_timeout_s"])
        self.worker = None
        self.worker = self._start()
        self.next_id = 0

    def _start(self) -> WorkerProcess:
        worker = WorkerProcess(self.argv, self.env, self.load_timeout_s)
        pb_utils.Logger.log_info(f"{self.name}: decode worker pid {worker.proc.pid} on backend "
                                 f"{worker.backend} ({worker.reason})")
        return worker

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                self._serve(request, sender)
            except Exception as err:  # noqa: BLE001 - never leave a request without its FINAL flag
                pb_utils.Logger.log_error(f"{self.name}: {type(err).__name__}: {err}")
                try:
                    sender.send(error_response(f"internal error: {type(err).__name__}: {err}"),
                                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                except Exception:  # noqa: BLE001 - the FINAL flag had already been sent
                    pass
            finally:
                del sender  # released after its FINAL flag
        return None

    def _serve(self, request, sender) -> None:
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            msg = parse_request(request, self.default_max_tokens)
        except BadRequest as err:
            sender.send(error_response(str(err)), flags=final)
            return
        except Exception as err:  # noqa: BLE001 - a malformed tensor, e.g. a non-numeric value
            sender.send(error_response(f"bad request: {type(err).__name__}: {err}"), flags=final)
            return
        try:
            if self.worker is None or self.worker.proc.poll() is not None:
                self.worker = self._start()
            self.next_id += 1
            rid = self.next_id
            exclude = msg.pop("exclude_input_in_output")
            prefix = "" if msg["stream"] or exclude else msg["text"]
            self.worker.send({"op": "generate", "id": rid, **msg})
            self._relay(rid, msg["stream"], prefix, sender)
        except WorkerGone as err:
            pb_utils.Logger.log_error(f"{self.name}: {err}; restarting it for the next request")
            if self.worker is not None:
                self.worker.close(timeout=0.0 if isinstance(err, WorkerStalled) else 1.0)
            self.worker = None
            sender.send(error_response(f"internal error: {err}"), flags=final)

    def _relay(self, rid: int, stream: bool, prefix: str, sender) -> None:
        """Forward the worker's messages for request `rid` until its closing message; poll
        `sender.is_cancelled()` meanwhile and forward a cancel once. Raises WorkerStalled when
        the worker sends nothing for stall_timeout_s, or does not end the request within
        cancel_grace_s of the cancel."""
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        cancel_sent, polled, cancelled_at = False, 0.0, 0.0
        heard = time.monotonic()  # the worker's last message
        while True:
            now = time.monotonic()
            if now - heard > self.stall_timeout_s:
                raise WorkerStalled(f"the decode worker sent nothing for {self.stall_timeout_s:g} s "
                                    "(stall_timeout_s)")
            if cancel_sent and now - cancelled_at > self.cancel_grace_s:
                raise WorkerStalled(f"the decode worker did not stop within {self.cancel_grace_s:g} s of a cancel "
                                    "(cancel_grace_s)")
            # poll before waiting, so a client already gone is seen before the worker can finish
            if not cancel_sent and time.monotonic() - polled >= self.cancel_poll_s:  # one IPC per poll
                polled = time.monotonic()
                if sender.is_cancelled():
                    self.worker.send({"op": "cancel", "id": rid})
                    cancel_sent, cancelled_at = True, time.monotonic()
            msg = self.worker.read(self.cancel_poll_s)
            if msg is not None:
                heard = time.monotonic()
            if msg is None or msg.get("id") != rid:
                continue  # poll timeout, or a late message of an earlier request
            if "delta" in msg:
                if stream and not cancel_sent:
                    sender.send(response(msg["delta"]))
            elif "done" in msg:
                done = msg["done"]
                text = "" if stream else prefix + done["text"]
                sender.send(response(text, done), flags=final)
                return
            elif "error" in msg:
                sender.send(error_response(msg["error"]), flags=final)
                return
            elif msg.get("cancelled"):
                sender.send(flags=final)
                when = (f"after {msg.get('characters', 0)} characters, {msg.get('seconds', 0.0)} s"
                        if msg.get("started") else "before it started")
                pb_utils.Logger.log_info(f"{self.name}: request cancelled by the client; decoding stopped {when}")
                return

    def finalize(self):
        if self.worker is not None:
            self.worker.close()
            self.worker = None
