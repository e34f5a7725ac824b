"""A real Triton Inference Server (the tritonserver of the nvidia-pytriton wheel, CPU only) over
a repository written from the tiny export: HTTP generate / generate_stream (as curl would send
them) and tritonclient gRPC streaming. Greedy output equals EagleRuntime.generate; streamed
equals non-streamed; 2 instances x 8 concurrent requests; stops and max_tokens inside accepted
multi-token chunks (an oracle drafter plugin); bad requests; cancellation; unload + reload.

One server for the module, models "eagle" (2 instances, the export's random EAGLE head) and
"oracle" (1 instance, tests/triton/oracle.py proposes the target's own greedy continuation),
started with --model-control-mode=explicit. Without the wheel the module is skipped with the
reason locally and FAILS under CI (CI=true), where `make setup` installs it."""
from __future__ import annotations

import json
import math
import os
import queue
import re
import socket
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from eagle_deploy.triton import repo as triton_repo
from tests.triton.conftest import ROOT

# a real tritonserver for the module (~30 s on 2 cores): in `make test`, not `make test-fast`
pytestmark = [pytest.mark.triton, pytest.mark.slow, pytest.mark.timeout(300)]

PROMPTS = ["def add(a, b):", "Hello there, how are you?", "for i in range(10): print(i)", "The quick brown fox",
           "import numpy as np", "Once upon a time", "x = [1, 2, 3]", "What is EAGLE?"]


def _server_or_skip():
    from eagle_deploy.triton.serve import TritonUnavailable, wheel_root

    try:
        wheel_root()
        import tritonclient.grpc  # noqa: F401
    except (TritonUnavailable, ImportError) as err:
        reason = f"Triton server tests need nvidia-pytriton and tritonclient (`make setup` installs them): {err}"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    _server_or_skip()
    from eagle_deploy.triton.serve import TritonServer

    root = tmp_path_factory.mktemp("triton")
    repo = root / "repo"
    triton_repo.write_repo(tiny, repo, name="eagle", instances=2, threads=1)
    triton_repo.write_repo(tiny, repo, name="oracle", instances=1, threads=1,
                           drafter="tests.triton.oracle:make_drafter", worker_pythonpath=str(ROOT))
    triton_repo.write_repo(tiny, repo, name="paced", instances=1, threads=1,
                           drafter="tests.triton.oracle:make_paced_drafter", worker_pythonpath=str(ROOT))
    srv = TritonServer(repo, root / "triton.log", timeout=240,
                       extra=["--model-control-mode=explicit", "--load-model=eagle", "--load-model=oracle",
                              "--load-model=paced"])
    srv.start()
    yield srv
    srv.stop()
    print(f"\ntritonserver log: {srv.log_path}")


# ------------------------------------------------------------------------------------ clients


def http(server, path: str, body: dict | None = None, timeout: float = 60) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://{server.http_url}{path}", data=data, method="POST" if data or
                                 path.endswith(("load", "unload")) else "GET")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def generate(server, model="eagle", **body) -> dict:
    """POST /v2/models/MODEL/generate -> the JSON answer (raises on an HTTP error)."""
    status, data = http(server, f"/v2/models/{model}/generate", body)
    assert status == 200, (status, data)
    return json.loads(data)


def generate_stream(server, model="eagle", **body) -> list[dict]:
    """POST /v2/models/MODEL/generate_stream -> the server-sent events' JSON objects."""
    req = urllib.request.Request(f"http://{server.http_url}/v2/models/{model}/generate_stream",
                                 data=json.dumps(body).encode(), method="POST")
    events = []
    with urllib.request.urlopen(req, timeout=60) as r:
        for line in r:
            if line.startswith(b"data: "):
                events.append(json.loads(line[6:]))
    return events


def grpc_inputs(text, **kw):
    import tritonclient.grpc as grpcclient

    types_ = {"max_tokens": np.int32, "top_k": np.int32, "seed": np.uint64, "temperature": np.float32,
              "top_p": np.float32, "stream": np.bool_, "exclude_input_in_output": np.bool_}
    arrays = {"text_input": np.array([text if isinstance(text, bytes) else text.encode()], dtype=object)}
    for k, v in kw.items():
        arrays[k] = (np.array([s if isinstance(s, bytes) else s.encode() for s in v], dtype=object) if k == "stop"
                     else np.array([v], dtype=types_[k]))
    names = {np.int32: "INT32", np.uint64: "UINT64", np.float32: "FP32", np.bool_: "BOOL"}
    out = []
    for name, a in arrays.items():
        i = grpcclient.InferInput(name, list(a.shape), "BYTES" if a.dtype == object else names[a.dtype.type])
        i.set_data_from_numpy(a)
        out.append(i)
    return out


def grpc_stream(server, text, model="eagle", cancel_after: int | None = None, **kw):
    """One request over a gRPC stream -> list of (result or error, is_final). cancel_after: stop
    the stream (cancelling the request) once that many responses arrived."""
    import tritonclient.grpc as grpcclient

    q: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    got = []
    try:
        client.async_stream_infer(model, grpc_inputs(text, **kw), enable_empty_final_response=True)
        while True:
            if cancel_after is not None and len(got) >= cancel_after:
                client.stop_stream(cancel_requests=True)
                return got
            result, error = q.get(timeout=60)
            if error is not None:
                got.append((error, True))
                return got
            params = result.get_response().parameters
            final = params["triton_final_response"].bool_param if "triton_final_response" in params else False
            got.append((result, final))
            if final:
                return got
    finally:
        client.stop_stream()
        client.close()


# ------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("prompt", PROMPTS[:3])
def test_http_generate_equals_the_runtime(server, reference, prompt):
    want = reference.generate(prompt, max_new_tokens=24)
    got = generate(server, text_input=prompt, max_tokens=24, exclude_input_in_output=True)
    assert got["text_output"] == want.text and got["finish_reason"] == want.finish_reason
    assert got["new_tokens"] == want.stats.new_tokens and got["prompt_tokens"] == want.stats.prompt_tokens
    assert math.isclose(got["mean_accept_len"], want.stats.mean_accept_len, rel_tol=1e-4)
    assert json.loads(got["stats"])["new_tokens"] == want.stats.new_tokens
    # the curl of the README: defaults (input prepended, default max_tokens 128 within capacity)
    plain = generate(server, text_input=prompt, max_tokens=24)
    assert plain["text_output"] == prompt + want.text


@pytest.mark.parametrize("prompt", PROMPTS[:3])
def test_grpc_stream_has_one_final_flag_and_equals_the_non_streamed_text(server, reference, prompt):
    want = reference.generate(prompt, max_new_tokens=64).text
    responses = grpc_stream(server, prompt, max_tokens=64, stream=True)
    assert [final for _, final in responses].count(True) == 1 and responses[-1][1]
    texts = [r.as_numpy("text_output")[0] for r, _ in responses]
    assert all(t.decode("utf-8") == t.decode("utf-8", "strict") for t in texts)  # whole characters only
    assert b"".join(texts).decode("utf-8") == want
    assert responses[-1][0].as_numpy("finish_reason")[0] in (b"length", b"stop")
    single = grpc_stream(server, prompt, max_tokens=64, exclude_input_in_output=True)
    assert len(single) == 1 and single[0][1] and single[0][0].as_numpy("text_output")[0].decode() == want


def test_http_generate_stream_equals_generate(server, reference):
    want = reference.generate(PROMPTS[1], max_new_tokens=64)
    events = generate_stream(server, text_input=PROMPTS[1], max_tokens=64, stream=True)
    assert "".join(e["text_output"] for e in events) == want.text
    assert [("finish_reason" in e) for e in events] == [False] * (len(events) - 1) + [True]
    assert events[-1]["new_tokens"] == want.stats.new_tokens
    one = generate_stream(server, text_input=PROMPTS[1], max_tokens=64, exclude_input_in_output=True)
    assert len(one) == 1 and one[0]["text_output"] == want.text


def test_two_instances_serve_eight_concurrent_requests_each_its_solo_output(server, reference):
    jobs = [(p, 16 + 8 * (i % 4)) for i, p in enumerate(PROMPTS)]
    solo = [reference.generate(p, max_new_tokens=n).text for p, n in jobs]

    def one(job):
        p, n = job
        if jobs.index(job) % 2:
            return "".join(r.as_numpy("text_output")[0].decode() for r, _ in grpc_stream(server, p, max_tokens=n,
                                                                                          stream=True))
        return generate(server, text_input=p, max_tokens=n, exclude_input_in_output=True)["text_output"]

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(one, jobs))
    assert got == solo
    stats = json.loads(http(server, "/v2/models/eagle/stats")[1])["model_stats"][0]["inference_stats"]["success"]
    assert stats["count"] >= len(jobs)


def test_max_tokens_and_stop_inside_an_accepted_chunk(server, reference):
    prompt = PROMPTS[0]
    for n in (7, 13):  # the oracle accepts 5 tokens per round: both limits fall inside a chunk
        want = reference.generate(prompt, max_new_tokens=n)
        got = generate(server, "oracle", text_input=prompt, max_tokens=n, exclude_input_in_output=True)
        assert got["text_output"] == want.text and got["new_tokens"] == n and got["finish_reason"] == "length"
        assert got["mean_accept_len"] >= 2.0, got  # multi-token chunks did happen
    full = reference.generate(prompt, max_new_tokens=60).text
    stop = next(c for c in full[3:] if c.isascii() and c.isprintable())  # (random weights: few printable)
    want = reference.generate(prompt, max_new_tokens=60, stop=[stop])
    got = generate(server, "oracle", text_input=prompt, max_tokens=60, stop=[stop], exclude_input_in_output=True)
    assert got["text_output"] == want.text and got["finish_reason"] == "stop" and stop not in got["text_output"]
    assert got["mean_accept_len"] > 1.5
    streamed = grpc_stream(server, prompt, "oracle", max_tokens=60, stop=[stop], stream=True)
    assert b"".join(r.as_numpy("text_output")[0] for r, _ in streamed).decode() == want.text


@pytest.mark.parametrize("body, message", [
    ({"max_tokens": 8}, "input"),  # no text_input: Triton itself refuses it
    ({"text_input": "hi", "max_tokens": 0}, "max_tokens must be"),
    ({"text_input": "hi", "max_tokens": -3}, "max_tokens must be"),
    ({"text_input": "hi", "top_p": 0}, "top_p"),
    ({"text_input": "", "max_tokens": 8}, "text_input"),
])
def test_bad_http_request_gets_an_error_and_the_server_keeps_serving(server, body, message):
    status, data = http(server, "/v2/models/eagle/generate", body)
    assert status >= 400 and message in json.loads(data)["error"], (status, data)
    assert generate(server, text_input="hi", max_tokens=4)["new_tokens"] == 4


def test_nan_temperature_and_bad_utf8_over_grpc_get_errors(server):
    from tritonclient.utils import InferenceServerException

    for kw in ({"temperature": float("nan")}, {"stop": [b"\xff"]}):
        (err, final), = grpc_stream(server, "hi", max_tokens=4, **kw)
        assert isinstance(err, InferenceServerException) and final, err
    (ok, final), = grpc_stream(server, "hi", max_tokens=4)
    assert final and ok.as_numpy("new_tokens")[0] == 4


def http_stream_then_hang_up(server, model: str, **body) -> bytes:
    """Open generate_stream on a raw socket, read until the first SSE event has arrived (the
    headers may come in a packet of their own), close the connection; returns what was read."""
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=60) as sock:
        sock.sendall(f"POST /v2/models/{model}/generate_stream HTTP/1.1\r\nHost: t\r\nContent-Type: application/json"
                     f"\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
        got = b""
        while b"data: " not in got:
            chunk = sock.recv(65536)
            if not chunk:
                break
            got += chunk
        return got


@pytest.mark.parametrize("client", ["grpc", "http"])
def test_client_gone_stops_decoding_and_the_instance_serves_on(server, reference, client):
    # the "paced" model commits one token per 20 ms (tests/triton/oracle.py: PacedDrafter), so a
    # 200-token request lasts >= 4 s: the cancel (polled every 50 ms) lands mid-decode on any machine
    prompt = next(p for p in PROMPTS if len(next(iter(reference.stream(p, max_new_tokens=200)), "")) > 0)
    full = reference.generate(prompt, max_new_tokens=200).text
    marker = "request cancelled by the client"
    before = server.log_path.read_text(errors="replace").count(marker)
    if client == "grpc":  # tritonclient's stop_stream(cancel_requests=True)
        got = grpc_stream(server, prompt, "paced", cancel_after=1, max_tokens=200, stream=True)
        assert len(got) == 1 and not got[0][1]
    else:  # an SSE client that hangs up after the first event
        assert b"data: " in http_stream_then_hang_up(server, "paced", text_input=prompt, max_tokens=200, stream=True)
    deadline = time.monotonic() + 30
    log = ""
    while time.monotonic() < deadline:
        log = server.log_path.read_text(errors="replace")
        if log.count(marker) > before:
            break
        time.sleep(0.1)
    assert log.count(marker) > before, "the request was not cancelled"
    line = [x for x in log.splitlines() if marker in x][-1]
    assert "paced" in line and "decoding stopped after" in line, line
    characters = int(re.search(r"after (\d+) characters", line).group(1))
    assert characters < len(full), (characters, len(full))  # it stopped mid-decode, not at the end
    assert generate(server, "paced", text_input="hi", max_tokens=5)["new_tokens"] == 5


def test_served_config_is_decoupled_with_the_written_parameters(server, tiny):
    status, data = http(server, "/v2/models/eagle/config")
    config = json.loads(data)
    assert status == 200 and config["model_transaction_policy"]["decoupled"] is True
    assert config["max_batch_size"] == 0 and config["instance_group"][0]["count"] == 2
    assert config["parameters"]["engines"]["string_value"] == str(tiny.absolute())
    assert [i["name"] for i in config["input"]][0] == "text_input"


def test_unload_and_reload_while_idle(server):
    import psutil

    def workers(model):  # decode workers of this server (its stubs' children) serving `model`
        found = []
        for p in psutil.Process(server.proc.pid).children(recursive=True):
            try:
                cmd = " ".join(p.cmdline())
            except psutil.Error:
                continue
            if "eagle_deploy.triton.worker" in cmd and f'"name": "{model}/' in cmd:
                found.append(p)
        return found

    assert len(workers("oracle")) == 1 and len(workers("eagle")) == 2
    assert http(server, "/v2/repository/models/oracle/unload", {})[0] == 200
    deadline = time.monotonic() + 60
    while (server.ready("oracle") or workers("oracle")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not server.ready("oracle") and workers("oracle") == []  # its worker process ended with it
    assert generate(server, text_input="hi", max_tokens=3)["new_tokens"] == 3  # the other model serves on
    assert http(server, "/v2/repository/models/oracle/load", {})[0] == 200
    assert server.ready("oracle") and len(workers("oracle")) == 1
    assert generate(server, "oracle", text_input="hi", max_tokens=6)["new_tokens"] == 6


def test_launcher_links_the_stub_and_prints_the_command(tmp_path, capsys):
    _server_or_skip()
    from eagle_deploy.triton import serve

    backends = serve.prepare_backends(tmp_path / "backends", "3.11")
    stub = backends / "python" / "triton_python_backend_stub"
    assert stub.is_symlink() and stub.resolve() == (serve.wheel_root() / "python_backend_stubs" / "3.11" /
                                                    "triton_python_backend_stub").resolve()
    assert (backends / "python" / "libtriton_python.so").exists()
    assert serve.prepare_backends(tmp_path / "backends", "3.11") == backends  # idempotent
    with pytest.raises(FileNotFoundError, match="no Python-backend stub for Python 2.7"):
        serve.prepare_backends(tmp_path / "other", "2.7")
    assert serve.main(["--repo", str(tmp_path / "repo"), "--http-port", "9000", "--print-command", "--",
                       "--log-verbose=1"]) == 0
    cmd = capsys.readouterr().out.split()
    assert cmd[0].endswith("pytriton/tritonserver/bin/tritonserver") and "--http-port=9000" in cmd
    assert cmd[-1] == "--log-verbose=1" and any(c.startswith("--backend-directory=") for c in cmd)
